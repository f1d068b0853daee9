"""Inside one rank: the env contract (env.py), per-process settings (process.py), and the
process group's lifecycle, backend and timeout (runtime.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from disttrain.distributed import process, runtime
from disttrain.distributed.env import read_env
from disttrain.distributed.runtime import collective_timeout_s, resolve_backend
from disttrain.errors import DistEnvError
from disttrain.testing import run_ranks, setup_for_test


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


def test_collective_timeout_adds_a_grace():
    """10 % on top of the stall timeout, at least 2 s and at most 30 s, so the watchdog
    names the stuck rank before a waiting rank's collective times out."""
    assert collective_timeout_s(300) == 330 and collective_timeout_s(10) == 12
    assert collective_timeout_s(1000) == 1030


def test_single_process_setup_and_teardown():
    with runtime.setup("gloo", timeout_s=10, env={}) as rt:
        assert rt.is_rank0 and rt.world_size == 1 and rt.distributed
        assert rt.device.type == "cpu"
        assert rt.store_address is None  # a private store: no heartbeat to publish
        rt.barrier()
    assert not torch.distributed.is_initialized()


def test_setup_threads_default_and_explicit():
    before = torch.get_num_threads()
    try:
        with runtime.setup("gloo", timeout_s=10, env={}):
            assert torch.get_num_threads() == process.threads_per_rank(1)
        with runtime.setup("gloo", timeout_s=10, env={}, threads=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_per_rank_shares_the_cores():
    cores = process.usable_cores()
    assert process.threads_per_rank(1) == cores
    assert process.threads_per_rank(cores * 4) == 1  # never 0
    assert process.threads_per_rank(0) == cores


def test_rank_seeds_differ_and_repeat():
    seeds = [process.rank_seed(0, r) for r in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [process.rank_seed(0, r) for r in range(4)]


def test_seed_everything_repeats():
    process.seed_everything(7)
    a = torch.rand(3)
    process.seed_everything(7)
    assert torch.equal(a, torch.rand(3))


def test_tune_allocator_runs():
    assert process.tune_allocator() in (True, False)


def test_tune_allocator_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_NO_MALLOPT", "1")
    assert process.tune_allocator() is False


def _imported_after(code: str) -> set[str]:
    """Modules a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return set(out.split())


def test_env_and_process_do_not_import_torch():
    """The launcher and the CLI read the env contract and threads per rank before any
    worker exists; neither may pay for `import torch`."""
    mods = _imported_after("import disttrain.distributed.env, disttrain.distributed.process")
    assert "torch" not in mods


def test_heartbeat_needs_no_runtime_and_loads_faults_only_when_asked(monkeypatch):
    """The heartbeat takes plain values (no import of the process-group side), and the
    test-only fault module is not loaded by a run that injects no fault."""
    monkeypatch.delenv("DISTTRAIN_FAULT", raising=False)
    mods = _imported_after("from disttrain.resilience import heartbeat\n"
                           "heartbeat.start(0, 10.0)\nheartbeat.beat(1)\nheartbeat.stop()")
    assert "disttrain.distributed.runtime" not in mods
    assert "disttrain.resilience.faults" not in mods


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_binding():
    with runtime.setup("nccl", timeout_s=30, env={}) as rt:
        assert rt.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0


def _setup_four_times() -> list[float]:
    """The default group made, used and destroyed four times in one process (two fits in
    a notebook, a sweep): each round's all_reduce must see this round's peers."""
    import torch.distributed as dist

    sums = []
    for round_ in range(4):
        with setup_for_test():
            t = torch.tensor([float(dist.get_rank() + 10 * round_)])
            dist.all_reduce(t)
            sums.append(t.item())
    return sums


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_default_group_can_be_made_again_in_one_process():
    """torch names every new default group "0", so under torchrun's agent store the second
    group's ranks could read the first's gloo addresses ("Connection refused" in
    connectFullMesh); runtime._round_store gives each group after the first its own prefix.
    Without it this test failed 1 of 2 runs here (the stale read is a race), with it 0 of 5."""
    out = run_ranks(2, _setup_four_times, timeout_s=60)
    assert out[0] == out[1] == [1.0, 21.0, 41.0, 61.0]


def _ddp_gather_and_leave(_: int) -> tuple[bool, bool, int]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    with setup_for_test() as rt:
        world = dist.group.WORLD
        model = DistributedDataParallel(torch.nn.Linear(16, 16))
        model(torch.randn(4, 16)).sum().backward()
        gathered = rt.all_gather_object({"rank": rt.rank, "pad": list(range(200))})
    kept = any(group is world for group in runtime._RETIRED)
    del model   # the Reducer's reference to the group goes here: never its last one
    return sys.modules.get("torch._dynamo") is not None, kept, len(gathered)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_leaving_the_group_after_ddp_and_a_gather_does_not_deadlock():
    """torch._dynamo imported before the group (the test ranks' fork server preloads it),
    DDP, an all_gather_object, then the `with` block's end: the group destroy_process_group
    let go was freed with the Reducer, and ~ProcessGroupGloo joined a gloo worker waiting for
    the GIL (1 in ~8 rounds on 2 busy cores). `Runtime.shutdown` keeps it (`_RETIRED`);
    several rounds, each bounded by run_ranks' wall clock."""
    for i in range(6):
        out = run_ranks(2, _ddp_gather_and_leave, i, timeout_s=30, wall_s=60)
        assert out[0] == out[1] == (True, True, 2), (i, out)


class _CountingStore:
    """The job's store as `Runtime._fail_together` uses it: `add` counts failed ranks;
    `others` more ranks arrive after `after` polls (None: never)."""

    def __init__(self, others: int, after: int | None) -> None:
        self.count, self.others, self.after, self.polls = 0, others, after, 0

    def add(self, key: str, n: int) -> int:
        assert key == runtime._FAILED_KEY
        self.count += n
        if n == 0:
            self.polls += 1
            if self.after is not None and self.polls == self.after:
                self.count += self.others
        return self.count


@pytest.mark.parametrize(("rank", "agent", "after", "polls"), [
    (0, False, 3, 3),      # rank 0 hosts the store: it waits until rank 1 failed too
    (0, False, None, None),  # rank 1 never fails (it waits in a collective): the bound ends it
    (0, True, 3, 0),       # torchrun's agent hosts the store: nothing to do
    (1, False, 3, 0),      # not the host: counted (in a thread), no wait
])
def test_a_failing_rank_that_hosts_the_store_waits_for_the_others(monkeypatch, rank, agent, after, polls):
    env = read_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    store = _CountingStore(others=1, after=after)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(runtime, "FAIL_TOGETHER_S", 0.3)
    if agent:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    rt = runtime.Runtime(env, "gloo", torch.device("cpu"), 10.0, owns_group=True)
    rt._fail_together()
    assert store.count >= (0 if agent else 1)   # this rank is counted where it matters
    if polls is None:
        assert store.polls >= 3 and store.count == 1   # polled until the bound
    else:
        assert store.polls == polls


class _DeadStore:
    """rank 0's store across a link that is down: `add` never returns."""

    def add(self, key: str, n: int) -> int:
        threading.Event().wait()
        return 0


def test_a_failing_rank_never_waits_on_a_store_it_cannot_reach(monkeypatch):
    """Rank 1 of a pod job whose store host is cut off (k8s run-local's partition test):
    counting itself in is bounded, so the rank leaves and its host's failure is reported."""
    env = read_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "198.18.0.1", "MASTER_PORT": "1"})
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", _DeadStore)
    monkeypatch.setattr(runtime, "_COUNT_IN_S", 0.2)
    rt = runtime.Runtime(env, "gloo", torch.device("cpu"), 10.0, owns_group=True)
    done = threading.Event()
    threading.Thread(target=lambda: (rt._fail_together(), done.set()), daemon=True).start()
    assert done.wait(timeout=10), "_fail_together blocked on an unreachable store"
