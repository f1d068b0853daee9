"""Printing rendered objects (k8s/output.py): every shipped file is a readable `|` block and
reads back byte for byte, whatever its whitespace."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from disttrain.k8s import output
from disttrain.k8s.render import render, to_yaml
from disttrain.spec.job import JobSpec


def _configmap(text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
            "data": {"train.py": text}}


def _printed(text: str) -> tuple[str, str]:
    """(how the file's value starts in the output, the output)."""
    out = to_yaml([_configmap(text)])
    return out.split("train.py: ", 1)[1][:2], out


@pytest.mark.parametrize("text", [
    "x = 1  \nprint(x)\n",              # a trailing space (PyYAML would quote the whole file)
    "def f():\n\treturn 1\n",           # a tab
    "  indented first line\nx\n",       # leading spaces need an indentation indicator
    "x\nno newline at the end  ",       # trailing spaces on the last line, no line break
    "a\n\n\n",                          # trailing empty lines are kept
    "\n\nstarts with empty lines\n",
    "x\n   \n    \n",                   # lines of only spaces
    "# a: b\n- c: 'd'  \n\"e\"\t\n",    # YAML indicators inside
    "中文  \nélan\t\n",
])
def test_a_shipped_file_is_a_block_and_reads_back_exactly(text: str) -> None:
    start, out = _printed(text)
    assert start.startswith("|"), out
    (doc,) = yaml.safe_load_all(out)
    assert doc["data"]["train.py"] == text


@pytest.mark.parametrize("text", ["a\r\nb\r\n", "form\x0cfeed\n", "\ufeffbom\n", "nel\x85x\n"])
def test_what_a_block_cannot_hold_stays_quoted_and_exact(text: str) -> None:
    start, out = _printed(text)
    assert start[0] == '"', out
    assert yaml.safe_load(out)["data"]["train.py"] == text


def test_random_whitespace_round_trips() -> None:
    rng = random.Random(0)
    alphabet = [" ", "  ", "\t", "\n", "x", "#", ": ", "- ", "'", '"', "é", "|", "\\"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        obj = _configmap(text)
        out = to_yaml([obj])
        assert yaml.safe_load(out.split("\n", 1)[1]) == obj, repr(text)
        assert "  train.py: |" in out, repr(text)  # always a block, one line or many


def test_a_block_that_would_not_read_back_falls_back_to_quoting(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    # allow blocks for everything: CR line ends then read back as LF, so the check must
    # catch it and print PyYAML's own (quoted) form
    monkeypatch.setattr(output, "_NOT_IN_BLOCK", output.re.compile("(?!)"))
    text = "a\r\nb  \r\n"
    assert "|" in yaml.dump(text, Dumper=output._Dumper)  # the unsafe dumper would do it
    out = to_yaml([_configmap(text)])
    assert 'train.py: "a\\r\\nb  \\r\\n"' in out
    assert yaml.safe_load(out)["data"]["train.py"] == text


def test_a_rendered_script_with_trailing_spaces_is_a_block(workdir: Path) -> None:
    (workdir / "train.py").write_text("import torch  \n\tprint('tab')\n")
    objects = render(JobSpec.from_dict({"script": "train.py", "cluster": {"image": "x"}}),
                     workdir).objects
    out = to_yaml(objects)
    assert "  train.py: |\n    import torch  \n    \tprint('tab')\n" in out
    assert list(yaml.safe_load_all(out)) == objects
