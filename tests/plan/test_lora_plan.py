"""The memory plan of a LoRA fine-tune (issue 23, item 6): the causal-LM recipe on tiny
GPT2-style and Llama-style decoders made in a temp dir (tests/recipes/hf_fixtures.py, no
download), planned and run with the adapters trainable and the base frozen.

torch's MemTracker hooked every parameter's gradient and refused a frozen one, so neither
`disttrain plan` nor the run's MemoryProbe could follow a LoRA model
(train/frozen_tracking.py). Here the plan's per-rank tensor peak is held to the tracked
peak of the real 2-rank gloo run of the same job (10 % both ways, DDP and FSDP2, as
tests/plan/test_accuracy.py), and the plan's books count
the frozen base as parameters only: gradients and Adam's two moments of the adapters alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disttrain.plan.trace import Knobs
from disttrain.plan.tracing import trace_memory
from tests.conftest import needs
from tests.plan.measure import TOLERANCE  # both ways, as test_accuracy.py holds every strategy
from tests.recipes import hf_fixtures as fx

pytestmark = [needs("transformers", "peft"), pytest.mark.slow, pytest.mark.timeout(600)]

SEQ = 32
BATCH = 8
HIDDEN = 64
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
# (arch, strategy, precision, lora)
CONFIGS = [("gpt2", "ddp", "fp32", LORA), ("llama", "ddp", "fp32", LORA),
           ("llama", "ddp", "bf16", LORA), ("llama", "ddp", "fp32", False),
           ("llama", "fsdp", "fp32", LORA)]


def _key(arch: str, strategy: str, precision: str, lora: Any) -> str:
    return f"{arch}/{strategy}/{precision}/{'lora' if lora else 'full'}"


def _task_args(root: Path, arch: str, lora: Any) -> dict[str, Any]:
    return {"model": str(root / arch), "data": str(root / "train.jsonl"), "seq_len": SEQ,
            "lora": lora, "cache_dir": str(root / "cache"), "eval_fraction": 0.0}


def _measure(root: Path) -> dict[str, dict[str, Any]]:
    """On each real rank: each configuration's tracked tensor peak over two optimizer steps,
    the run's own build (`build_trainer`: the recipe's load-once, the strategy, the
    optimizer over the trainable parameters) and the Trainer's MemoryProbe."""
    from disttrain.spec.job import JobSpec
    from disttrain.testing import setup_for_test
    from tests.plan.measure import tracked_two_steps

    out: dict[str, dict[str, Any]] = {}
    with setup_for_test() as rt:
        for i, (arch, strategy, precision, lora) in enumerate(CONFIGS):
            spec = JobSpec.from_dict(
                {"task": "disttrain.recipes.causal_lm:make_task",
                 "task_args": _task_args(root, arch, lora)},
                {"strategy": strategy, "precision": precision, "batch_size": BATCH, "epochs": 1,
                 "checkpoint_every_epochs": 0, "run_dir": str(root / "runs" / str(i))})
            fields, trainable = tracked_two_steps(spec, rt)
            out[_key(arch, strategy, precision, lora)] = {
                "source": fields["memory_source"], "peak": fields["tensor_peak_bytes"],
                "trainable": trainable}
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fx.make_job_root(tmp_path_factory.mktemp("lora-plan"), hidden=HIDDEN)


@pytest.fixture(scope="module")
def measured(root: Path) -> dict[str, dict[str, Any]]:
    from disttrain.testing import run_ranks

    return run_ranks(2, _measure, root, timeout_s=400)[0]


@pytest.fixture(scope="module")
def planned(root: Path) -> dict[str, Any]:
    from disttrain.recipes.causal_lm import make_task

    out = {}
    for arch, strategy, precision, lora in CONFIGS:
        task = make_task(**_task_args(root, arch, lora))
        knobs = Knobs(strategy=strategy, world_size=2, local_world_size=2, precision=precision,
                      batch_size=BATCH)
        out[_key(arch, strategy, precision, lora)] = trace_memory(task, knobs)
    return out


def test_the_run_of_a_lora_model_is_measured(measured: dict[str, dict[str, Any]]) -> None:
    """The probe tracks a model with a frozen base (it was left untracked before)."""
    for key, m in measured.items():
        assert m["source"] == "tracker" and m["peak"] > 0, (key, m)


def test_lora_plan_within_tolerance_of_the_real_run(measured: dict[str, dict[str, Any]],
                                                    planned: dict[str, Any]) -> None:
    rows, misses = [], []
    for key, plan in planned.items():
        real = measured[key]["peak"]
        rows.append(f"{key:28s} plan {plan.peak_bytes / 2**20:8.3f} MiB  real "
                    f"{real / 2**20:8.3f} MiB  ratio {plan.peak_bytes / real:.3f}")
        if not (1 - TOLERANCE) * plan.peak_bytes <= real <= (1 + TOLERANCE) * plan.peak_bytes:
            misses.append(rows[-1])
    print("\n".join(rows))
    assert not misses, "\n".join(misses)


@pytest.mark.parametrize("arch", fx.ARCHS)
def test_frozen_base_is_parameters_only(measured: dict[str, dict[str, Any]],
                                        planned: dict[str, Any], arch: str) -> None:
    """The plan's gradients and Adam state are the adapters' (4 bytes per trainable fp32
    value; two moments), while the frozen base stays in its parameters."""
    key = _key(arch, "ddp", "fp32", LORA)
    books, trainable = planned[key].largest, measured[key]["trainable"]
    assert books["gradients"] == pytest.approx(4 * trainable, rel=0.05), books
    assert books["optimizer"] == pytest.approx(2 * 4 * trainable, rel=0.05), books
    assert books["parameters"] > 4 * books["gradients"], books
    if arch == "llama":   # the same model trained in full: gradients and moments of every weight
        full = planned[_key(arch, "ddp", "fp32", False)].largest
        assert full["gradients"] > 4 * books["gradients"]
        assert full["optimizer"] > 4 * books["optimizer"]
        assert full["parameters"] < books["parameters"] < 1.2 * full["parameters"]
