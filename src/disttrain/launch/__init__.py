"""START the ranks on this machine: the pure torchrun argv (`argv`), the launch plan (`plan`:
port, worker env, the one LaunchConfig builder), the launchers (`launchers`: torchrun |
spawn | env behind one protocol, with mp.spawn's in `spawn` and the signal handling they
share in `signals`) and their one result type (`result`: typed failures),
what of torch's agent's log they keep off the output (`agent_logs`), a private folder for
the files torch's agent would leave in /tmp (`agent_scratch`), the warm fork
server (`forkserver`, with `forkserver_preload`: what it imports, and a built-in task's
data), whether a script starts its own workers (`own_workers`), and two stdlib leaves:
`devices` (GPUs visible here) and `ports` (every socket probe), which rank-side code asks
too. The rest is launcher-side only: nothing else here runs inside a rank
(docs/architecture.md)."""
