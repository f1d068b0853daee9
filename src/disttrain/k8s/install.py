"""Installing disttrain into the pod at start (`cluster.install_disttrain`), keeping the
image's torch.

    install_setup(spec.cluster)
    # "python -c '...' > /tmp/disttrain-constraints.txt && python -m pip install
    #   --no-cache-dir -c /tmp/disttrain-constraints.txt disttrain==0.1.0 || exit $?\n"

The line runs before torchrun in the pod's shell PID 1 (k8s/stopping.py), which a failed
install ends with pip's status.

A pod must train on the image's torch: the CUDA build that matches the node's driver.
A plain `pip install disttrain` may replace it (gigabytes from the mirror, and a build that
may not match the driver) whenever disttrain's `torch>=` floor or a dependency asks for
another version. So the pod first writes what pip sees installed, torch (and numpy, which
torch's extensions are built against), as pip constraints: pip then keeps them, or fails
with the conflict named, instead of changing them.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import re
import shlex
from urllib.parse import urlparse

from disttrain.spec.cluster import ClusterSpec

PINS = "/tmp/disttrain-constraints.txt"
# Run by the image's python before pip. Double quotes only (the shell command wraps it in
# single quotes), and no ": " (the rendered command then stays a plain, readable YAML
# line). No torch visible to pip (metadata missing) is refused: pip would bring one.
PIN_SCRIPT = (
    'import importlib.metadata as m, sys; '
    'v = dict(((d.metadata["Name"] or "").lower(), d.version) for d in m.distributions()); '
    '"torch" in v or sys.exit("disttrain needs the image torch, and pip sees none in this '
    'image; use an image whose torch pip lists"); '
    'print("".join(f"{n}=={v[n]}\\n" for n in ("torch", "numpy") if n in v), end="")')


def install_setup(c: ClusterSpec) -> str:
    """The shell line that pip-installs `c.install_disttrain`, the image's torch pinned;
    empty when nothing is installed."""
    if not c.install_disttrain:
        return ""
    pins = ["python", "-c", PIN_SCRIPT]
    pip = ["python", "-m", "pip", "install", "--no-cache-dir", "-c", PINS]
    if c.pip_index_url:
        pip += ["--index-url", c.pip_index_url]
        url = urlparse(c.pip_index_url)
        if url.scheme == "http" and url.hostname:
            pip += ["--trusted-host", url.hostname]  # a plain-HTTP mirror, as in the guide
    pip.append(c.install_disttrain)
    return f"{shlex.join(pins)} > {PINS} && {shlex.join(pip)} || exit $?\n"


# What an image is known to hold, as distributions: the image's torch (every pod needs it)
# with what torch requires, and, when the image has disttrain (built in or installed at
# start), disttrain with what it requires. Anything else (torchvision, hydra, boto3) may or
# may not be there: nothing here can know, so render warns about it.
IMAGE_HAS = ("torch",)
WITH_DISTTRAIN = ("disttrain",)
# What the official pytorch/pytorch images (and registry mirrors of them: the guide's
# <registry>/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime) ship, as top-level modules,
# read from pytorch/pytorch's Dockerfile: its `official` stage copies the conda tree that
# installs python with `cmake conda-build pyyaml numpy ipython`, `pip install -r
# requirements.txt` (pytorch's own: astunparse, expecttest, hypothesis, numpy, psutil,
# pyyaml, requests, setuptools, typing-extensions, sympy, filelock, networkx, jinja2,
# fsspec), `torch torchvision torchaudio`, and `pip install torchelastic`; with what those
# bring (pillow for torchvision, requests' and jinja2's, IPython's, sympy's mpmath).
OFFICIAL_PYTORCH_MODULES = frozenset({
    "torch", "torchvision", "torchaudio", "torchelastic", "numpy", "yaml", "IPython",
    "conda", "conda_build", "astunparse", "expecttest", "hypothesis", "psutil", "requests",
    "setuptools", "pkg_resources", "typing_extensions", "sympy", "mpmath", "filelock",
    "networkx", "jinja2", "markupsafe", "fsspec", "PIL", "urllib3", "idna", "certifi",
    "charset_normalizer", "pygments", "traitlets", "attr", "attrs", "sortedcontainers"})


def official_image_modules(image: str | None) -> frozenset[str]:
    """The modules an official pytorch/pytorch image (or a mirror of it: any registry, the
    repository path ending in pytorch/pytorch) is known to ship; empty for other images."""
    name = (image or "").split("@")[0]   # a digest
    repo, colon, tag = name.rpartition(":")
    if colon and "/" not in tag:   # a tag, not a registry's port
        name = repo
    official = name == "pytorch/pytorch" or name.endswith("/pytorch/pytorch")
    return OFFICIAL_PYTORCH_MODULES if official else frozenset()
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@functools.cache
def image_modules(has_disttrain: bool) -> frozenset[str]:
    """Top-level modules the pod's image is known to have (read from this machine's package
    metadata: torch's requirements at this torch version, disttrain's declared ones)."""
    dists = _closure(IMAGE_HAS + (WITH_DISTTRAIN if has_disttrain else ()))
    modules = {name.replace("-", "_") for name in dists}
    for module, owners in metadata.packages_distributions().items():
        if any(_canonical(d) in dists for d in owners):
            modules.add(module)
    return frozenset(modules | ({"disttrain"} if has_disttrain else set()))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: tuple[str, ...]) -> set[str]:
    """The distributions `roots` need, transitively (extras left out), as installed here."""
    seen: set[str] = set()
    queue = [_canonical(r) for r in roots]
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            match = _NAME.match(req)
            if match and "extra ==" not in req.replace("extra==", "extra =="):
                queue.append(_canonical(match.group(1)))
    return seen
