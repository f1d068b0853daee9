"""INSIDE one rank: where it sits in the job (env), its per-process settings (process: allocator,
threads, seeds, its own session), the process group and its device (runtime; gloo_drain: its
end waits until gloo's worker threads are idle), how the model is
spread (strategies: none | dp | ddp | fsdp, with fsdp), DDP communication hooks (comm_hooks)
and how they wait for the all-reduce (comm_wait: poll or block), activation checkpointing
(activation_ckpt), the
cross-rank sync check (sync_check), which torch a job needs (torch_compat, torch-free), and
the device mesh, tensor-parallel plans (GPT2's Conv1D ones in tp_plans) and pipeline stages
(mesh, tensor_parallel, tp_plans, pipeline, and stage_link: activations between stages for
evaluation), and data parallel on top of them (composed: FSDP2 x TP, replicas' gradient
average)."""
