"""Benchmarks: all-reduce bandwidth, scaling over processes, Trainer overhead.

    disttrain bench allreduce --sizes 4K:256M --json
    disttrain bench scaling --max-procs 2
    disttrain bench overhead --rounds 5

- allreduce.py   all-reduce bandwidth (nccl-tests' algbw / busbw)
- training.py    scaling over processes, and the Trainer against a plain DDP loop
- contend.py     N busy processes on the same cores, for a benchmark's duration (--contend)
- common.py      the run directory, size parsing, statistics and plotting

Every bench writes its figures to a run directory (default
`runs/bench-<kind>-<UTC timestamp>/`: results.json, results.jsonl and a PNG) so that runs
can be compared over time; see docs/verify-and-bench.md.
"""
