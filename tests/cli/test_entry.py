"""The `disttrain` console entry (`cli.main.entry`): it ends the process itself with
`exit_now` (docs/performance.md), so an exception it did not expect must still be shown,
never turned into a mute exit status 1."""

from __future__ import annotations

import atexit

import pytest

import disttrain.cli.main as cli_main
import disttrain.resilience.watchdog as watchdog


class _Exited(Exception):
    pass


def _exit_now(code: int) -> None:
    raise _Exited(code)


@pytest.fixture(autouse=True)
def exit_funcs(monkeypatch) -> list[bool]:
    """entry() ends the process (`exit_now`, raised here instead) after the atexit
    handlers, which are counted, never run: in the pytest worker they include
    weakref.finalize's, which tore down torch's prims operator library and broke every
    later memory plan in that worker (the 10 failures of a local run)."""
    ran: list[bool] = []
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: ran.append(True))
    monkeypatch.setattr(watchdog, "exit_now", _exit_now)
    return ran


@pytest.mark.parametrize(("raised", "code"), [(RuntimeError("boom in a module"), 1),
                                              (KeyboardInterrupt(), 130)])
def test_an_unexpected_exception_is_shown_with_its_traceback(monkeypatch, capsys, raised, code):
    def main() -> int:
        raise raised

    monkeypatch.setattr(cli_main, "main", main)
    with pytest.raises(_Exited) as exited:
        cli_main.entry()
    assert exited.value.args == (code,)
    err = capsys.readouterr().err
    if code == 1:
        assert "Traceback" in err and "RuntimeError: boom in a module" in err, err
        assert err.rstrip().endswith("please report it"), err
    else:
        assert "Traceback" not in err


def test_a_normal_exit_keeps_its_code_after_the_exit_handlers(monkeypatch, capsys, exit_funcs):
    monkeypatch.setattr(cli_main, "main", lambda: 2)
    with pytest.raises(_Exited) as exited:
        cli_main.entry()
    assert exited.value.args == (2,) and capsys.readouterr().err == ""
    assert exit_funcs == [True]
