"""INSIDE one rank: where it sits in the job (env), its per-process settings (process: allocator,
threads, seeds), the process group and its device (runtime), how the model is spread (strategies:
none | dp | ddp | fsdp, with fsdp), DDP communication hooks, activation checkpointing, and the
cross-rank sync check."""
