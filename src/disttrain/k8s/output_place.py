"""Is the trained model's folder (`train.output_dir`) somewhere that outlives the pod?

    note = output_dir_warning(spec, workdir="/workspace")   # None when it is on a volume

A pod's emptyDir (the workspace the shipped code runs in) and its container filesystem are
deleted with the pod; the code ConfigMap's mounts are read-only. A fine-tuned model written
there is gone when the Job is cleaned up, however long it trained. Only a writable volume
(a PVC, or a hostPath on a node) keeps it; `k8s render` says so before anything is applied.
"""

from __future__ import annotations

import posixpath

from disttrain.spec.job import JobSpec


def _under(path: str, mount: str) -> bool:
    return posixpath.commonpath([path, mount]) == posixpath.normpath(mount)


def output_dir_warning(spec: JobSpec, workdir: str | None) -> str | None:
    """Why `train.output_dir` would be lost (or cannot be written) in the pod, or None."""
    out = spec.train.output_dir
    if not out or spec.script:
        return None
    c = spec.cluster
    path = posixpath.normpath(posixpath.join(workdir, out) if workdir and not posixpath.isabs(out)
                              else out)
    fix = (" put it on a volume: --volumes '[{name: output, pvc: NAME, mount: /output}]' "
           f"--output-dir /output/{spec.name}")
    if not posixpath.isabs(path):
        return (f"train.output_dir: {out} is relative to the image's working directory, on the "
                f"pod's own filesystem, deleted with the pod;" + fix)
    for vol in sorted(c.volumes, key=lambda v: -len(v.mount)):   # the innermost mount decides
        if _under(path, vol.mount):
            if vol.read_only:
                return (f"train.output_dir: {path} is on the read-only volume {vol.name} "
                        f"({vol.mount}); the model cannot be written there;" + fix)
            return None
    if c.code.delivery == "pvc" and _under(path, c.code.mount):
        return None
    if _under(path, c.code.mount):
        where = ("the pod's emptyDir workspace (and the code ConfigMap's read-only files)"
                 if c.code.delivery == "configmap" else f"the code volume ({c.code.delivery})")
        if c.code.delivery == "host_path":
            return None
        return f"train.output_dir: {path} is in {where}, deleted with the pod;" + fix
    return (f"train.output_dir: {path} is on the pod's own filesystem (no volume is mounted "
            f"there), deleted with the pod;" + fix)
