"""The `disttrain` console entry (`cli.main.entry`): it ends the process itself with
`exit_now` (docs/performance.md), so an exception it did not expect must still be shown,
never turned into a mute exit status 1."""

from __future__ import annotations

import pytest

import disttrain.cli.main as cli_main
import disttrain.resilience.watchdog as watchdog


class _Exited(Exception):
    pass


def _exit_now(code: int) -> None:
    raise _Exited(code)


@pytest.mark.parametrize(("raised", "code"), [(RuntimeError("boom in a module"), 1),
                                              (KeyboardInterrupt(), 130)])
def test_an_unexpected_exception_is_shown_with_its_traceback(monkeypatch, capsys, raised, code):
    def main() -> int:
        raise raised

    monkeypatch.setattr(cli_main, "main", main)
    monkeypatch.setattr(watchdog, "exit_now", _exit_now)
    with pytest.raises(_Exited) as exited:
        cli_main.entry()
    assert exited.value.args == (code,)
    err = capsys.readouterr().err
    if code == 1:
        assert "Traceback" in err and "RuntimeError: boom in a module" in err, err
        assert err.rstrip().endswith("please report it"), err
    else:
        assert "Traceback" not in err


def test_a_normal_exit_keeps_its_code(monkeypatch, capsys):
    monkeypatch.setattr(cli_main, "main", lambda: 2)
    monkeypatch.setattr(watchdog, "exit_now", _exit_now)
    with pytest.raises(_Exited) as exited:
        cli_main.entry()
    assert exited.value.args == (2,) and capsys.readouterr().err == ""
