"""A stuck or dead rank is NAMED, never waited on forever: the heartbeat (rank side), the
watchdog (launcher / rank-0 side) and the fault-injection hook the tests use (faults)
(docs/resilience.md). Around them: preemption (SIGTERM / SIGINT: every rank stops at one
step with a checkpoint), proctitle and ranks (which process is which: process titles,
RUN_DIR/ranks.json), process_end (how the command and a script's ranks end: a normal
exit's clean-ups without the interpreter's teardown), and a user script's side:
script_heartbeat (its optimizer steps as heartbeat), script_probes (forward passes and
collectives as progress) and spawned (a script that starts its own workers, run as plain
python would)."""
