"""Why did a job fail, is this machine ready, is this script written correctly.

    disttrain doctor logs job.log        # logs.diagnose(): root cause, rank, evidence, fix
    disttrain doctor                     # preflight.run_checks(): this machine before a run
    disttrain lint train.py              # lint.lint_paths(): the DDP checklist, statically
    disttrain env                        # envreport.collect(): a copy-pasteable report

A deployment guide's troubleshooting section, checklist and diagnostic commands as
software (docs/troubleshooting.md lists what each part covers). The log and lint modules
never import torch, so they answer in milliseconds; preflight and env import it lazily,
only for what they report about it.
"""

from __future__ import annotations

from disttrain.diagnose.logs import CAUSES, Diagnosis, diagnose, format_diagnosis

__all__ = ["CAUSES", "Diagnosis", "diagnose", "format_diagnosis"]
