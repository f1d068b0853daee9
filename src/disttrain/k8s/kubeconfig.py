"""Which kubeconfig `disttrain k8s` uses when none is named (`find_kubeconfig`).

    find_kubeconfig()               # $KUBECONFIG, ~/.kube/config, then K3s's own file
    find_kubeconfig("ops.yaml")     # that file, or one line naming what is wrong with it

K3s writes its kubeconfig where only root can read it (`K3S_KUBECONFIG`): the error says
how to copy it, rather than the client's own "permission denied" from deep inside.
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain import envvars
from disttrain.errors import KubeError
from disttrain.spec.paths import check_readable_file, file_problem

K3S_KUBECONFIG = "/etc/rancher/k3s/k3s.yaml"


def find_kubeconfig(explicit: str | None = None) -> str:
    """The kubeconfig to use: `explicit`, $KUBECONFIG, ~/.kube/config, then K3s's file."""
    if explicit:
        check_readable_file(explicit, "--kubeconfig ", kind="kubeconfig", error=KubeError)
        return explicit
    env = os.environ.get(envvars.KUBECONFIG)
    if env:
        paths = [p for p in env.split(os.pathsep) if p]
        if any(file_problem(p) is None for p in paths):
            return env
        raise KubeError(f"KUBECONFIG={env}: no such file")
    for candidate in (Path.home() / ".kube" / "config", Path(K3S_KUBECONFIG)):
        if candidate.is_file():
            if not os.access(candidate, os.R_OK):
                raise KubeError(f"{candidate} is not readable; on a K3s server run as root "
                                f"or copy it: sudo cp {candidate} ~/.kube/config && "
                                f"sudo chown $USER ~/.kube/config")
            return str(candidate)
    raise KubeError("no kubeconfig found: set KUBECONFIG, create ~/.kube/config, or on a "
                    f"K3s server use {K3S_KUBECONFIG}; pass --kubeconfig PATH")
