"""Why did a job fail, is this machine ready, is this script written correctly.

    disttrain doctor logs job.log        # logs.diagnose(): root cause, rank, evidence, fix
    disttrain doctor                     # preflight.run_checks(): this machine before a run
    disttrain lint train.py              # lint.lint_paths(): the DDP checklist, statically
    disttrain env                        # envreport.collect(): a copy-pasteable report

- logs.py (the engine) over log_parse.py / log_normalize.py / log_sources.py (the log's lines,
  with rank and host), log_signature.py + log_rules.py / log_rules_net.py / log_rules_host.py /
  log_rules_hami.py (the signatures), log_hits.py / log_confidence.py (evidence, and which
  hit is the root cause), log_causes.py / log_advice.py (what each cause means, the fix)
- lint.py over lint_ctx.py (imports, rank-0 guards), lint_flow.py (where values come from),
  lint_locals.py (the local modules a script imports), lint_registry.py and the rules:
  rules_checklist.py, rules_sync.py, rules_pitfalls.py, rules_scripts.py
- preflight.py + system.py (`doctor`), envreport.py (`env`)

A deployment guide's troubleshooting section, checklist and diagnostic commands as
software (docs/troubleshooting.md lists what each part covers). The log and lint modules
never import torch, so they answer in milliseconds; preflight and env import it lazily,
only for what they report about it.
"""

from __future__ import annotations

from disttrain.diagnose.logs import CAUSES, Diagnosis, diagnose, format_diagnosis

__all__ = ["CAUSES", "Diagnosis", "diagnose", "format_diagnosis"]
