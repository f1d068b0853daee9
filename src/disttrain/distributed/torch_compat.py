"""Which torch a job needs: one table, read by the worker at start and by `k8s render`.

    torch_needs(spec)                    # [Need('fsdp', (2, 3), 'checkpoints of a sharded model ...')]
    check_torch(spec, "2.1.0")           # raises TorchVersionError naming what needs newer
    image_torch("pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime")   # (2, 1, 0)

A pod runs the image's torch (docs/cluster.md, "The image's torch"): installing disttrain
there pins it, so a job that needs a newer torch than the image has must say so, naming
the feature, instead of failing deep inside torch with an ImportError or a TypeError.
Everything not in the table works on the oldest torch (`TORCH_MIN`, pyproject.toml's
floor); where a newer API exists only for speed, the code picks it at run time (FSDP2
below), and the table says what an older torch gets instead.

Torch-free: `k8s render` uses it without importing torch; `running_torch()` imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disttrain.errors import TorchVersionError
from disttrain.spec.job import JobSpec

Version = tuple[int, ...]

TORCH_MIN: Version = (2, 1)  # pyproject.toml's `torch>=2.1`: what disttrain imports on


@dataclass(frozen=True)
class Feature:
    """A part of disttrain that needs a newer torch than `TORCH_MIN`, and why."""

    what: str        # how the job asks for it, as the user wrote it
    minimum: Version
    because: str     # the torch API it needs


# Read from torch's own sources of each release (2.1, 2.2, 2.3): where an API appeared.
FEATURES: dict[str, Feature] = {
    "fsdp": Feature("strategy fsdp", (2, 2),
                    "torch.distributed.device_mesh and torch.distributed.checkpoint.state_dict"),
    "fsdp_checkpoints": Feature("strategy fsdp with checkpoints", (2, 3),
                                "torch.distributed.checkpoint.save/load(checkpoint_id=...)"),
    "fsdp_fp16": Feature("strategy fsdp with precision fp16", (2, 3),
                         "ShardedGradScaler(device)"),
    "launcher": Feature("disttrain's local launcher (run, verify, bench)", (2, 3),
                        "torch.distributed.launcher LaunchConfig(logs_specs=...)"),
}
# Not a requirement: below it FSDP1 (FullyShardedDataParallel) shards the model instead.
FSDP2_MIN: Version = (2, 4)


@dataclass(frozen=True)
class Need:
    """One thing a job needs from torch."""

    key: str
    minimum: Version
    what: str          # "strategy fsdp with checkpoints"
    because: str = ""  # the torch API it needs

    def text(self) -> str:
        return f"{self.what} needs torch >= {show(self.minimum)}" + (
            f" ({self.because})" if self.because else "")


def _need(key: str) -> Need:
    feature = FEATURES[key]
    return Need(key, feature.minimum, feature.what, feature.because)


def parse_version(text: str) -> Version | None:
    """'2.1.0+cu121' -> (2, 1, 0); '2.5.0a0+git1234' -> (2, 5, 0); not a version -> None."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def show(version: Version) -> str:
    return ".".join(str(v) for v in version)


def torch_needs(spec: JobSpec) -> list[Need]:
    """What `spec` needs from torch beyond disttrain's own floor, or [] for a user script
    (it runs under torchrun with whatever torch it was written for)."""
    if spec.script:
        return []
    cfg, out = spec.train, []
    if cfg.strategy == "fsdp":
        out.append(_need("fsdp"))
        # A pod with restarts resumes from its checkpoints (k8s.render turns resume on).
        if (cfg.checkpoint_every_epochs or cfg.checkpoint_every_steps or cfg.resume
                or spec.launch.max_restarts):
            out.append(_need("fsdp_checkpoints"))
        if cfg.precision == "fp16":
            out.append(_need("fsdp_fp16"))
    return out


def minimum_torch(spec: JobSpec) -> tuple[Version, Need | None]:
    """The oldest torch that runs `spec`, and the need that sets it (None: disttrain's floor)."""
    needs = torch_needs(spec)
    top = max(needs, key=lambda n: n.minimum, default=None)
    if top is None or top.minimum <= TORCH_MIN:
        return TORCH_MIN, None
    return top.minimum, top


def check_torch(spec: JobSpec, version: str, source: str = "this process") -> None:
    """Refuse `spec` on torch `version` when a feature it uses needs a newer one.

    Args:
        spec: the job.
        version: torch's version text (`torch.__version__`, or the image tag's).
        source: who has that torch, for the message ("this process", "image X").

    Raises:
        TorchVersionError: one line naming every feature that needs a newer torch, and
            the fix (another image, or the setting to change).
    """
    have = parse_version(version)
    if have is None:
        return
    floor = Need("disttrain", TORCH_MIN, "disttrain")
    missing = [n for n in [floor, *torch_needs(spec)] if have[:len(n.minimum)] < n.minimum]
    if not missing:
        return
    need = max(n.minimum for n in missing)
    what = "; ".join(n.text() for n in missing)
    fix = f"use an image with torch >= {show(need)}"
    if missing != [floor] and spec.train.strategy == "fsdp":
        fix += " or --strategy ddp"
        if any(n.key == "fsdp_checkpoints" for n in missing) and have >= FEATURES["fsdp"].minimum:
            fix += " (or fsdp without checkpoints: --checkpoint-every-epochs 0)"
    raise TorchVersionError(f"{what} ({source} has torch {version}); {fix}")


def require(key: str) -> None:
    """Raise TorchVersionError when the running torch is older than `FEATURES[key]`."""
    feature, version = FEATURES[key], running_torch()
    have = parse_version(version)
    if have is not None and have[:len(feature.minimum)] < feature.minimum:
        raise TorchVersionError(f"{feature.what} needs torch >= {show(feature.minimum)} "
                                f"({feature.because}); this torch is {version}")


def at_least(*minimum: int) -> bool:
    """Whether the running torch is `minimum` or newer (e.g. `at_least(2, 3)`)."""
    have = parse_version(running_torch())
    return have is None or have[:len(minimum)] >= minimum


def running_torch() -> str:
    import torch

    return str(torch.__version__)


# -- image tags ----------------------------------------------------------------------------
# The official images and their mirrors: <registry>/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime.
# Other images (NGC's pytorch:24.01-py3 is a date, a team's train:1 says nothing) are unknown.
_TAG_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:$|[-_+])")


def image_torch(image: str) -> Version | None:
    """The torch version an image's tag names, or None when it names none we can trust."""
    if "@" in image:
        return None  # a digest says nothing about what is inside
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return None  # no tag (the colon was a registry port)
    repo = name.rsplit("/", 1)[-1]
    m = _TAG_VERSION.match(tag)
    if repo != "pytorch" or not m or m.group(1) not in ("1", "2"):
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def image_note(spec: JobSpec, image: str) -> str:
    """What the image's tag says about its torch, checked against `spec` (render's note).

    Raises:
        TorchVersionError: the tag names a torch that cannot run `spec`.
    """
    version = image_torch(image)
    if version is None:
        return "its tag names no torch version, so the worker checks it at start"
    check_torch(spec, show(version), source=f"image {image}")
    return f"its tag names torch {show(version)}"
