"""The `disttrain` command line: one small module per verb group, loaded on demand.

- main.py          the lazy verb table and the entry point
- options.py       flags generated from the JobSpec fields, the task-argument flags, `fail()`
- run_cmd.py       `disttrain run`          - verify_cmd.py    `disttrain verify`
- bench_cmd.py     `disttrain bench`        - plan_cmd.py      `disttrain plan`
- doctor_cmd.py    `disttrain doctor`       - lint_cmd.py      `disttrain lint`
- env_cmd.py       `disttrain env`          - top_cmd.py       `disttrain top`
- report_cmd.py    `disttrain report`       - finetune_cmd.py  `disttrain finetune`
- k8s_cmd.py       `disttrain k8s ...`, with k8s_verify_cmd.py (`k8s verify`) and
                   k8s_top_cmd.py (`k8s top`) over k8s_common.py (their shared options)
"""
