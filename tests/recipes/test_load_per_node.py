"""Loaded once per node (issue 23, item 2): under DDP, local rank 0 of each node reads the
weights from that node's own copy of the model directory and sends them to its node's ranks
only; no weight crosses between nodes.

Two "nodes" of two ranks on loopback: a gloo job of 4 whose ranks are told LOCAL_RANK =
rank % 2 and LOCAL_WORLD_SIZE = 2, each node pointed at its own copy of the model folder
(as each host mounts its own /models). Every tensor read from a checkpoint file is counted
per rank and per folder: each node's folder is read exactly once, by its local rank 0, and
every rank ends with the same weights (the LoRA adapters' starting values included). DDP is
asked not to broadcast rank 0's weights again at start (`init_sync=False`), which is safe
because the nodes' copies are compared first: a node holding other weights is refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from disttrain import envvars
from disttrain.testing import run_ranks
from tests.conftest import needs
from tests.recipes import hf_fixtures as fx

pytestmark = [needs("transformers", "peft"), pytest.mark.slow, pytest.mark.timeout(300)]

PER_NODE = 2


def _load_on_node(root: str) -> dict[str, Any]:
    import torch

    from disttrain.distributed.strategies import WrapOptions, wrap
    from disttrain.recipes import load_once
    from disttrain.recipes.causal_lm import go_offline
    from disttrain.testing import setup_for_test

    rank = int(os.environ[envvars.RANK])
    node = rank // PER_NODE
    os.environ[envvars.LOCAL_RANK] = str(rank % PER_NODE)
    os.environ[envvars.LOCAL_WORLD_SIZE] = str(PER_NODE)
    go_offline()
    reads: dict[str, int] = {}
    real = load_once._file_tensors

    def counted(path: Path):   # every tensor really read, by folder
        for key, read in real(path):
            def read_counted(read=read) -> torch.Tensor:
                reads[path.parent.name] = reads.get(path.parent.name, 0) + 1
                return read()
            yield key, read_counted

    load_once._file_tensors = counted
    asked: dict[str, Any] = {}
    with setup_for_test() as rt:
        def ddp(m: torch.nn.Module, **extra: Any) -> torch.nn.Module:   # as build_trainer's
            asked.update(extra)
            return wrap(m, "ddp", rt, WrapOptions(extra=extra))

        def load(folder: str) -> tuple[torch.nn.Module, int]:
            torch.manual_seed(0)   # the Trainer seeds every rank alike before building
            pretrained = load_once.Pretrained(Path(root) / folder,
                                              lora=load_once.LoraSettings(r=4, target_modules="all-linear"))
            return pretrained.load(pretrained.build(), rt, "ddp", ddp), len(pretrained.names)

        try:   # node 1's copy holds other weights: refused on every rank, before DDP
            load("node0" if node == 0 else "other")
            refused = ""
        except load_once.TaskError as exc:
            refused = str(exc)
        reads.clear()
        model, tensors = load(f"node{node}")
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().numpy().tobytes())
        lora_a_set = any(t.abs().sum() > 0 for n, t in model.state_dict().items()
                             if "lora_A" in n)
        return {"reads": reads, "sha": digest.hexdigest(), "node": node,
                "local_rank": rt.local_rank, "lora_a_set": bool(lora_a_set),
                "tensors": tensors, "asked": asked, "refused": refused}


def test_each_node_reads_its_own_copy_once_and_all_ranks_agree(tmp_path: Path) -> None:
    docs = fx.corpus(8000)
    made = fx.make_model_dir(tmp_path, "llama", docs=docs)
    for node in range(2):
        shutil.copytree(made, tmp_path / f"node{node}")
    other = fx.make_model_dir(tmp_path / "seed1", "llama", seed=1, docs=docs)
    shutil.copytree(other, tmp_path / "other")
    ranks = run_ranks(2 * PER_NODE, _load_on_node, str(tmp_path), timeout_s=200)
    tensors = ranks[0]["tensors"]
    assert tensors > 0
    for rank, got in ranks.items():
        assert got["local_rank"] == rank % PER_NODE
        # the node's local rank 0 reads every tensor of its own folder once; the others none
        expected = {f"node{got['node']}": tensors} if got["local_rank"] == 0 else {}
        assert got["reads"] == expected, (rank, got["reads"])
        assert got["lora_a_set"], rank   # the adapters got the reader's starting values
        assert got["asked"] == {"init_sync": False}, rank
        assert "the nodes' copies of" in got["refused"] and "differ" in got["refused"], got["refused"]
    assert len({got["sha"] for got in ranks.values()}) == 1
