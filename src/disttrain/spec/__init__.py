"""WHAT a job is: the JobSpec (pydantic + YAML, `job.py`), its cluster section
(`cluster.py`), the shared field types and choice lists (`fields.py`), the checks of
user-given paths (`paths.py`), the rules that need the machine (`rules.py`) and the
`parallelism` section (`parallelism.py`). Nothing
here imports torch, so `--help`, bad-flag errors and `disttrain k8s render` answer
without it (docs/architecture.md)."""
