"""The built-in workloads, as TrainTasks like any user's: SimpleNet on digits, mnist and
synthetic data, the verification write-up's Linear (seed002), and chargpt (a small GPT on the
Python documentation). What `disttrain run` trains when it is given no script or task, to show
and to test the Trainer; the spec's `example` field names one (docs/architecture.md).

- workload.py    builtin_task(spec, rt): each built-in workload as a TrainTask
- models.py      SimpleNet, Seed002Net
- datasets.py    the datasets (offline unless --download) and the fork server's warm copy
- chargpt.py     the character-level GPT, its data and its task
"""
