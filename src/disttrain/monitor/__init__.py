"""WATCH a run (docs/monitoring.md): what a run directory says about a job, live and after.

- live.py         read RUN_DIR/live/rank-<R>.json (+ straggler.json, summary.json): one frame
- top.py          `disttrain top`: the live frame as a rich table, refreshed until the job ends
- report.py       `disttrain report`: report.png (loss, samples/s, step-time breakdown) + table
- tensorboard.py  rank 0's TensorBoard event files under RUN_DIR/tb/ (when tensorboard is installed)
- script_live.py  the live files of a user's own script, from its hooks alone
- pods.py         `disttrain k8s top`: the live frame of a job on the cluster, read from its pods

Nothing here imports torch at module level, and this file imports nothing, so the run
directory's TensorBoard hook does not pull in the rest.
"""
