"""Every package's docstring names the modules it holds, and no module it does not (issue 21
item 7): the docstrings are the map a reader opens first (docs/architecture.md has the rest)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "disttrain"
PACKAGES = sorted(p.parent for p in PKG.glob("*/__init__.py"))


def _docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def _undocumented(package: Path, doc: str) -> list[str]:
    """Modules whose name is not a word of the docstring (`trainer.py`, `trainer` or
    `trainer.fit` all count), and `NAME.py` files it lists (at a line's start or in
    backticks) that do not exist."""
    modules = sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if not re.search(rf"(?<![\w/-]){re.escape(m)}(?![\w-])", doc)]
    listed = re.findall(r"(?m)(?:^\s*(?:-\s+)?|`)([a-z_0-9]+)\.py\b", doc)  # not `lint train.py`
    ghosts = sorted(set(listed) - set(modules))
    return [f"{m}.py is not named" for m in missing] + [f"{g}.py is named but absent" for g in ghosts]


def test_the_check_finds_a_missing_and_a_ghost_module(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""- trainer.py   the loop\n- gone.py   removed"""\n')
    for name in ("trainer.py", "trainer_util.py"):
        (tmp_path / name).write_text("")
    doc = _docstring(tmp_path)
    assert _undocumented(tmp_path, doc) == ["trainer_util.py is not named", "gone.py is named but absent"]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_docstring_lists_its_modules(package: Path) -> None:
    problems = _undocumented(package, _docstring(package))
    assert not problems, f"{package.name}/__init__.py's docstring: " + "; ".join(problems)
