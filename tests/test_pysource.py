"""The AST helpers lint, the own-workers check and the code shipper share (`disttrain.pysource`):
one reading of a script's imports for all three."""

from __future__ import annotations

import ast

import pytest

from disttrain.pysource import dotted_name, import_aliases, optional_imports, parse_file, top_level_imports

SOURCE = """\
import os.path
import torch.multiprocessing as mp
from torch import distributed as dist
from .sibling import helper
import datautils
try:
    import wandb
    import numpy
except ImportError:
    wandb = None
import numpy
mp.spawn(main, nprocs=2)
dist.init_process_group("gloo")
"""


def test_aliases_resolve_to_the_dotted_path_every_reader_sees():
    tree = ast.parse(SOURCE)
    aliases = import_aliases(ast.walk(tree))
    assert aliases["mp"] == "torch.multiprocessing" and aliases["os"] == "os"
    assert aliases["dist"] == "torch.distributed" and "helper" not in aliases   # relative: local
    calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert [dotted_name(f, aliases) for f in calls] == [
        "torch.multiprocessing.spawn", "torch.distributed.init_process_group"]
    assert dotted_name(ast.parse("f()(x)").body[0].value.func, aliases) is None   # type: ignore[attr-defined]


def test_top_level_and_optional_imports():
    tree = ast.parse(SOURCE)
    assert top_level_imports(tree) == {"os", "torch", "datautils", "wandb", "numpy"}
    # numpy is imported again outside the guard: not optional
    assert optional_imports(tree) == {"wandb"}
    assert optional_imports(ast.parse("try:\n    import a\nexcept (OSError, ModuleNotFoundError):\n"
                                      "    pass\ntry:\n    import b\nexcept KeyError:\n    pass\n")) == {"a"}


def test_parse_file_decodes_as_python_does_and_names_bad_input(tmp_path):
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nname = '\xe9'\n")
    assert ast.literal_eval(parse_file(latin).body[0].value) == "\u00e9"   # type: ignore[attr-defined]
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(SyntaxError):
        parse_file(bad)
    with pytest.raises(OSError):
        parse_file(tmp_path / "missing.py")
