"""INSIDE one rank: the distributed environment, the process group and its device, how the
model is spread (none | dp | ddp | fsdp), DDP communication hooks, and the cross-rank sync
check (docs/architecture.md)."""
