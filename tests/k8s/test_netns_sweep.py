"""No leaked network namespaces: `netns.network` removes its own on a SIGTERM / SIGHUP too,
and the sweep of what killed runs left (`netns.sweep_stale`, run at the end of every
session by tests/k8s/conftest.py) removes a stale one (its owner's pid dead) with its
/etc/netns folder and keeps a live owner's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.fixtures.hosts import needs_netns
from tests.k8s.conftest import sweep_namespaces

from disttrain.k8s import netns


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _listed() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_only_run_locals_names_are_owned():
    assert netns.OWNED_NAME.match("dt1234-0")["pid"] == "1234"
    assert netns.OWNED_NAME.match("dt1234t-sw")["pid"] == "1234"
    for other in ("dt1234", "dtx-0", "mydt1234-0", "dt1234-eth", "cni-1234"):
        assert netns.OWNED_NAME.match(other) is None


def test_a_folder_of_a_dead_owner_goes_and_a_live_owners_stays(tmp_path, monkeypatch):
    """Without root: the /etc/netns side, on a folder standing in for it; `ip` answers
    that it lists nothing."""
    monkeypatch.setattr(netns, "ETC_NETNS", tmp_path)
    real_run = subprocess.run
    monkeypatch.setattr(netns.subprocess, "run", lambda argv, **kw: real_run(
        ["true"], **kw))
    dead, live = _dead_pid(), os.getpid()
    for name in (f"dt{dead}-0", f"dt{dead}-sw", f"dt{live}-0", "other-0"):
        (tmp_path / name).mkdir()
    assert netns.sweep_stale() == [f"dt{dead}-0", f"dt{dead}-sw"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"dt{live}-0", "other-0"]


@pytest.mark.netns
@needs_netns
def test_the_session_sweep_removes_a_dead_owners_namespace_and_keeps_a_live_ones():
    dead = _dead_pid()
    stale, live = f"dt{dead}-0", f"dt{os.getpid()}s-0"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            (netns.ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
            (netns.ETC_NETNS / name / "hosts").write_text("127.0.0.1\tlocalhost\n")
        removed = sweep_namespaces()
        assert stale in removed and live not in removed
        assert stale not in _listed() and not (netns.ETC_NETNS / stale).exists()
        assert live in _listed() and (netns.ETC_NETNS / live / "hosts").exists()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            shutil.rmtree(Path(netns.ETC_NETNS) / name, ignore_errors=True)


_HOLDER = """
import os, time
from collections import namedtuple
from disttrain.k8s.netns import network
Pod = namedtuple("Pod", "name address aliases")
with network([Pod("p0", "198.18.0.1", ("p0",))], f"dt{os.getpid()}"):
    print("up", flush=True)
    time.sleep(120)
"""


@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_with_its_default_action_still_removes_the_network(sig):
    """SIGTERM / SIGHUP would end the process at once, without `network`'s cleanup; while
    a network is up they unwind it instead (a plain `python` caller, no handler of its own)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    tag = f"dt{proc.pid}"
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert {f"{tag}-0", f"{tag}-sw"} <= _listed()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
        assert not {n for n in _listed() if n.startswith(f"{tag}-")}
        assert not (netns.ETC_NETNS / f"{tag}-0").exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        netns.sweep_stale()
