"""The causal-LM recipe on 2 real gloo ranks: tiny random GPT2-style and Llama-style decoders
saved with `save_pretrained` in a temp dir and a tokenizer trained here (no download),
fine-tuned with LoRA and in full, under DDP and FSDP2.

One `run_ranks` call trains every configuration in turn (the ranks import transformers
once): each learns and ends in sync; LoRA's frozen base has no optimizer state and is not
reduced; a run stopped mid-epoch and resumed ends bitwise equal to the uninterrupted one
(FSDP, full and LoRA); a second call SIGKILLs rank 1 of a DDP LoRA run mid-epoch and the
restarted job resumes to the same bits. What lands in `train.output_dir` loads with the
libraries' own loaders and reproduces the eval loss in summary.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from disttrain import envvars
from disttrain.spec.job import JobSpec
from disttrain.testing import run_ranks, setup_for_test
from tests.conftest import needs
from tests.recipes import hf_fixtures as fx

pytestmark = [needs("transformers", "peft"), pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 16
SEQ = 32
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
# (name, arch, strategy, lora)
CONFIGS = [("gpt2-ddp-lora", "gpt2", "ddp", LORA), ("llama-fsdp-full", "llama", "fsdp", False),
           ("llama-fsdp-lora", "llama", "fsdp", LORA), ("gpt2-ddp-full", "gpt2", "ddp", False)]
MERGED = {"llama-fsdp-lora"}   # saved with the adapter merged in (merge_lora)
STOPPED = {"llama-fsdp-full": 7, "llama-fsdp-lora": 7}   # stopped mid-epoch at this step, resumed


def _spec(root: Path, name: str, arch: str, strategy: str, lora: Any, **train: Any) -> JobSpec:
    args = {"model": str(root / arch), "data": str(root / "train.jsonl"), "seq_len": SEQ,
            "lora": lora, "cache_dir": str(root / "cache"), "eval_fraction": 0.1,
            "merge_lora": name.removesuffix("-resumed") in MERGED}
    return JobSpec.from_dict({"task": "disttrain.recipes.causal_lm:make_task", "task_args": args}, {
        "epochs": 2, "max_steps": STEPS, "batch_size": 8, "lr": 0.01 if lora else 0.003,
        "strategy": strategy, "log_every_steps": 1, "checkpoint_every_epochs": 0,
        "run_dir": str(root / "runs" / name), "output_dir": str(root / "out" / name), **train})


def _fit(spec: JobSpec, rt: Any) -> dict[str, Any]:
    from disttrain.train.build import build_trainer

    trainer = build_trainer(spec, rt)
    summary = trainer.fit()
    state = [t for s in trainer.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t) and t.ndim > 0]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {**summary, "optimizer_state_numel": sum(t.numel() for t in state),
            "trainable_numel": trainable}


def _train_all(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with setup_for_test() as rt:
        for name, arch, strategy, lora in CONFIGS:
            out[name] = _fit(_spec(root, name, arch, strategy, lora), rt)
            if name in STOPPED:
                again = f"{name}-resumed"
                _fit(_spec(root, again, arch, strategy, lora, max_steps=STOPPED[name],
                           checkpoint_every_steps=STOPPED[name]), rt)
                out[again] = _fit(_spec(root, again, arch, strategy, lora, resume=True), rt)
    return out


def _killed(root: Path) -> dict[str, Any]:
    with setup_for_test() as rt:
        return _fit(_spec(root, "gpt2-ddp-lora-killed", "gpt2", "ddp", LORA,
                          checkpoint_every_steps=3), rt)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fx.make_job_root(tmp_path_factory.mktemp("finetune"))


@pytest.fixture(scope="module")
def runs(root: Path) -> dict[str, Any]:
    return run_ranks(2, _train_all, root, timeout_s=300)


def _train_losses(summary: dict[str, Any]) -> list[float]:
    rows = [json.loads(line) for line in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, list[float]] = {}
    for r in rows:
        if r.get("split") == "train":
            by_step.setdefault(r["step"], []).append(r["loss"])
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_each_config_learns_in_sync(runs: dict[int, Any], name: str) -> None:
    for rank in (0, 1):
        s = runs[rank][name]
        assert s["params_in_sync"] is True and s["world_size"] == 2 and s["steps"] == STEPS
    s = runs[0][name]
    assert runs[1][name]["params_sha256"] == s["params_sha256"]
    losses = _train_losses(s)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    # deterministic runs: a random base learns slowly through a rank-8 adapter, fast in full
    assert last < first - (0.05 if name.endswith("lora") else 0.3), (name, losses)
    ev = s["eval"]
    assert ev["perplexity"] == pytest.approx(math.exp(ev["token_nll"]))
    assert ev["token_nll"] == pytest.approx(ev["loss"], rel=1e-5)   # packed: every window full


@pytest.mark.parametrize("name", ["gpt2-ddp-lora", "llama-fsdp-lora"])
def test_lora_base_is_frozen_out_of_optimizer_and_reduction(runs: dict[int, Any], name: str) -> None:
    lora, full = runs[0][name], runs[0][name.replace("lora", "full")]
    assert 0 < lora["trainable_numel"] < full["trainable_numel"] / 4
    # Adam keeps exp_avg and exp_avg_sq of the adapter only (this rank's shard under FSDP).
    per_rank = 2 if name.endswith("ddp-lora") else 1
    assert 0 < lora["optimizer_state_numel"] <= 2 * lora["trainable_numel"] * per_rank
    reduced = lora.get("allreduce_bytes_per_step") or 0
    assert 0 < reduced <= 4 * lora["trainable_numel"], reduced   # fp32 adapter gradients only


@pytest.mark.parametrize("name", list(STOPPED))
def test_stopped_and_resumed_fsdp_run_is_bitwise_equal(runs: dict[int, Any], name: str) -> None:
    resumed = runs[0][f"{name}-resumed"]
    assert resumed["params_sha256"] == runs[1][f"{name}-resumed"]["params_sha256"]
    assert resumed["params_sha256"] == runs[0][name]["params_sha256"]
    assert resumed["eval"] == runs[0][name]["eval"]


def test_killed_rank_of_a_lora_ddp_run_resumes_bitwise(root: Path, runs: dict[int, Any]) -> None:
    killed = run_ranks(2, _killed, root, timeout_s=300, max_restarts=1,
                       env={envvars.FAULT: "kill:rank=1:step=7"})
    assert killed[0]["params_sha256"] == killed[1]["params_sha256"]
    assert killed[0]["params_sha256"] == runs[0]["gpt2-ddp-lora"]["params_sha256"]
    rows = [json.loads(line) for line in
            Path(killed[0]["run_dir"], "metrics.jsonl").read_text().splitlines()]
    redone = [r for r in rows if r.get("split") == "train" and r["step"] == 7]
    assert len(redone) == 2, "step 7 once per rank: the redone steps replace the lost ones"


def _saved_model_keys(run_dir: Path) -> dict[str, set[str]]:
    """The model keys of a run's newest checkpoint: its .pt entry and its DCP folder's."""
    import torch.distributed.checkpoint as dcp

    from disttrain.rundir import checkpoint_dir
    from disttrain.train.checkpoint import load_latest

    found = load_latest(checkpoint_dir(run_dir))
    assert found is not None, run_dir
    ckpt, path = found
    out = {"pt": set(ckpt["model"]), "left_out": {str(ckpt.get("frozen_left_out"))}}
    if ckpt.get("dcp"):
        meta = dcp.FileSystemReader(str(path.parent / ckpt["dcp"])).read_metadata()
        out["dcp"] = {k.removeprefix("model.") for k in meta.state_dict_metadata
                      if k.startswith("model.")}
    return out


def test_lora_checkpoints_hold_the_adapter_not_the_base(root: Path, runs: dict[int, Any]) -> None:
    """Adapter-only checkpoints (train/ckpt_trainable.py): the LoRA runs' checkpoints, DDP and
    FSDP, hold the adapter weights only (the resumes above loaded them onto a fresh base)."""
    lora = _saved_model_keys(root / "runs" / "llama-fsdp-lora-resumed")
    full = _saved_model_keys(root / "runs" / "llama-fsdp-full-resumed")
    for where in ("pt", "dcp"):
        assert lora[where] and all(".lora_" in k for k in lora[where]), lora[where]
        assert not any(".lora_" in k for k in full[where])
    assert int(next(iter(lora["left_out"]))) > 0 and full["left_out"] == {"None"}
    killed = root / "runs" / "gpt2-ddp-lora-killed"
    if killed.is_dir():   # written by the kill-and-resume test, when it ran first
        keys = _saved_model_keys(killed)["pt"]
        assert keys and all(".lora_" in k for k in keys), keys


def _eval_loss(model: torch.nn.Module, root: Path, arch: str,
               monkeypatch: pytest.MonkeyPatch) -> float:
    from disttrain.recipes.causal_lm import make_task

    for name in (envvars.HF_HUB_OFFLINE, envvars.TRANSFORMERS_OFFLINE):  # restored after
        monkeypatch.setenv(name, "1")
    task = make_task(str(root / arch), str(root / "train.jsonl"), seq_len=SEQ, eval_fraction=0.1,
                     cache_dir=str(root / "cache"))
    loader = torch.utils.data.DataLoader(task.eval_data, batch_size=64)
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            total += model(**batch).loss.item() * len(batch["input_ids"])
            n += len(batch["input_ids"])
    return total / n


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_saved_output_loads_with_the_libraries_and_gives_the_eval_loss(
        root: Path, runs: dict[int, Any], name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    summary = runs[0][name]
    out = Path(summary["output"]["dir"])
    arch = name.split("-")[0]
    if name in MERGED:
        assert summary["output"]["format"] == "merged" and (out / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(out)
        assert not any("lora" in k for k in model.state_dict())
    elif name.endswith("lora"):
        from peft import PeftModel

        assert summary["output"]["format"] == "adapter"
        assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / arch), out)
    else:
        assert summary["output"]["format"] == "full" and (out / "config.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(out)
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    assert _eval_loss(model, root, arch, monkeypatch) == pytest.approx(summary["eval"]["loss"], abs=1e-4)
