"""How a disttrain process ends (resilience/process_end.py): the status `python script.py`
would give, open files written, a Ctrl-C during the clean-ups as interrupted. The whole exit
of a script rank, with a teardown that aborts, is tests/cli/test_run_script.py's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from disttrain.resilience.process_end import exit_status
from tests.conftest import sigint_default


@pytest.mark.parametrize(("code", "status", "printed"), [
    (None, 0, ""), (0, 0, ""), (3, 3, ""), (True, 1, ""), ("bye", 1, "bye\n"), ([1], 1, "[1]\n")])
def test_exit_status_is_pythons(capsys, code, status, printed):
    assert exit_status(SystemExit(code)) == status
    assert capsys.readouterr().err == printed


def test_open_files_are_flushed(tmp_path):
    """In a process of its own: flushing every open file of a pytest worker is not this
    test's business."""
    code = textwrap.dedent("""
        import pathlib, sys
        from disttrain.resilience.process_end import flush_open_files
        path = pathlib.Path(sys.argv[1])
        log = open(path, "w")            # left open, as a script may leave it
        log.write("kept")
        before = path.read_text()
        print(repr(before), flush_open_files() >= 1, repr(path.read_text()))
    """)
    ended = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log.txt")],
                           capture_output=True, text=True, timeout=30)
    assert ended.stdout.split() == ["''", "True", "'kept'"], ended.stderr


def test_join_threads_names_what_it_leaves_after_the_grace():
    """In a process of its own, where the only other thread is this test's."""
    code = textwrap.dedent("""
        import threading
        from disttrain.resilience.process_end import join_threads
        stop = threading.Event()
        threading.Thread(target=stop.wait, name="poller").start()
        left = join_threads(0.2)
        stop.set()
        print(left, join_threads(5))
    """)
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)
    assert ended.stdout.strip() == "['poller'] []", ended.stderr


def test_ctrl_c_while_waiting_for_a_thread_ends_as_interrupted():
    code = textwrap.dedent("""
        import os, signal, threading, time
        from disttrain.resilience.process_end import end_process
        threading.Thread(target=time.sleep, args=(60,)).start()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        end_process(0)
    """)
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30, preexec_fn=sigint_default)
    assert ended.returncode == 130, ended.stderr
