"""Paths the user gives (a script, `-f FILE`, a run dir, files to ship, logs to read),
checked before they are used.

    script = check_readable_file(spec.script, "script ", kind="script")
    run_dir = check_writable_dir(spec.run_dir, "train.run_dir: ")

A path can fail in ways a plain `Path.is_file()` does not survive: a name longer than the
OS allows raises `OSError: File name too long` from `stat` itself, a NUL raises
ValueError, and a named pipe passes an `exists()` check and then blocks the reader
forever. Each of these becomes one error that names the path and what is wrong with it,
raised as a `SpecError` (the CLI prints it and exits 2) or as the caller's own error
class. No torch, no disttrain imports besides the errors.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from disttrain.errors import DisttrainError, SpecError

__all__ = ["check_readable_file", "check_writable_dir", "file_problem", "is_directory", "shown"]

_NAME_MAX = 255  # bytes in one file name: Linux, macOS and Windows file systems alike
SHOWN_CHARS = 300  # a path in a message is cut here: a 5000-character name helps nobody
_NOT_REGULAR = ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"),
                (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def shown(path: str | os.PathLike[str]) -> str:
    """`path` as it appears in a message: whole, or its first 300 characters and '...'."""
    text = str(path)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _name_problem(path: str | os.PathLike[str]) -> str:
    """What os.stat's ValueError meant: a NUL, or a character the file system's encoding
    cannot hold (a lone surrogate)."""
    if "\x00" in str(path):
        return "the name contains a NUL character"
    return "the name is not valid in this file system's encoding"


def _os_problem(exc: OSError) -> str:
    if exc.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return f"cannot read: {exc.strerror or exc}"


def file_problem(path: str | os.PathLike[str], kind: str = "file", dir_ok: bool = False,
                 missing: str = "no such file") -> str | None:
    """What makes `path` unusable as a readable regular file (or directory when `dir_ok`),
    or None when it is usable.

    Args:
        path: the path as the user gave it.
        kind: what the file should be, for "is a directory, not a {kind}".
        dir_ok: a readable directory is fine too (files to ship may be folders).
        missing: the text when nothing is there (callers add where they looked).
    """
    try:
        st = os.stat(path)
    except ValueError:  # os.stat's answer to a NUL (or an unencodable name)
        return f"cannot read: {_name_problem(path)}"
    except (FileNotFoundError, NotADirectoryError):
        return missing
    except OSError as exc:
        return _os_problem(exc)
    if stat.S_ISDIR(st.st_mode):
        if not dir_ok:
            return f"is a directory, not a {kind}"
        return None if os.access(path, os.R_OK | os.X_OK) else "cannot read: permission denied"
    for test, name in _NOT_REGULAR:
        if test(st.st_mode):
            return f"is a {name}, not a {kind}"
    try:  # the permission bits alone do not tell (ACLs, root, read-only mounts)
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        return _os_problem(exc)
    return None


def check_readable_file(path: str | os.PathLike[str], label: str = "", *, kind: str = "file",
                        dir_ok: bool = False, missing: str = "no such file",
                        error: type[DisttrainError] = SpecError) -> Path:
    """`path` as a Path when it can be read; otherwise raise `error` naming it.

    The message is `{label}{path}: {problem}`, e.g. "script train.py: no such file" or
    "script x: is a named pipe (FIFO), not a script".

    Args:
        path: the path as the user gave it.
        label: text before the path ("script ", "--kubeconfig ", "cluster.code.files: ").
        kind, dir_ok, missing: see `file_problem`.
        error: the DisttrainError subclass to raise (SpecError by default).

    Raises:
        error: the path is missing, too long, holds a NUL, is a directory (unless
            `dir_ok`), a FIFO, socket or device, or cannot be opened for reading.

    Example:
        >>> check_readable_file("train.py", "script ", kind="script")
        PosixPath('train.py')
    """
    problem = file_problem(path, kind=kind, dir_ok=dir_ok, missing=missing)
    if problem is not None:
        raise error(f"{label}{shown(path)}: {problem}")
    return Path(path)


def check_writable_dir(path: str | os.PathLike[str], label: str = "",
                       error: type[DisttrainError] = SpecError) -> Path:
    """`path` as a Path when it is a writable directory or can be created as one.

    Raises:
        error: `{label}{path}: {problem}`: the name is too long or holds a NUL, it is an
            existing file, or its nearest existing parent is not a writable directory.
    """
    here = Path(path)
    problem = _dir_problem(here)
    if problem is not None:
        raise error(f"{label}{shown(path)}: {problem}")
    return here


def _dir_problem(path: Path) -> str | None:
    try:  # stat stops at the first missing folder: a too-long name under it is for mkdir
        if any(len(os.fsencode(part)) > _NAME_MAX for part in path.parts):
            return "file name too long"
    except ValueError:
        return f"cannot use: {_name_problem(path)}"
    for i, candidate in enumerate((path, *path.parents)):
        try:
            st = os.stat(candidate)
        except ValueError:
            return f"cannot use: {_name_problem(path)}"
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                continue  # a parent is a file: reported when the walk reaches it
            return "file name too long" if exc.errno == errno.ENAMETOOLONG else \
                f"cannot use: {exc.strerror or exc}"
        where = "" if i == 0 else f"cannot create it: {shown(candidate)} "
        if not stat.S_ISDIR(st.st_mode):
            return f"{where}is not a directory" if where else "exists and is not a directory"
        if not os.access(candidate, os.W_OK | os.X_OK):
            return f"{where}is not writable" if where else "is not writable"
        return None
    return None  # nothing of it exists, not even '.': the mkdir will say why


def is_directory(path: str | os.PathLike[str]) -> bool:
    """Path.is_dir that answers False for names the OS refuses (too long, NUL)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def locate_task_file(task: str, folder: str | os.PathLike[str]) -> tuple[str, Path] | None:
    """A task given as a file (`../x/mytask.py:fn`, `/abs/mytask.py:fn`), found relative to
    `folder` (the spec file's or the current folder): `('mytask:fn', its folder)`, which is
    how workers import it and k8s/code.py ships it (the file's folder on the path, as
    `python FILE` does); None for a module reference (`pkg.mod:fn`).

    Raises:
        SpecError: the file is not there (or not readable), naming where it was looked for.
    """
    module, _, attr = task.rpartition(":")
    if not module.endswith(".py"):
        return None
    path = Path(folder) / module  # an absolute `module` replaces `folder`
    problem = file_problem(path, kind="task file")
    if problem is not None:
        raise SpecError(f"task: {shown(path)}: {problem}; give the path of an existing .py file "
                        f"(absolute, or relative to {shown(folder)})")
    resolved = path.resolve()
    return f"{resolved.stem}:{attr}", resolved.parent
