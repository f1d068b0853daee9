"""WHAT a job is: the JobSpec (pydantic + YAML), its cluster section, and every rule that
can be checked from the spec alone. Nothing here imports torch, so `--help`, bad-flag
errors and `disttrain k8s render` answer without it (docs/architecture.md)."""
