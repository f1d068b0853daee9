"""THE LOOP (docs/architecture.md):

- trainer.py     the Trainer: epochs, accumulation, eval, records, the end-of-run summary
- build.py       build_trainer(spec, rt): workload, strategy, comm hook, optimizer, writer
- run_info.py    RunInfo, the resolved settings the banner and summary.json show
- precision.py   Precision, the AMP axis (autocast dtype, loss scaler)
- optim.py       optimizers, LR scaling with the global batch, warm-up
- checkpoint.py  atomic .pt files, FSDP's sharded folders, TrainState and the resume policy
- ckpt_integrity.py  each checkpoint's manifest (sha256 of its files), a full disk's error
- ckpt_sharded.py    FSDP's torch.distributed.checkpoint folders
- loader.py      ShardedLoader, this rank's batches of in-memory tensors
- step_timing.py StepTimer: each rank's step split into data, compute, comm wait, optimizer
- straggler.py   find_straggler: the rank the others wait for, and why (no torch)
"""
