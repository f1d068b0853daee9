"""START the ranks on this machine: the pure torchrun argv, the launch plan (port, worker
env, LaunchConfig), the launchers (torchrun | spawn | env), the warm fork server and the
socket probes. Launcher-side only: nothing here runs inside a rank (docs/architecture.md)."""
