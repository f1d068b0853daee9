"""A warm interpreter that the suite forks its `disttrain` commands from (tests/conftest.py's
`run_cli`): each command is still its own process, with its own argv, environment, working
directory, stdin/stdout/stderr and exit status, running `python -m disttrain.cli.main`'s
code from the start (`runpy`, as `-m` does); what it does not repeat is the interpreter's
start and the ~3 s of CPU its imports cost (torch ~2 s in the command, torch._dynamo ~1.1 s
in the warm fork server it starts). The suite starts ~100 such commands, on 2 cores.

    warm = WarmCli.start(env)          # one per pytest worker, on its first command
    res = warm.run(args, cwd=..., env=..., timeout=...)   # a subprocess.CompletedProcess
    warm.stop()

What a fresh process does differently, and why it does not change what the tests check:

- **Imports.** The server process imported torch, torch._dynamo, torch.distributed,
  torch.nn.parallel, torchrun and the CLI's modules, and ran nothing: no torch op (so no
  OpenMP team, which a fork would leave broken), no thread. `disttrain run` forks its warm
  fork server from itself only when it has imported torch itself
  (`disttrain.launch.forkserver._may_fork_server`: from a process whose torch may have run,
  a fork is unsafe); here the command's process knows better, so that check is replaced by
  its other half (one Python thread) and the server is a fork of the command, as it is
  outside the suite. The fork server's preload module is not imported here: its
  module-level code runs in the server, as always.
- **Environment read at import.** The server was started with the suite's environment; a
  command whose environment differs from it in anything but the variables read at run time
  (FORK_SAFE_ENV) runs as a fresh process instead (`runs_warm`).
- **Process identity.** The command's /proc/PID/cmdline is this server's; the tests that
  read command lines, send signals to a command, or are about how a process starts, start
  `disttrain` themselves (`DISTTRAIN` in tests/conftest.py). `DISTTRAIN_TEST_FRESH=1` runs
  every command fresh (`make test-fresh`).

The protocol: a SOCK_SEQPACKET Unix socket; a request is one JSON message with the
command's stdin, stdout and stderr as passed file descriptors (SCM_RIGHTS); the server
answers with the pid, then, when the command ends, its exit status. The server ends when
its stdin (a pipe from the pytest worker) closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Imported once here, before any command: what `disttrain run` and its fork server import
# (disttrain.launch.forkserver_preload, plan.mesh_fit.MODEL_CHECK_IMPORTS), not the preload
# module itself.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "torch.distributed.run", "disttrain.cli.run_cmd",
           "disttrain.train.build", "disttrain.worker", "disttrain.distributed.pipeline",
           "disttrain.distributed.tensor_parallel")
# Variables a command may set differently from the server's environment: read when
# disttrain's or torch's code runs, never at import (tests/test_warm_cli.py checks that
# importing PRELOAD reads none of them; it found TMPDIR, which torch._dynamo reads).
FORK_SAFE_ENV = ("DISTTRAIN_", "PYTEST_", "PYTHONUNBUFFERED", "MASTER_ADDR",
                 "MASTER_PORT", "NCCL_", "GLOO_", "TORCH_DISTRIBUTED_DEBUG", "KUBECONFIG")
MESSAGE_BYTES = 1 << 20
# an unused argument: room in the server's command line, which its forks' titles overwrite
# (`disttrain rank 0/2 job NAME`, disttrain.resilience.proctitle)
TITLE_ROOM = "." * 256
START_TIMEOUT_S = 120.0


def runs_warm(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a command with `env` may be forked from a server started with `server_env`
    (tests/conftest.py also runs every command fresh under DISTTRAIN_TEST_FRESH=1)."""
    changed = {k for k in set(env) | set(server_env) if env.get(k) != server_env.get(k)}
    return all(k.startswith(FORK_SAFE_ENV) for k in changed)


class WarmCli:
    """The pytest worker's side: starts the server, forks commands from it."""

    def __init__(self, proc: subprocess.Popen, path: str) -> None:
        self.proc, self.path = proc, path

    @classmethod
    def start(cls, env: dict[str, str]) -> WarmCli:
        # its own folder in /tmp: a socket's path must stay under ~100 bytes, whatever
        # TMPDIR a test sets; `stop` removes it
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="dt-warm-", dir="/tmp"), "warm-cli.sock")
        proc = subprocess.Popen([sys.executable, "-m", "tests.warm_cli", path, TITLE_ROOM], env=env,
                                stdin=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(path + ".ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the warm disttrain server did not start (exit {proc.poll()})")
            time.sleep(0.05)
        return cls(proc, path)

    def stop(self) -> None:
        import shutil

        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the warm disttrain server did not end when its stdin closed") from None
        finally:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

    def popen(self, args: list[str], *, cwd: str | Path | None, env: dict[str, str],
              stdin: int = 0, stdout: int = 1, stderr: int = 2,
              start_new_session: bool = False) -> WarmProcess:
        """`subprocess.Popen([python, -m, disttrain.cli.main, *args], ...)` with these file
        descriptors as its stdio (this process's own unless given), forked from the server."""
        request = {"args": list(args), "cwd": os.path.abspath(cwd or os.getcwd()), "env": env,
                   "new_session": start_new_session}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin, stdout, stderr])
            conn.settimeout(START_TIMEOUT_S)
            pid = json.loads(conn.recv(MESSAGE_BYTES))["pid"]
        except BaseException:
            conn.close()
            raise
        return WarmProcess([sys.executable, "-m", "disttrain.cli.main", *args], pid, conn)

    def run(self, args: list[str], *, cwd: str | Path | None, env: dict[str, str],
            timeout: float, stdin: int = 0) -> subprocess.CompletedProcess:
        """`subprocess.run([python, -m, disttrain.cli.main, *args], capture_output=True,
        text=True, ...)`, the command forked from the server; `stdin`: the fd it reads
        (this process's own, as subprocess.run passes it, unless given)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = self.popen(args, cwd=cwd, env=env, stdin=stdin, stdout=out_w, stderr=err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
        streams = _Drain(out_r), _Drain(err_r)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()    # what subprocess.run does on a timeout: kill the command
            proc.wait(60)
            out, err = (s.text(5) for s in streams)
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        # the pipes end when every process holding them has (as for subprocess.run)
        deadline = time.monotonic() + timeout
        out, err = (s.text(max(1.0, deadline - time.monotonic())) for s in streams)
        return subprocess.CompletedProcess(proc.args, code, out, err)


class WarmProcess:
    """A forked command, as much of `subprocess.Popen` as the tests use: pid, poll, wait,
    kill, returncode (its exit status comes from the server, its parent)."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args, self.pid, self._conn = args, pid, conn
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._ended(self._conn.recv(MESSAGE_BYTES))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._ended(self._conn.recv(MESSAGE_BYTES))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)

    def _ended(self, message: bytes) -> None:
        if not message:
            raise RuntimeError("the warm disttrain server ended before the command did")
        self.returncode = json.loads(message)["returncode"]
        self._conn.close()


class _Drain:
    """Read a pipe to its end in a thread (as `subprocess.communicate` does)."""

    def __init__(self, fd: int) -> None:
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        with open(fd, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                self.chunks.append(chunk)

    def text(self, timeout: float) -> str:
        self.thread.join(timeout)
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")


# -- the server --------------------------------------------------------------------------
_KEEP: list[Any] = []   # the server's objects in a command: never finalized (their fds closed)


def serve(path: str) -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    Path(path + ".ready").touch()
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return   # the pytest worker is gone
                elif key.data == "accept":
                    conn, _ = listener.accept()
                    _accept(conn, selector, listener)
                else:
                    conn, pidfd, pid = key.data
                    selector.unregister(key.fileobj)
                    _, status = os.waitpid(pid, 0)
                    os.close(pidfd)
                    with conn:
                        _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    finally:
        for name in (path, path + ".ready"):
            Path(name).unlink(missing_ok=True)


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):   # the test gave up on it (a timeout): nothing to tell
        conn.send(json.dumps(message).encode())


def _accept(conn: socket.socket, selector: selectors.BaseSelector, listener: socket.socket) -> None:
    data, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        _KEEP.extend([conn, selector, listener])
        _command(request, fds)   # never returns
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    selector.register(pidfd, selectors.EVENT_READ, (conn, pidfd, pid))
    _send(conn, {"pid": pid})


def _command(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m disttrain.cli.main ARGS` in the request's
    folder, environment and stdio, and end as it ends (`disttrain.cli.main.entry`)."""
    code = 1
    try:
        if request.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        _become(request)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _become(request: dict) -> None:
    import importlib
    import io
    import runpy
    import tempfile

    import disttrain.launch.forkserver as forkserver

    os.chdir(request["cwd"])
    # only what differs: a cleared environment moves every string, and setproctitle (the
    # ranks' and the fork server's titles) then finds no room after argv
    for key in set(os.environ) - set(request["env"]):
        del os.environ[key]
    for key, value in request["env"].items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    tempfile.tempdir = None
    importlib.invalidate_caches()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = open(0, closefd=False)   # noqa: SIM115
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(binary, encoding="utf-8", errors=errors,
                                  line_buffering=fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # this process imported torch and ran none of it (module docstring)
    forkserver._may_fork_server = lambda: threading.active_count() == 1
    sys.argv = ["-m", *request["args"]]
    sys.path[0] = request["cwd"]
    runpy.run_module("disttrain.cli.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    serve(sys.argv[1])
