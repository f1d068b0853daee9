"""The built-in workloads (SimpleNet on digits, mnist, synthetic; seed002's Linear): what
`disttrain run` trains when it is given no script, to show and to test the Trainer. The
spec's `example` field names one (docs/architecture.md).

- workload.py    build_workload(spec, rt): the model and this rank's loaders
- models.py      SimpleNet, Seed002Net
- datasets.py    the datasets (offline unless --download) and the fork server's warm copy
"""
