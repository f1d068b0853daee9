"""`cluster.install_disttrain` keeps the image's torch: the pod pins what pip sees installed
(k8s/install.py), and pip then refuses to replace it instead of pulling another torch.

The pip runs are `--dry-run --no-index` against wheels made here: nothing is downloaded
and nothing is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from disttrain.k8s.install import PIN_SCRIPT, PINS, install_setup
from disttrain.spec.cluster import ClusterSpec


def _installed(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def test_the_pin_script_writes_the_installed_torch_and_numpy() -> None:
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.splitlines() == [f"torch=={_installed('torch')}", f"numpy=={_installed('numpy')}"]


def test_the_pin_script_refuses_an_image_without_a_visible_torch(tmp_path: Path) -> None:
    # -I -S: an interpreter that sees no site-packages, like an image whose torch pip cannot see
    done = subprocess.run([sys.executable, "-I", "-S", "-c", PIN_SCRIPT], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert "pip sees none in this image" in done.stderr


def test_the_command_pins_before_it_installs() -> None:
    c = ClusterSpec(image="x", install_disttrain="disttrain==0.1.0",
                    pip_index_url="http://10.0.0.5:3141/root/pypi")
    line = install_setup(c)
    assert line.endswith(" || exit $?\n") and line.count("\n") == 1
    pins, pip = line.removesuffix(" || exit $?\n").split(" && ")
    assert shlex.split(pins) == ["python", "-c", PIN_SCRIPT, ">", PINS]
    assert shlex.split(pip) == ["python", "-m", "pip", "install", "--no-cache-dir", "-c", PINS,
                                "--index-url", "http://10.0.0.5:3141/root/pypi",
                                "--trusted-host", "10.0.0.5", "disttrain==0.1.0"]
    assert install_setup(ClusterSpec(image="x")) == ""  # nothing to install


def _wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{info}/METADATA", meta)
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                      "Root-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """A local index with a newer torch than this one and two packages that want torch."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "torch", "99.0")
    _wheel(folder, "wants-new-torch", "1.0", "torch>=99")
    _wheel(folder, "fits-this-torch", "1.0", "torch>=2.1")
    return folder


def _dry_run(index: Path, requirement: str, pins: Path | None, report: Path
             ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
           str(index), "--disable-pip-version-check", "--report", str(report), requirement]
    if pins is not None:
        cmd[4:4] = ["-c", str(pins)]
    # pip as in a bare image: none of this machine's pip settings (its own constraints)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)


def _would_install(report: Path) -> list[str]:
    return sorted(item["metadata"]["name"] for item in json.loads(report.read_text())["install"])


def test_pip_keeps_the_pinned_torch_or_refuses(index: Path, tmp_path: Path) -> None:
    pins = tmp_path / "pins.txt"
    pins.write_text(subprocess.run([sys.executable, "-c", PIN_SCRIPT], capture_output=True,
                                   text=True, timeout=60, check=True).stdout)
    report = tmp_path / "report.json"
    # what happened before: a package that wants another torch brings it
    assert _dry_run(index, "wants-new-torch", None, report).returncode == 0
    assert _would_install(report) == ["torch", "wants-new-torch"]
    # pinned: pip refuses, naming the conflict, and nothing is replaced
    done = _dry_run(index, "wants-new-torch", pins, report)
    assert done.returncode != 0 and "torch" in done.stdout + done.stderr
    # a package this torch can run is installed beside it, torch left alone
    assert _dry_run(index, "fits-this-torch", pins, report).returncode == 0
    assert _would_install(report) == ["fits-this-torch"]
