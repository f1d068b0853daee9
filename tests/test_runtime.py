"""Runtime: the env contract, backend choice, seeding."""

from __future__ import annotations

import pytest
import torch

from disttrain.distributed import runtime
from disttrain.distributed.runtime import read_env, resolve_backend
from disttrain.errors import DistEnvError


def test_no_vars_is_single_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    assert not env.launched


def test_full_torchrun_env():
    env = read_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "pod-0.svc", "MASTER_PORT": "12355"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("pod-0.svc", 12355)


@pytest.mark.parametrize(("env", "needle"), [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "RANK=2 must be < WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "LOCAL_RANK=-1 must be >= 0"),
])
def test_bad_env_names_the_variable(env, needle):
    with pytest.raises(DistEnvError, match=needle.replace("(", r"\(")):
        read_env(env)


def test_backend_auto():
    assert resolve_backend("auto", 2, cuda_devices=0) == "gloo"
    assert resolve_backend("auto", 2, cuda_devices=1) == "gloo"  # two ranks cannot share a GPU
    assert resolve_backend("auto", 2, cuda_devices=2) == "nccl"
    assert resolve_backend("gloo", 2, cuda_devices=2) == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_without_gpu_is_refused():
    with pytest.raises(DistEnvError, match="nccl needs CUDA"):
        resolve_backend("nccl", 1)


def test_single_process_setup_and_teardown():
    with runtime.setup("gloo", timeout_s=10, env={}) as rt:
        assert rt.is_rank0 and rt.world_size == 1 and rt.distributed
        assert rt.device.type == "cpu"
        rt.barrier()
    assert not torch.distributed.is_initialized()


def test_rank_seeds_differ_and_repeat():
    seeds = [runtime.rank_seed(0, r) for r in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [runtime.rank_seed(0, r) for r in range(4)]


def test_tune_allocator_runs():
    assert runtime.tune_allocator() in (True, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_binding():
    with runtime.setup("nccl", timeout_s=30, env={}) as rt:
        assert rt.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
