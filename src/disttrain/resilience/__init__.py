"""A stuck or dead rank is NAMED, never waited on forever: the heartbeat (rank side), the
watchdog (launcher / rank-0 side) and the fault-injection hook the tests use
(docs/resilience.md)."""
