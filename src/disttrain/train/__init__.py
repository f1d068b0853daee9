"""THE LOOP: the Trainer, what builds it from a spec, precision, optimizers and LR rules,
checkpoints (atomic .pt, DCP, the resume policy) and the rank loaders (docs/architecture.md)."""
