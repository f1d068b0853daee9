"""The emulated hosts of `disttrain k8s run-local`: network namespaces on one bridge.

    with network(pods, "dt1234") as names:     # pod name -> namespace name
        ...                                    # run each pod with `ip netns exec NAME`
    lose_host("dt1234-1")                      # what a lost node does: SIGKILL all of it
    set_link("dt1234", 1, up=False)            # a partition: host 1's cable pulled
    sweep_stale()                              # what killed runs left: dt<dead pid>-*

Each emulated host is a namespace with one veth (eth0) whose peer is a port of a bridge in
a private "switch" namespace (`<tag>-sw`); addresses come only from 198.18.0.0/15
(RFC 2544 benchmarking space), `/etc/netns/<ns>/hosts` maps the names the cluster's DNS
would serve, and there is no default route. `lose_host` and `set_link` are the faults of
docs/resilience.md ("Hosts lost and partitions"): they act on the namespace as a whole,
as a node failure or a network partition would, not on one chosen process. `network`
removes what it made on every exit path its process runs code on; `sweep_stale` removes
what a killed process (SIGKILL) left, named after its dead pid.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from disttrain.errors import LocalRunError

SUBNET = ipaddress.ip_network("198.18.0.0/15")
POD_NET = ipaddress.ip_network("198.18.0.0/24")


class Host(Protocol):
    """What the network needs of a pod: its name, address and DNS names."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


def pod_address(index: int) -> str:
    """The emulated pod's IPv4 address: 198.18.0.<index + 1> (inside 198.18.0.0/15)."""
    addr = POD_NET.network_address + index + 1
    if addr not in POD_NET or addr == POD_NET.broadcast_address:
        raise LocalRunError(f"run-local emulates at most {POD_NET.num_addresses - 2} pods")
    assert addr in SUBNET
    return str(addr)




def hosts_file(pods: Sequence[Host]) -> str:
    """/etc/hosts of every emulated pod: loopback plus all pods' DNS names."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "::ffff:127.0.0.1\tlocalhost"]
    lines += [f"{p.address}\t{' '.join(p.aliases)}" for p in pods]
    # the same names for IPv4-mapped IPv6 peers, so c10d's reverse lookups succeed offline
    lines += [f"::ffff:{p.address}\t{' '.join(p.aliases)}" for p in pods]
    return "\n".join(lines) + "\n"


def check_host() -> None:
    """Refuse, with the reason, where network namespaces cannot be made."""
    if not sys.platform.startswith("linux"):
        raise LocalRunError("run-local needs Linux network namespaces")
    if os.geteuid() != 0:
        raise LocalRunError("run-local needs root: it creates network namespaces (ip netns) "
                            "and veth pairs; run it with sudo")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("sh", "a shell")):
        if shutil.which(tool) is None:
            raise LocalRunError(f"run-local needs `{tool}` ({package}) on PATH")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise LocalRunError(f"`ip netns` does not work here: {probe.stderr.strip()}")


# -- the emulated network ------------------------------------------------------------------
def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LocalRunError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


ETC_NETNS = Path("/etc/netns")
# The namespaces `network` makes: "<tag>-<i>" and "<tag>-sw", where run-local's tag is
# "dt<its pid>" (a test's may add letters: "dt<pid>t"); the pid tells whether its owner lives.
OWNED_NAME = re.compile(r"^dt(?P<pid>\d+)[A-Za-z]*-(?:\d+|sw)$")

# namespaces made and not yet removed, by tag: what `_at_exit` removes if the process
# ends without unwinding `network` (sys.exit in another thread, an atexit-time teardown)
_LIVE: dict[str, list[str]] = {}
# signals whose default action would end the process inside `network` without its
# cleanup: while a network is up, they unwind instead (SystemExit: `finally` runs)
_UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def network(pods: Sequence[Host], tag: str) -> Iterator[dict[str, str]]:
    """Namespaces, veths and hosts files for `pods`; yields pod name -> netns name.

    Removed on every exit path this process gets to run code on: the block's end, an
    exception, Ctrl-C, SIGTERM / SIGHUP (unwound when they still have their default
    action), and interpreter exit (atexit). A SIGKILL leaves them: `sweep_stale` removes
    those whose owner (the pid in the tag) is gone.
    """
    switch = f"{tag}-sw"
    names = {p.name: f"{tag}-{i}" for i, p in enumerate(pods)}
    made = _LIVE.setdefault(tag, [])
    fresh_etc = not ETC_NETNS.exists()
    previous = _unwind_on_signals()
    try:
        made.append(switch)   # recorded first: a signal right after the add still removes it
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts = hosts_file(pods)
        for i, pod in enumerate(pods):
            ns = names[pod.name]
            made.append(ns)
            _ip("netns", "add", ns)
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            # nothing listens there inside the namespace: unknown names fail fast, offline
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{i}",
                "netns", switch)
            _ip("-n", switch, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{pod.address}/{POD_NET.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        _remove(made)
        _LIVE.pop(tag, None)
        _restore(previous)
        if fresh_etc and ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
            with contextlib.suppress(OSError):   # another run made one meanwhile
                ETC_NETNS.rmdir()


def _remove(made: list[str]) -> None:
    """Delete namespaces (last made first) and their /etc/netns folders."""
    for ns in reversed(made):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    made.clear()


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _unwind_on_signals() -> dict[int, Any]:
    """Make SIGTERM / SIGHUP unwind while they still have their default action (main
    thread only: elsewhere Python cannot set handlers); the previous handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in _UNWIND_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_exit)
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@atexit.register
def _at_exit() -> None:
    for made in list(_LIVE.values()):
        _remove(made)
    _LIVE.clear()


def sweep_stale(alive: Callable[[int], bool] | None = None) -> list[str]:
    """Remove the namespaces and /etc/netns folders `network` left behind in a process that
    was killed (SIGKILL, `os._exit`: nothing of it ran): those named like `OWNED_NAME`
    whose owning pid is not `alive` (default: `psutil.pid_exists`). Returns the names
    removed. Others' namespaces, and a live run's, are left alone.

    A pid reused by an unrelated process keeps its namespaces until that process ends:
    a leak is safer than removing a live run's hosts.
    """
    if alive is None:
        import psutil

        alive = psutil.pid_exists   # also a pid of someone else's live process
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    folders = {p.name for p in ETC_NETNS.iterdir()} if ETC_NETNS.is_dir() else set()
    stale = sorted(n for n in listed | folders
                   if (m := OWNED_NAME.match(n)) and not alive(int(m["pid"])))
    for ns in stale:
        if ns in listed:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    return stale


# -- faults --------------------------------------------------------------------------------
def host_pids(ns: str) -> list[int]:
    """Every process in namespace `ns` (`ip netns pids`): all of one emulated host."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def lose_host(ns: str) -> list[int]:
    """SIGKILL every process of emulated host `ns` at once (a node lost: no process of it
    gets to say goodbye); returns the pids killed."""
    pids = host_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def set_link(tag: str, index: int, up: bool) -> None:
    """Set the switch port of host `index` (veth `v<index>` in `<tag>-sw`) down or up: the
    host keeps its address and sockets, but its packets go nowhere, like a pulled cable
    or a partitioned node (TCP neither fails nor delivers until the link is back)."""
    _ip("-n", f"{tag}-sw", "link", "set", f"v{index}", "up" if up else "down")
