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

A `task: module:function` ships the task's module from the task's folder (`task_dir`):
the file `mytask.py`, or the whole folder of the package the module is in (`pkg.sub:fn`
ships every .py under `pkg/`), plus the local modules they import, found by reading their
imports (`ast`, transitively, only what lies in task_dir). The pod's job.yaml points
task_dir at the code mount, so the worker imports the shipped copy. With the code on a
volume (`cluster.code: {pvc: ...}` / `{host_path: ...}`) nothing is shipped and task_dir
is that mount.

A script gets the same treatment (`follow_imports`, one code path): the modules and
packages in its folder that it imports, transitively (`from datautils import
MyTrainDataset`, `from mingpt.model import GPT`), are shipped beside it, and an import that
is neither shipped, nor the standard library, nor known to be in the image (k8s/install.py,
`image_modules`, and what the official pytorch/pytorch images ship) is named in a warning,
since the pod would die with ModuleNotFoundError. The files it execs or opens by a literal
name beside it (`exec(open("configurator.py").read())`, `open("config.yaml")`) ship too,
and what it saves into its working directory is named: it vanishes with the pod
(k8s/script_files.py).
Every text file ships as a readable block in `data`; one a YAML block cannot hold byte for
byte (CRLF line ends, control characters) ships base64 in `binaryData`, with a note
(docs/cluster.md, "What the ConfigMap ships").
"""

from __future__ import annotations

import base64
import importlib.util
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from disttrain.errors import CodeError
from disttrain.k8s.install import image_modules, official_image_modules
from disttrain.k8s.output import block_safe
from disttrain.k8s.script_files import script_files
from disttrain.pysource import optional_imports, parse_file, top_level_imports
from disttrain.spec.cluster import ClusterSpec
from disttrain.spec.fields import parse_task_reference
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
    why: str = ""  # why it is shipped, for the rendered comment ("the task's module")
    note: str = ""  # for the render's warnings: why a text file ships as binaryData

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
    notes: tuple[str, ...] = ()  # for the render's warnings

    @property
    def needs_configmap(self) -> bool:
        return bool(self.files)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def plan_code(spec: JobSpec, base_dir: Path, spec_text: str | None = None,
              image_imports: bool = True) -> CodePlan:
    """Decide the in-pod script path and the ConfigMap entries for `spec`.

    Args:
        spec: the job.
        base_dir: where relative local paths (script, code.files) are resolved, and the
            task's module when the spec has no task_dir.
        spec_text: the job.yaml shipped to built-in workers (default: `spec.to_yaml()`).
        image_imports: warn about a script's imports the image may lack (not for
            `run-local`, where this machine's Python runs the script).

    Raises:
        CodeError: missing script, task module or file, a name that cannot be a ConfigMap
            key, or a ConfigMap over 1 MiB.
    """
    code = spec.cluster.code
    files: list[CodeFile] = []
    notes: list[str] = []
    script_in_pod: str | None = None
    if code.delivery == "configmap":
        root = base_dir
        if spec.script:
            local = _local(base_dir, spec.script, "script ", kind="script", missing=(
                f"no such file (looked in {base_dir}); give an existing script, or "
                f"--code '{{host_path: DIR}}' if it lives on the nodes"))
            root = local.parent
            script_in_pod = posixpath.join(code.mount, local.name)
            volumes = [v.mount for v in spec.cluster.volumes]
            execs = script_files([(local, local.name)], root, code.mount, volumes).execs
            shipped, outside = follow_imports([(local, "the script"), *execs], root,
                                              strict=False)
            files += [_entry(path, rel, code.mount, why, label="script")
                      for path, (rel, why) in shipped.items()]
            opened = script_files([(p, rel) for p, (rel, _) in shipped.items()], root,
                                  code.mount, volumes)
            files += [_entry(path, _relative(path, root), code.mount, why, label="script")
                      for path, why in opened.reads]
            notes += outside_imports(outside, spec.cluster) if image_imports else []
            notes += [n for n in opened.notes if image_imports or "vanish" not in n]
        if spec.task:
            root = task_folder(spec, base_dir)
            shipped, note = task_sources(spec.task, root)
            files += [_entry(path, rel, code.mount, why, label="task")
                      for path, rel, why in shipped]
            notes += [note] if note else []
        seen = {posixpath.normpath(f.mount_path) for f in files}
        for name in code.files:
            local = _local(base_dir, name, "cluster.code.files: ", dir_ok=True,
                           missing=f"no such file (looked in {base_dir})")
            for path in _walk(local, name):
                rel = _relative(path, root)
                if posixpath.join(code.mount, rel) not in seen:  # already shipped as an import
                    files.append(_entry(path, rel, code.mount, "cluster.code.files"))
    elif spec.script:
        script = PurePosixPath(spec.script)
        script_in_pod = str(script) if script.is_absolute() else posixpath.join(
            code.mount, str(script))
    if not spec.script:
        text = spec.to_yaml() if spec_text is None else spec_text
        files.append(CodeFile(SPEC_KEY, SPEC_PATH, text=text, why="the job spec"))
    _check_unique(files)
    notes += [f.note for f in files if f.note]
    plan = CodePlan(code.delivery, code.mount, script_in_pod, tuple(files), tuple(notes))
    if plan.size > CONFIGMAP_LIMIT:
        biggest = max(files, key=lambda f: f.size)
        fix = ("put large files on a volume (--code '{pvc: NAME}' or --volumes) or in the image"
               if not spec.task else
               f"put the task's code in the image or on a volume the pods mount: --code "
               f"'{{pvc: NAME, mount: {code.mount}}}' or '{{host_path: DIR}}'; then nothing is "
               f"shipped and task_dir is that mount")
        raise CodeError(
            f"cluster.code: the ConfigMap would hold {plan.size / 2**20:.2f} MiB, over the "
            f"1 MiB Kubernetes limit (largest: {biggest.key}, {biggest.size / 2**20:.2f} MiB); "
            f"{fix}")
    return plan


def task_folder(spec: JobSpec, base_dir: Path) -> Path:
    """Where the task's module is read from here: the spec's task_dir (the spec file's
    folder, set by the CLI), else `base_dir`."""
    if not spec.task_dir:
        return base_dir
    folder = Path(spec.task_dir)
    return folder if folder.is_absolute() else base_dir / folder


def task_sources(ref: str, task_dir: Path) -> tuple[list[tuple[Path, str, str]], str | None]:
    """The files a pod needs to import the task `ref`, read from `task_dir`.

    Returns:
        ([(local path, path under the mount, why)], a note or None). The module itself,
        or its package's whole folder, first; then every local module they import,
        transitively. A module that is not in task_dir ships nothing: disttrain's own
        (`disttrain.examples.chargpt:make_task`) is in the image's disttrain; one installed
        here must be in the image too, which the note says.

    Raises:
        CodeError: the module is in neither task_dir nor this Python, or a shipped file
            does not parse (the pod could not import it).
    """
    try:
        module, _ = parse_task_reference(ref)
    except ValueError as exc:
        raise CodeError(f"task {ref!r}: {exc}") from None
    top = module.split(".")[0]
    found = _top_level(task_dir, top)
    if found is None:
        if top == "disttrain":
            return [], None
        where = _installed(top)
        if where is None:
            raise CodeError(
                f"task {ref!r}: no {top}.py or {top}/ in {task_dir} to ship to the pods; put "
                f"{module.replace('.', '/')}.py there (beside the spec file), or put the code on "
                f"a volume: --code '{{pvc: NAME}}' or '{{host_path: DIR}}'")
        return [], (f"task: {top} is not in {task_dir} but installed here ({where}); nothing is "
                    f"shipped, so the image must have it too")
    if found.is_dir() and _module_file(task_dir, module) is None:
        path = module.replace(".", "/")
        raise CodeError(f"task {ref!r}: {top}/ in {task_dir} has no {path}.py or "
                        f"{path}/__init__.py")
    why = f"task {ref}" + (f" (package {top})" if found.is_dir() else "")
    shipped, _ = follow_imports([(p, why) for p in _python_files(found)], task_dir)
    return [(path, rel, reason) for path, (rel, reason) in shipped.items()], None


def follow_imports(start: list[tuple[Path, str]], root: Path, strict: bool = True
                   ) -> tuple[dict[Path, tuple[str, str]], dict[str, str]]:
    """`start` and every module in `root` they import, transitively (one code path for a
    task's module and a script: `from datautils import MyTrainDataset`, `import utils`,
    `from mingpt.model import GPT` ship datautils.py, utils.py and all of mingpt/).

    Args:
        start: (file, why it is shipped), all under `root`.
        root: the folder whose modules count as local (the pod's code mount).
        strict: a file that does not parse is an error (a task's module, which the worker
            imports); else its imports are just not followed (a script: Python decides).

    Returns:
        ({file: (path under root, why)} in shipping order, {top-level name imported from
        outside root: the first file importing it}), leaving out the standard library and
        imports guarded by `try: ... except ImportError` (optional by design).
    """
    shipped: dict[Path, tuple[str, str]] = {}
    outside: dict[str, str] = {}
    queue = list(start)
    while queue:
        path, reason = queue.pop(0)
        if path in shipped:
            continue
        rel = path.relative_to(root).as_posix()
        shipped[path] = (rel, reason)
        names, optional = _imported_names(path, root, strict)
        for name in sorted(names):
            local = _top_level(root, name)
            if local is not None:
                by = (f"package {name}, " if local.is_dir() else "") + f"imported by {rel}"
                queue += [(p, by) for p in _python_files(local) if p not in shipped]
            elif name not in optional and name not in sys.stdlib_module_names:
                outside.setdefault(name, rel)
    return shipped, outside


def outside_imports(outside: dict[str, str], cluster: ClusterSpec) -> list[str]:
    """One warning per imported module that is neither shipped nor known to be in the image
    (`install.image_modules`: torch and what it requires, disttrain and its requirements
    when the image has it; `install.official_image_modules`: what an official
    pytorch/pytorch image ships, torchvision and numpy among them)."""
    if not outside:
        return []
    known = image_modules(bool(cluster.image_has_disttrain or cluster.install_disttrain))
    known |= official_image_modules(cluster.image)   # torchvision, numpy, PIL, yaml, ...
    image = cluster.image or "the image"
    return [f"script: {by} imports {name}, which is not in its folder and not known to be in "
            f"{image}; the pod fails with ModuleNotFoundError unless the image has it (build it "
            f"in), or ship a local copy with --code '{{files: [DIR]}}'"
            for name, by in outside.items() if name not in known]


def _top_level(task_dir: Path, name: str) -> Path | None:
    """What `import name` finds in task_dir, in Python's order: the package `name`/, the
    module `name`.py, then a folder of Python files without __init__ (a namespace package)."""
    file, folder = task_dir / f"{name}.py", task_dir / name
    if (folder / "__init__.py").is_file():
        return folder
    if file.is_file():
        return file
    if folder.is_dir() and any(_python_files(folder)):
        return folder
    return None


def _module_file(task_dir: Path, module: str) -> Path | None:
    base = task_dir.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return base if base.is_dir() and len(module.split(".")) > 1 else None  # a namespace package


def _python_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*.py")
                  if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(path).parts))


def _imported_names(path: Path, task_dir: Path, strict: bool = True) -> tuple[set[str], set[str]]:
    """The top-level names `path` imports absolutely (relative imports stay inside its
    package, which is shipped whole), and those of them imported only under a `try` that
    catches ImportError (or any exception): `disttrain.pysource`, which lint reads too."""
    try:
        tree = parse_file(path)
    except SyntaxError as exc:
        if not strict:
            return set(), set()
        rel = path.relative_to(task_dir).as_posix()
        raise CodeError(f"task: {rel} line {exc.lineno}: {exc.msg}; the pods could not import "
                        f"it") from None
    except (OSError, ValueError) as exc:
        raise CodeError(f"task: cannot read {path}: {exc}") from None
    return top_level_imports(tree), optional_imports(tree)


def _installed(name: str) -> str | None:
    """Where this Python finds the top-level module `name` (nothing is imported), or None."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    return found.origin if found.origin not in (None, "built-in", "frozen") else name


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


def _entry(path: Path, rel: str, mount: str, why: str = "", label: str = "cluster.code.files"
           ) -> CodeFile:
    key = rel.replace("/", "__")
    if not _KEY.match(key):
        raise CodeError(f"{label}: {rel}: a ConfigMap key may hold only letters, "
                        f"digits, '-', '_' and '.'; rename the file")
    try:
        raw = path.read_bytes()
    except OSError as exc:  # a file inside a listed folder that this user cannot read
        raise CodeError(f"{label}: {rel}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > CONFIGMAP_LIMIT:
        raise CodeError(f"cluster.code: {rel} is {len(raw) / 2**20:.2f} MiB, over the 1 MiB "
                        f"ConfigMap limit; put it on a volume (--volumes) or in the image")
    mount_path = posixpath.join(mount, rel)
    binary = base64.b64encode(raw).decode("ascii")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return CodeFile(key, mount_path, binary=binary, why=why)
    if block_safe(text):
        return CodeFile(key, mount_path, text=text, why=why)
    # the pod gets the same bytes either way; only the printed manifest is less readable
    what = "CRLF line ends" if "\r" in text else "control characters or a BOM"
    return CodeFile(key, mount_path, binary=binary, why=why, note=(
        f"{label}: {rel} ships base64 in the ConfigMap's binaryData: it holds {what}, which "
        f"a YAML block cannot hold byte for byte"))


def _check_unique(files: list[CodeFile]) -> None:
    seen: dict[str, str] = {}
    for f in files:
        if f.key in seen or f.mount_path in seen.values():
            raise CodeError(f"cluster.code.files: two files map to {f.mount_path} (key "
                            f"{f.key}); rename one or list it once")
        seen[f.key] = f.mount_path
