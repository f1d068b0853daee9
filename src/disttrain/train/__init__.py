"""THE LOOP (docs/architecture.md):

- trainer.py     the Trainer: epochs, accumulation, eval, records, the end-of-run summary
- task.py        TrainTask; load_task: a reference + task_args -> TrainTask (the one way)
- fit.py         disttrain.fit(task, spec) from a script under torchrun
- build.py       build_trainer(spec, rt): the spec's task, strategy, comm hook, optimizer, writer
- model_parallel.py  tensor / pipeline parallel in the Trainer: mesh, split, step, eval, checkpoints
- steps.py       how one batch becomes a loss (step_fn, or loss_fn)
- evaluate.py    each held-out sample once, over every rank's shard
- iterable_loader.py  an IterableDataset that shards itself; every rank stops together
- memory.py      what a rank really used, for summary.json and the live files
- frozen_tracking.py  torch's memory tracker that follows frozen parameters (a LoRA base)
- ckpt_compat.py does a checkpoint fit the model it is loaded into
- run_info.py    RunInfo, the resolved settings the banner and summary.json show
- precision.py   Precision, the AMP axis (autocast dtype, loss scaler)
- optim.py       optimizers, LR scaling with the global batch, warm-up
- checkpoint.py  atomic .pt files, FSDP's sharded folders, TrainState and the resume policy
- ckpt_integrity.py  each checkpoint's manifest (sha256 of its files), a full disk's error
- ckpt_sharded.py    FSDP's torch.distributed.checkpoint folders
- ckpt_trainable.py  checkpoints without the frozen base (LoRA): trainable parameters only
- loader.py      ShardedLoader, this rank's batches of in-memory tensors
- telemetry.py   StepTelemetry: the one owner of step telemetry (records, live files,
                 metrics rows, the straggler verdict's inputs); the loop calls it at a few points
- step_timing.py StepTimer: each rank's step split into data, compute, comm wait, optimizer
- phases.py      the step-time phases, one list for every writer and reader (no torch)
- straggler.py   find_straggler, StragglerWatch: the rank the others wait for, and why (no torch)
"""
