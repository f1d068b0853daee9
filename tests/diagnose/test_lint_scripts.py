"""The lint on real scripts' structure (issue 16 items 9-14): reduced fixtures of the
pytorch/examples distributed scripts, each finding checked, and `lint DIR` / `--json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from disttrain.cli.main import cli
from disttrain.diagnose.lint import lint_paths, lint_source

SCRIPTS = Path(__file__).parent / "scripts"

# fixture -> every finding, exactly: the correctly guarded and rank-tagged lines are absent
EXPECTED = {
    # print in __init__ (item 12); save guarded by LOCAL_RANK via self.gpu_id (items 10, 13);
    # "[GPU{self.gpu_id}]" print, guarded prints and "Unable to locate" before init: silent
    "tutorial_trainer.py": [("DT004", 18), ("DT021", 29)],
    # rank = int(env_dict["RANK"]) as a device: device_ids, torch.accelerator (item 11; the
    # .to(rank) before device_ids=[rank] is the same mistake, named once per function)
    "env_dict_rank.py": [("DT007", 13), ("DT007", 22)],
    # clip on scaled grads (the else branch is right), local-rank save, unseeded split
    "amp_split_trainer.py": [("DT022", 23), ("DT021", 41), ("DT019", 46)],
}


def found(source: str, name: str = "t.py") -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in lint_source(source, name)]


def test_fixtures_give_exactly_their_findings() -> None:
    for name, expected in EXPECTED.items():
        assert [(f.rule, f.line) for f in lint_paths([SCRIPTS / name])] == expected, name


def test_global_rank_device_names_the_moves_with_it() -> None:
    """Item 11: the .to(rank) next to device_ids=[rank] is named in that finding."""
    hit = next(f for f in lint_paths([SCRIPTS / "env_dict_rank.py"]) if f.line == 13)
    assert "global rank" in hit.message and "on line 12" in hit.message


def test_set_epoch_followed_through_attributes_and_methods() -> None:
    """Item 9: without `self.train_data.sampler.set_epoch(epoch)` the epoch loop is named."""
    for name, line in (("tutorial_trainer.py", "        self.train_data.sampler.set_epoch(epoch)\n"),
                       ("amp_split_trainer.py", "        dataloader.sampler.set_epoch(epoch)\n")):
        source = (SCRIPTS / name).read_text()
        assert line in source and "DT003" not in {r for r, _ in found(source)}
        without = source.replace(line, line.replace(line.strip(), "pass"))
        hits = [n for r, n in found(without) if r == "DT003"]
        epoch_loop = next(i for i, text in enumerate(without.splitlines(), 1)
                          if "for epoch in range(" in text)
        assert hits == [epoch_loop], name


def test_rank_attribute_from_a_constructor_argument() -> None:
    """Item 10: `Trainer(..., rank)` stores it as self.gpu_id: its guard and tag count."""
    src = ("import torch\nimport torch.distributed as dist\n"
           "class T:\n    def __init__(self, gpu_id):\n        self.gpu_id = gpu_id\n"
           "    def save(self):\n        if self.gpu_id == 0:\n"
           "            torch.save({}, 'c.pt')\n"
           "        print(f'[GPU{self.gpu_id}] done')\n"
           "def main(rank):\n    dist.init_process_group('gloo', rank=rank, world_size=2)\n"
           "    T(rank).save()\n    dist.destroy_process_group()\n")
    assert [r for r, _ in found(src)] == []
    unguarded = src.replace("        if self.gpu_id == 0:\n            torch.save",
                            "        torch.save").replace("[GPU{self.gpu_id}] ", "")
    assert sorted(r for r, _ in found(unguarded)) == ["DT004", "DT004"]


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, ["lint", *args], catch_exceptions=False)


def test_lint_dir_recurses_skips_and_reports_json(tmp_path: Path) -> None:
    """Item 14: a directory is searched (venvs, hidden folders, __pycache__ skipped), files
    with nothing distributed are skipped with a note, --json has findings/linted/skipped."""
    (tmp_path / "pkg").mkdir()
    bad = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    (tmp_path / "pkg" / "train.py").write_text(bad)
    (tmp_path / "model.py").write_text("import torch\nnet = torch.nn.Linear(2, 2)\n")
    for skip in (".hidden", "__pycache__", "venv"):
        (tmp_path / skip).mkdir()
        (tmp_path / skip / "x.py").write_text(bad)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    r = run("--json", str(tmp_path))
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert list(data) == ["findings", "linted", "skipped", "ok"] and data["ok"] is False
    assert data["linted"] == [str(tmp_path / "pkg" / "train.py")]
    assert [d["rule"] for d in data["findings"]] == ["DT009"]
    assert [s["path"] for s in data["skipped"]] == [str(tmp_path / "model.py")]
    text = run(str(tmp_path))
    assert f"skipped {tmp_path / 'model.py'}: not a distributed script" in text.stdout
    assert "1 file(s) skipped" in text.stdout
    everything = json.loads(run("--json", "--all", str(tmp_path)).stdout)
    assert everything["skipped"] == [] and len(everything["linted"]) == 2


def test_lint_empty_dir_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "a.py").write_text("x = 1\n")
    r = run(str(tmp_path))
    assert r.exit_code == 2 and "no Python file" in r.stderr and "Traceback" not in r.output
