"""Host memory of loading a pretrained model into a 2-rank job: once (disttrain's recipe)
versus every rank calling `from_pretrained` (what a plain torchrun script does).

    .venv/bin/python benchmarks/finetune_load_memory.py [--layers 4] [--hidden 1024] [--strategy fsdp]

Builds a random Llama-style decoder (default ~64 M parameters, ~256 MB in fp32), saves it
with `save_pretrained` in a temp folder, then measures each rank's peak anonymous RSS
(`disttrain.recipes.host_memory`) while it loads:
- recipe: rank 0 reads the safetensors file a chunk at a time; FSDP2 ranks keep their
  shard (`recipes/load_once.py`); under ddp on CPU each rank's replica is host memory
  (on GPUs it is device memory, and the host holds only rank 0's chunk);
- every rank from_pretrained: one process's figure times the world size (each rank does
  the same thing).
Prints both in MB and as a multiple of one copy of the weights. No timing assertions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.recipes.load_memory import measure, save_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
    parser.add_argument("--file-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = save_model(Path(tmp) / "model", args.layers, args.hidden, args.file_dtype)
        got = measure(Path(tmp) / "model", args.strategy)
    mb = 1e6
    print(f"model: {size / mb:.0f} MB of fp32 weights (file in {args.file_dtype}); 2 ranks, "
          f"strategy {args.strategy}; anonymous RSS (what a memory limit cannot reclaim)")
    print(f"recipe (rank 0 reads, others receive): {got['recipe'] / mb:.0f} MB "
          f"= {got['recipe'] / size:.2f}x one copy (per rank: "
          f"{', '.join(f'{b / mb:.0f}' for b in got['recipe_per_rank'])} MB)")
    print(f"every rank from_pretrained:            {got['every_rank'] / mb:.0f} MB "
          f"= {got['every_rank'] / size:.2f}x one copy")


if __name__ == "__main__":
    main()
