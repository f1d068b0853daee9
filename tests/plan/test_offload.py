"""CPU offload of FSDP's state (`train.cpu_offload`, issue 22 item 3): the plan moves the
rank's shards, gradients and optimizer state from the device peak to host memory, the fit
search offers `--cpu-offload`, a ddp job is refused it, and a real 2-rank gloo FSDP run
with it trains and peaks (less the offloaded state) where the plan says.

The run's device is the CPU here, so "host" and "device" are the same memory: torch accepts
CPUOffloadPolicy on a CPU device (with pin_memory off, which needs an accelerator), and the
probe leaves the offloaded categories out of its figure as the plan does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disttrain.plan.fit import combinations
from disttrain.plan.job import plan_task
from disttrain.plan.trace import Knobs
from disttrain.plan.tracing import trace_memory
from tests.plan.tasks import TASKS

BATCH = 64
KNOBS = Knobs(strategy="fsdp", world_size=2, local_world_size=2, batch_size=BATCH)


@pytest.fixture(scope="module")
def planned() -> dict[bool, Any]:
    return {off: trace_memory(TASKS["dict"](), KNOBS.replace(cpu_offload=off))
            for off in (False, True)}


def test_offload_moves_shards_grads_and_optimizer_state_to_host(planned: dict[bool, Any]) -> None:
    kept, off = planned[False], planned[True]
    state = kept.largest["parameters"] + kept.largest["gradients"] + kept.largest["optimizer"]
    assert off.host_bytes == state, (off.host_bytes, kept.largest)
    # the device peak loses at least the parameter and optimizer share it had at its peak
    share = kept.at_peak["parameters"] + kept.at_peak["optimizer"]
    assert share > 0
    assert off.peak_bytes <= kept.peak_bytes - 0.9 * share, (off.peak_bytes, kept.peak_bytes)
    assert off.at_peak["parameters"] == off.at_peak["optimizer"] == 0
    # what the step itself needs stays on the device
    assert off.peak_bytes >= kept.at_peak["activations"]


def test_offloaded_state_is_counted_in_host_memory() -> None:
    task = TASKS["dict"]()
    kept = plan_task(task, KNOBS, memory_limit="8Gi")
    off = plan_task(task, KNOBS.replace(cpu_offload=True), memory_limit="8Gi")
    assert "offload_mib" not in kept.host
    assert off.host["offload_mib"] == pytest.approx(off.tensors.host_bytes / 2**20, abs=0.1)
    assert off.host["per_rank_mib"] >= kept.host["per_rank_mib"]
    assert off.peak_bytes < kept.peak_bytes
    assert any("CPU offload" in n for n in off.notes)
    assert off.as_dict()["knobs"]["cpu_offload"] is True


def test_the_fit_search_offers_cpu_offload() -> None:
    fsdp = [flags for _, flags in combinations(KNOBS)]
    assert ["--cpu-offload"] in fsdp
    ddp = [(k, flags) for k, flags in combinations(KNOBS.replace(strategy="ddp"))]
    offload = [(k, f) for k, f in ddp if k.cpu_offload]
    assert offload and all(k.strategy == "fsdp" for k, _ in offload)
    assert ["--strategy", "fsdp", "--cpu-offload"] in [f for _, f in offload]
    assert all(f.count("--strategy") <= 1 for _, f in offload)
    # {fsdp, cpu-offload} and {cpu-offload} are one job: traced once
    assert len({k for k, _ in ddp}) == len(ddp)
    single = [flags for _, flags in combinations(KNOBS.replace(strategy="none", world_size=1))]
    assert not any("--cpu-offload" in f for f in single)


def test_cpu_offload_without_fsdp_is_refused() -> None:
    from disttrain.errors import SpecError
    from disttrain.spec.job import JobSpec

    with pytest.raises(SpecError, match=r"train.cpu_offload.*--strategy fsdp --cpu-offload"):
        JobSpec.from_dict({}, {"strategy": "ddp", "cpu_offload": True})
    assert JobSpec.from_dict({}, {"strategy": "fsdp", "cpu_offload": True}).train.cpu_offload


def test_cli_refuses_cpu_offload_under_ddp_with_one_line(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from disttrain.cli.main import main

    monkeypatch.chdir(tmp_path)
    code = main(["plan", "--example", "digits", "--strategy", "ddp", "--cpu-offload"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "train.cpu_offload" in err and "Traceback" not in err


def _offload_run(run_root: str) -> dict[str, Any]:
    """One rank: the dict task under fsdp with cpu_offload, through the run's own build,
    two tracked optimizer steps and four more."""
    import torch

    from disttrain.distributed.fsdp import cpu_offloaded
    from disttrain.spec.job import JobSpec
    from disttrain.testing import setup_for_test
    from disttrain.train.batch import to_device
    from disttrain.train.build import build_trainer
    from disttrain.train.memory import MemoryProbe
    from disttrain.train.steps import run_step

    with setup_for_test() as rt:
        spec = JobSpec.from_dict({}, {
            "strategy": "fsdp", "cpu_offload": True, "batch_size": BATCH, "epochs": 1,
            "checkpoint_every_epochs": 0, "run_dir": run_root, "lr": 0.01})
        trainer = build_trainer(spec, rt, TASKS["dict"]())
        model, opt = trainer.model, trainer.optimizer
        probe = MemoryProbe(model, opt, rt.device)
        batches = iter(trainer.loader)
        data = to_device(next(batches), rt.device)   # one batch, learnt again: loss must drop
        losses = []
        for step in range(1, 7):
            probe.before_micro(data)
            loss, _ = run_step(trainer.task, model, data)
            loss.backward()
            losses.append(float(loss.detach()))
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            probe.after_step(step)
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        out = {"offloaded": cpu_offloaded(model), "losses": losses,
               "peak": probe.fields()["tensor_peak_bytes"],
               "state_on_cpu": bool(states) and all(t.device.type == "cpu" for t in states)}
        if trainer.writer is not None:
            trainer.writer.close()
        return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_two_rank_offload_run_trains_where_the_plan_says(tmp_path: Path,
                                                              planned: dict[bool, Any]) -> None:
    from disttrain.testing import run_ranks

    results = run_ranks(2, _offload_run, str(tmp_path / "run"), timeout_s=240)
    for rank, r in results.items():
        assert r["offloaded"] and r["state_on_cpu"], (rank, r)
        assert r["losses"][-1] < r["losses"][0], (rank, r["losses"])
    plan = planned[True].peak_bytes
    real = results[0]["peak"]
    print(f"cpu offload: plan {plan / 2**20:.3f} MiB real {real / 2**20:.3f} MiB "
          f"ratio {plan / real:.3f}")
    assert 0.9 * plan <= real <= 1.1 * plan, (plan, real)
    # and below what the same run keeps without offload, by the plan
    assert real < planned[False].peak_bytes
