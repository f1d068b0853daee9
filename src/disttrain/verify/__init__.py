"""Is the distributed setup correct? `verify_checks.py` holds the torch-only checks (shipped as one
file in a pod's ConfigMap, so it imports nothing from disttrain at module level);
`runner.py` runs them locally and shapes the report (docs/verify-and-bench.md)."""
