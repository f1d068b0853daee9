"""The causal-LM recipe's checks and data path, in one process: a missing file names the
file and its folder, bad task arguments are named, the token cache is written once and
waited for with a timeout, windows pack or pad, offline mode is set, FSDP1 is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain import envvars
from disttrain.recipes import text_data
from disttrain.recipes.causal_lm import check_model_dir, lora_settings, make_task
from disttrain.train.task import TaskError
from tests.conftest import needs
from tests.recipes import hf_fixtures as fx

pytestmark = [needs("transformers")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fx.make_model_dir(tmp_path_factory.mktemp("m"), "gpt2", docs=fx.corpus(8000))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (envvars.HF_HUB_OFFLINE, envvars.TRANSFORMERS_OFFLINE):
        monkeypatch.setenv(name, "")   # recorded, so that what make_task sets is undone
        monkeypatch.delenv(name)


def test_missing_model_files_are_named_with_their_folder(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=f"nope is not a directory in {tmp_path}"):
        check_model_dir(tmp_path / "nope")
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(TaskError, match=f"config.json is missing from {broken}"):
        check_model_dir(broken)
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(TaskError, match=f"no model.safetensors .* in {broken}; it holds: config.json"):
        check_model_dir(broken)
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(TaskError, match=f"names model-00001-of-00002.safetensors, which is not in {broken}"):
        check_model_dir(broken)
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    with pytest.raises(TaskError, match=f"no tokenizer .* in {broken}"):
        check_model_dir(broken)
    assert check_model_dir(model_dir) == model_dir


def test_data_paths_and_lines_are_named(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=f"train.jsonl is not in {tmp_path}"):
        text_data.text_files(tmp_path / "train.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TaskError, match=r"is a \.csv file"):
        text_data.text_files(tmp_path / "x.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(TaskError, match=rf"{bad}:2 has no string field 'text' \(it has \['body'\]\)"):
        list(text_data.documents([bad], "text"))
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(TaskError, match=rf"{bad}:2 is not JSON"):
        list(text_data.documents([bad], "text"))
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("b")
    (folder / "sub" / "a.jsonl").write_text('{"text": "a"}\n')
    assert text_data.text_files(folder) == [folder / "b.txt", folder / "sub" / "a.jsonl"]
    assert list(text_data.documents(text_data.text_files(folder), "text")) == ["b", "a"]


def test_lora_arguments_are_checked() -> None:
    assert lora_settings(False) is None
    assert lora_settings({"r": 4}).r == 4
    assert lora_settings({"target_modules": "all-linear"}).target_modules == "all-linear"
    with pytest.raises(TaskError, match=r"unknown key.* rank; it takes alpha, dropout, r, target_modules"):
        lora_settings({"rank": 4})
    with pytest.raises(TaskError, match="r must be >= 1"):
        lora_settings({"r": 0})
    with pytest.raises(TaskError, match="give false"):
        lora_settings("yes")


def test_the_token_cache_is_written_once_and_waited_for(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = fx.write_jsonl(tmp_path / "d.jsonl", ["alpha beta gamma", "delta"])
    files = text_data.text_files(data)
    key = text_data.cache_key(files, [model_dir / "tokenizer.json"], {"text_field": "text"})
    with pytest.raises(TaskError, match=rf"token cache: {tmp_path / 'c'}/tokens-{key}.npy did not "
                                        rf"appear within 0 s"):
        text_data.token_cache(files, tok, tmp_path / "c", key, "text", writer=False, wait_s=0.3)
    ids, starts = text_data.token_cache(files, tok, tmp_path / "c", key, "text", writer=True, wait_s=1)
    again, _ = text_data.token_cache(files, tok, tmp_path / "c", key, "text", writer=False, wait_s=1)
    assert isinstance(again, np.memmap) and np.array_equal(ids, again)
    assert starts.tolist() == [0, len(tok("alpha beta gamma")["input_ids"]) + 1, len(ids)]
    assert ids[starts[1] - 1] == tok.eos_token_id
    os.utime(data, ns=(1, 1))   # a changed data file makes a new cache
    assert text_data.cache_key(files, [model_dir / "tokenizer.json"], {"text_field": "text"}) != key


def test_windows_pack_across_documents_or_pad_each() -> None:
    starts = np.array([0, 5, 12])
    assert text_data.window_spans(12, starts, 4, packing=True).tolist() == [[0, 4], [4, 4], [8, 4]]
    assert text_data.window_spans(12, starts, 4, packing=False).tolist() == [
        [0, 4], [5, 4], [9, 3]]   # doc 0's last token alone teaches nothing: dropped
    ids = np.arange(12, dtype=np.uint16)
    sample = text_data.TokenWindows(ids, np.array([[9, 3]]), 4, pad_id=0)[0]
    assert sample["input_ids"].tolist() == [9, 10, 11, 0]
    assert sample["labels"].tolist() == [9, 10, 11, -100]
    assert sample["attention_mask"].tolist() == [1, 1, 1, 0]
    train, held = text_data.split(np.zeros((10, 2)), 0.2)
    assert len(train) == 8 and len(held) == 2
    with pytest.raises(TaskError, match="too few to hold out"):
        text_data.split(np.zeros((1, 2)), 0.5)


def test_make_task_sets_offline_mode_and_builds_on_meta(model_dir: Path, tmp_path: Path) -> None:
    data = fx.write_jsonl(tmp_path / "d.jsonl", fx.corpus(4000))
    task = make_task(str(model_dir), str(data), seq_len=16, cache_dir=str(tmp_path / "c"),
                     lora={"r": 2})
    assert os.environ[envvars.HF_HUB_OFFLINE] == os.environ[envvars.TRANSFORMERS_OFFLINE] == "1"
    model = task.model()
    assert all(p.is_meta for n, p in model.named_parameters() if ".lora_" not in n)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert task.fsdp_block is not None and task.fsdp_block[0].__name__ == "GPT2Block"
    batch = task.train_data[0]
    assert batch["input_ids"].shape == (16,) and batch["input_ids"].dtype == torch.long
    with pytest.raises(TaskError, match="merge_lora applies to LoRA only"):
        make_task(str(model_dir), str(data), merge_lora=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(TaskError, match="dtype must be one of float32, bfloat16"):
        make_task(str(model_dir), str(data), dtype="fp8", cache_dir=str(tmp_path / "c"))


def test_fsdp1_is_refused_for_the_recipe(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.errors import StrategyError
    from disttrain.recipes.load_once import Pretrained

    monkeypatch.setenv(envvars.FSDP_VERSION, "1")
    pretrained = Pretrained(model_dir)
    model = pretrained.build()
    with pytest.raises(StrategyError, match="FSDP2"):
        pretrained.load(model, None, "fsdp", lambda m: m)  # type: ignore[arg-type]


def test_the_memory_plan_traces_the_recipe(model_dir: Path, tmp_path: Path) -> None:
    """`disttrain plan` (plan/job.py's plan_task) on a recipe task: it builds the model from
    the task's factory on meta and traces two steps; the peak holds at least the weights,
    their gradients and Adam's two moments (full fine-tuning)."""
    from disttrain.plan.job import plan_task
    from disttrain.plan.trace import Knobs

    data = fx.write_jsonl(tmp_path / "d.jsonl", fx.corpus(4000))
    task = make_task(str(model_dir), str(data), seq_len=16, cache_dir=str(tmp_path / "c"))
    weights = sum(p.numel() * 4 for p in task.model().parameters())
    plan = plan_task(task, Knobs(strategy="ddp", world_size=2, local_world_size=2, batch_size=2),
                     search=False)
    assert plan.tensors.peak_bytes >= 4 * weights


def test_the_memory_plan_traces_a_lora_model(model_dir: Path, tmp_path: Path) -> None:
    """LoRA's frozen base used to stop the trace ("cannot register a hook on a tensor that
    doesn't require gradient"); now it counts as parameters only (tests/plan/test_lora_plan.py
    holds the plan to the real run)."""
    pytest.importorskip("peft")
    from disttrain.plan.job import plan_task
    from disttrain.plan.trace import Knobs

    data = fx.write_jsonl(tmp_path / "d.jsonl", fx.corpus(4000))
    task = make_task(str(model_dir), str(data), seq_len=16, cache_dir=str(tmp_path / "c"),
                     lora={"r": 4})
    trainable = sum(p.numel() for p in task.model().parameters() if p.requires_grad)
    plan = plan_task(task, Knobs(strategy="ddp", world_size=2, local_world_size=2, batch_size=2),
                     search=False)
    books = plan.tensors.largest
    assert books["gradients"] == pytest.approx(4 * trainable, rel=0.05), books
    assert books["parameters"] > 10 * books["gradients"], books


def test_the_finetune_verb_is_run_of_the_recipe(model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from disttrain.cli.main import cli as main

    data = fx.write_jsonl(tmp_path / "d.jsonl", ["a b c"])
    runner = CliRunner()
    ok = runner.invoke(main, ["finetune", str(model_dir), str(data), "--lora-r", "4",
                              "--output-dir", str(tmp_path / "out"), "--dry-run"])
    assert ok.exit_code == 0, ok.output
    assert "task: disttrain.recipes.causal_lm:make_task" in ok.output
    assert "r: 4" in ok.output and "alpha: 8" in ok.output and f"output_dir: {tmp_path / 'out'}" in ok.output
    missing = runner.invoke(main, ["finetune", str(model_dir), str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and f"nope.jsonl is not in {tmp_path}" in missing.output
    assert "Traceback" not in missing.output
    other = runner.invoke(main, ["finetune", str(model_dir), str(data), "--task", "x:y"])
    assert other.exit_code == 2 and "finetune runs disttrain.recipes.causal_lm:make_task" in other.output
