"""Every path the user gives that cannot be used is exit 2 with the path named: too long,
a NUL, missing, a directory, a named pipe (which would block the reader), a device,
unreadable. First the checks themselves, then each command that opens a user path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from disttrain.cli.main import cli
from disttrain.errors import LintError, SpecError
from disttrain.spec.paths import check_readable_file, check_writable_dir, file_problem, shown

pytestmark = pytest.mark.timeout(120)
LONG = "x" * 300  # a file name may be 255 bytes: stat raises ENAMETOOLONG
as_root = os.geteuid() == 0


@pytest.fixture
def paths(tmp_path, monkeypatch):
    """Cwd with a readable file, a folder, a named pipe and an unreadable file."""
    monkeypatch.chdir(tmp_path)
    Path("ok.py").write_text("print('hi')\n")
    Path("adir").mkdir()
    os.mkfifo("fifo")
    Path("secret.py").write_text("print('hi')\n")
    Path("secret.py").chmod(0)
    return tmp_path


BAD = [  # (path, what the message says)
    (LONG, "file name too long"),
    ("a\x00b", "NUL character"),
    ("missing.py", "no such file"),
    ("ok.py/inner.py", "no such file"),
    ("adir", "is a directory"),
    ("fifo", "is a named pipe (FIFO)"),
    ("/dev/null", "is a character device"),
]


@pytest.mark.parametrize(("path", "problem"), BAD)
def test_unusable_file_is_named_with_its_problem(paths, path, problem):
    with pytest.raises(SpecError) as err:
        check_readable_file(path, "script ", kind="script")
    assert str(err.value).startswith(f"script {shown(path)}: ")
    assert problem in str(err.value)


def test_readable_file_and_folder(paths):
    assert check_readable_file("ok.py") == Path("ok.py")
    assert file_problem("adir", dir_ok=True) is None
    with pytest.raises(LintError, match="adir: is a directory, not a script"):
        check_readable_file("adir", kind="script", error=LintError)


@pytest.mark.skipif(as_root, reason="root reads every file")
def test_unreadable_file(paths):
    with pytest.raises(SpecError, match=r"secret\.py: cannot read: Permission denied"):
        check_readable_file("secret.py")


def test_a_file_the_os_will_not_open_is_named(paths, monkeypatch):
    """What a non-root user gets for a file without read permission (root reads all)."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(SpecError, match=r"^script ok\.py: cannot read: Permission denied$"):
        check_readable_file("ok.py", "script ")


def test_long_names_are_cut_in_messages():
    assert shown("y" * 5000) == "y" * 300 + "..."
    assert shown("short") == "short"


@pytest.mark.parametrize(("path", "problem"), [
    (LONG, "file name too long"),
    (f"new/{LONG}/deeper", "file name too long"),
    ("a\x00b", "cannot use: the name contains a NUL character"),
    ("ok.py", "exists and is not a directory"),
    ("ok.py/run", "cannot create it: ok.py is not a directory"),
])
def test_unusable_run_dir(paths, path, problem):
    with pytest.raises(SpecError) as err:
        check_writable_dir(path, "train.run_dir: ")
    assert str(err.value) == f"train.run_dir: {shown(path)}: {problem}"


def test_usable_run_dirs(paths):
    for path in ("adir", "new/run", str(paths / "abs" / "run")):
        assert check_writable_dir(path) == Path(path)


@pytest.mark.skipif(as_root, reason="root writes everywhere")
def test_run_dir_under_a_read_only_folder(paths):
    Path("ro").mkdir(mode=0o500)
    with pytest.raises(SpecError, match="cannot create it: ro is not writable"):
        check_writable_dir("ro/run")


def test_run_refuses_an_unusable_run_dir_before_writing(paths, capsys):
    import click

    from disttrain.cli.run_cmd import _prepare_run_dir
    from disttrain.spec.job import JobSpec

    with pytest.raises(click.exceptions.Exit) as exc:
        _prepare_run_dir(JobSpec.from_dict({}, {"run_dir": "ok.py"}))
    assert exc.value.exit_code == 2
    assert "train.run_dir: ok.py: exists and is not a directory" in capsys.readouterr().err


# -- each command that opens a user path --------------------------------------------------
IMG = ["--image", "reg.local/pytorch:1"]
COMMANDS = {
    "run SCRIPT": lambda p: ["run", "--dry-run", p],
    "run -f": lambda p: ["run", "--dry-run", "-f", p],
    "k8s render SCRIPT": lambda p: ["k8s", "render", *IMG, p],
    "k8s render -f": lambda p: ["k8s", "render", *IMG, "-f", p],
    "k8s render code.files": lambda p: ["k8s", "render", *IMG, "ok.py", "--code",
                                        f"{{files: [{p}]}}"],
    "doctor logs": lambda p: ["doctor", "logs", p],
    "lint": lambda p: ["lint", p],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("path", "problem"), [b for b in BAD if "\x00" not in b[0]])
def test_commands_exit_2_naming_the_path(paths, command, path, problem):
    if command == "run -f" and path == "adir":
        problem = "is a directory"  # click.Path(dir_okay=False) answers first
    if command == "k8s render code.files" and path == "adir":
        pytest.skip("a folder of files to ship is fine")
    res = CliRunner().invoke(cli, COMMANDS[command](path), catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 2, res.output
    assert shown(path) in res.output and problem in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("command", ["run SCRIPT", "k8s render SCRIPT", "doctor logs", "lint"])
def test_commands_exit_2_on_a_nul_in_the_path(paths, command):
    res = CliRunner().invoke(cli, COMMANDS[command]("a\x00b"), catch_exceptions=True)
    assert res.exit_code == 2 and "NUL character" in res.output, res.output


def test_kubeconfig_that_cannot_be_read_is_a_cluster_error(paths):
    from disttrain.errors import KubeError
    from disttrain.k8s.client import find_kubeconfig

    for path, problem in [(LONG, "file name too long"), ("fifo", "named pipe"),
                          ("missing", "no such file")]:
        with pytest.raises(KubeError, match=f"--kubeconfig .*: .*{problem}"):
            find_kubeconfig(path)
