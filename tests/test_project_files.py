"""The project's own entry points point at things that exist (a renamed script once left
`make bench` running a file that was gone)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_makefile_recipes_name_existing_files():
    text = (ROOT / "Makefile").read_text()
    paths = set(re.findall(r"\b((?:benchmarks|examples|src|tests|tools)/[\w./-]+\.(?:py|sh))\b", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"Makefile names missing files: {missing}"


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^make (\w+)", (ROOT / "README.md").read_text(), re.M))
    assert {"run", "test"} <= targets
    for target in targets:
        res = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == 0, res.stderr


def test_bench_target_runs_disttrain_bench():
    res = subprocess.run(["make", "-n", "bench"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert "disttrain bench overhead" in res.stdout and "disttrain bench scaling" in res.stdout


@pytest.fixture(scope="module")
def uv_install() -> ModuleType:
    """tools/uv_install.py (a script, not a package module), loaded once."""
    spec = importlib.util.spec_from_file_location("uv_install", ROOT / "tools" / "uv_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_takes_torch_from_pip_then_the_rest_from_uv():
    """torch from pip (its configuration may name a local wheel and a version cap), then
    uv for the rest: in that order, in both installs."""
    for target in ("install", "install-test"):
        res = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        pip = next(i for i, line in enumerate(lines) if "-m pip install" in line)
        uv = next(i for i, line in enumerate(lines) if "tools/uv_install.py" in line)
        assert lines[pip].split()[-2:] == ["torch", "uv"] and pip < uv, res.stdout
        assert "-c constraints.txt" in lines[pip] and "-c constraints.txt" in lines[uv]
    assert "uv==" in (ROOT / "constraints.txt").read_text()


@pytest.mark.parametrize(("config", "flags"), [
    # this machine's: a wheel folder from the environment, two local indexes beside PyPI
    (":env:.find-links='/opt/wheels'\n"
     "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
     "global.constraint='/etc/xdg/pip/constraints.txt'\n"
     "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
     "global.find-links='/ignored/env/wins'\n",
     ["--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url",
      "file:///opt/pypi-more/simple", "--find-links", "/opt/wheels",
      "--constraint", "/etc/xdg/pip/constraints.txt", "--index-strategy", "unsafe-best-match"]),
    # a mirror instead of PyPI, [install] over [global]: uv's own strategy is enough
    ("global.index-url='https://a.example/simple'\ninstall.index-url='https://b.example/simple'\n",
     ["--index-url", "https://b.example/simple"]),
    # one entry per line in pip.conf, and no index at all
    ("global.find-links='/w1\\n/w2'\nglobal.no-index='true'\n",
     ["--find-links", "/w1", "--find-links", "/w2", "--no-index",
      "--index-strategy", "unsafe-best-match"]),
    ("global.no-index='false'\nuser.index-url='x'\nnot a setting\n", []),
    # a mirror over plain http
    ("global.index-url='http://m.lan/simple'\nglobal.trusted-host='m.lan'\n",
     ["--index-url", "http://m.lan/simple", "--allow-insecure-host", "m.lan"]),
    ("", []),
])
def test_pips_package_sources_are_handed_to_uv(uv_install, config, flags):
    assert uv_install.uv_source_flags(uv_install.parse_config_list(config)) == flags


def test_pips_ca_bundle_reaches_uv_unless_one_is_set(uv_install):
    settings = uv_install.parse_config_list("global.cert='/etc/ca.pem'\n")
    assert uv_install.uv_env(settings, {})["SSL_CERT_FILE"] == "/etc/ca.pem"
    assert uv_install.uv_env(settings, {"SSL_CERT_FILE": "/mine.pem"})["SSL_CERT_FILE"] == "/mine.pem"
    assert "SSL_CERT_FILE" not in uv_install.uv_env({}, {})
