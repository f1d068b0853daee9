"""How the training code and the built-in job's spec reach the pod.

    plan = plan_code(spec, base_dir=Path("."))
    plan.script_in_pod        # '/workspace/train.py'
    plan.files                # ConfigMap entries (key, path under the mount, content)

The default ships the script (and `cluster.code.files`) in a ConfigMap, so nobody has to
`sudo cp` files onto a node (and keep every node's copy the same). The files are mounted
one by one (subPath) into a writable emptyDir at the mount point, because scripts write
next to themselves (a script in /workspace that saves model.pth writes
/workspace/model.pth) and a ConfigMap volume is read-only.
Built-in examples (`python -m disttrain.worker --spec ...`) get the resolved job spec as
`job.yaml` from the same ConfigMap, whatever the code source.
"""

from __future__ import annotations

import base64
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from disttrain.errors import CodeError
from disttrain.spec.job import JobSpec
from disttrain.spec.paths import file_problem, shown

CONFIGMAP_LIMIT = 1024 * 1024  # bytes; the API server rejects larger ConfigMaps
SPEC_DIR = "/etc/disttrain"
SPEC_KEY = "job.yaml"
SPEC_PATH = f"{SPEC_DIR}/{SPEC_KEY}"
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules"}



@dataclass(frozen=True)
class CodeFile:
    """One ConfigMap entry and where it appears in the container."""

    key: str
    mount_path: str  # absolute path in the container
    text: str | None = None  # UTF-8 content (ConfigMap `data`)
    binary: str | None = None  # base64 content (ConfigMap `binaryData`)

    @property
    def size(self) -> int:
        return len(self.key) + len((self.text or "").encode()) + len(self.binary or "")


@dataclass(frozen=True)
class CodePlan:
    """Where the code comes from and what the ConfigMap (if any) holds."""

    delivery: str  # configmap | host_path | pvc
    mount: str
    script_in_pod: str | None
    files: tuple[CodeFile, ...]

    @property
    def needs_configmap(self) -> bool:
        return bool(self.files)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def plan_code(spec: JobSpec, base_dir: Path, spec_text: str | None = None) -> CodePlan:
    """Decide the in-pod script path and the ConfigMap entries for `spec`.

    Args:
        spec: the job.
        base_dir: where relative local paths (script, code.files) are resolved.
        spec_text: the job.yaml shipped to built-in workers (default: `spec.to_yaml()`).

    Raises:
        CodeError: missing script or file, a name that cannot be a ConfigMap key, or a
            ConfigMap over 1 MiB.
    """
    code = spec.cluster.code
    files: list[CodeFile] = []
    script_in_pod: str | None = None
    if code.delivery == "configmap":
        root = base_dir
        if spec.script:
            local = _local(base_dir, spec.script, "script ", kind="script", missing=(
                f"no such file (looked in {base_dir}); give an existing script, or "
                f"--code '{{host_path: DIR}}' if it lives on the nodes"))
            root = local.parent
            script_in_pod = posixpath.join(code.mount, local.name)
            files.append(_entry(local, local.name, code.mount))
        for name in code.files:
            local = _local(base_dir, name, "cluster.code.files: ", dir_ok=True,
                           missing=f"no such file (looked in {base_dir})")
            for path in _walk(local, name):
                rel = _relative(path, root)
                files.append(_entry(path, rel, code.mount))
    elif spec.script:
        script = PurePosixPath(spec.script)
        script_in_pod = str(script) if script.is_absolute() else posixpath.join(
            code.mount, str(script))
    if spec.workload != "script":
        text = spec.to_yaml() if spec_text is None else spec_text
        files.append(CodeFile(SPEC_KEY, SPEC_PATH, text=text))
    _check_unique(files)
    plan = CodePlan(code.delivery, code.mount, script_in_pod, tuple(files))
    if plan.size > CONFIGMAP_LIMIT:
        biggest = max(files, key=lambda f: f.size)
        raise CodeError(
            f"cluster.code: the ConfigMap would hold {plan.size / 2**20:.2f} MiB, over the "
            f"1 MiB Kubernetes limit (largest: {biggest.key}, {biggest.size / 2**20:.2f} MiB); "
            f"put large files on a volume (--code '{{pvc: NAME}}' or --volumes) or in the image")
    return plan


def configmap_data(plan: CodePlan) -> tuple[dict[str, str], dict[str, str]]:
    """(`data`, `binaryData`) of the ConfigMap for `plan`."""
    data = {f.key: f.text for f in plan.files if f.text is not None}
    binary = {f.key: f.binary for f in plan.files if f.binary is not None}
    return data, binary


def _local(base_dir: Path, name: str, label: str, missing: str, kind: str = "file",
           dir_ok: bool = False) -> Path:
    """`name` under `base_dir`, readable (`spec.paths.file_problem`); the error names it
    as the user wrote it."""
    path = Path(name)
    path = path if path.is_absolute() else base_dir / path
    problem = file_problem(path, kind=kind, dir_ok=dir_ok, missing=missing)
    if problem is not None:
        raise CodeError(f"{label}{shown(name)}: {problem}")
    return path


def _walk(path: Path, name: str) -> list[Path]:
    if path.is_file():
        return [path]
    found = sorted(p for p in path.rglob("*")
                   if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(path).parts))
    if not found:
        raise CodeError(f"cluster.code.files: {name}: no files in this directory")
    return found


def _relative(path: Path, root: Path) -> str:
    """Path under the mount: relative to the script's folder when inside it, else its name."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name


def _entry(path: Path, rel: str, mount: str) -> CodeFile:
    key = rel.replace("/", "__")
    if not _KEY.match(key):
        raise CodeError(f"cluster.code.files: {rel}: a ConfigMap key may hold only letters, "
                        f"digits, '-', '_' and '.'; rename the file")
    try:
        raw = path.read_bytes()
    except OSError as exc:  # a file inside a listed folder that this user cannot read
        raise CodeError(f"cluster.code.files: {rel}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > CONFIGMAP_LIMIT:
        raise CodeError(f"cluster.code: {rel} is {len(raw) / 2**20:.2f} MiB, over the 1 MiB "
                        f"ConfigMap limit; put it on a volume (--volumes) or in the image")
    mount_path = posixpath.join(mount, rel)
    try:
        return CodeFile(key, mount_path, text=raw.decode("utf-8"))
    except UnicodeDecodeError:
        return CodeFile(key, mount_path, binary=base64.b64encode(raw).decode("ascii"))


def _check_unique(files: list[CodeFile]) -> None:
    seen: dict[str, str] = {}
    for f in files:
        if f.key in seen or f.mount_path in seen.values():
            raise CodeError(f"cluster.code.files: two files map to {f.mount_path} (key "
                            f"{f.key}); rename one or list it once")
        seen[f.key] = f.mount_path
