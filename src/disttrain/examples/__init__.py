"""The built-in workloads (SimpleNet on digits, mnist, synthetic, seed002): what `disttrain run`
trains when it is given no script, to show and to test the Trainer (docs/architecture.md)."""
