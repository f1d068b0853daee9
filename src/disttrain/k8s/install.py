"""Installing disttrain into the pod at start (`cluster.install_disttrain`), keeping the
image's torch.

    install_command(spec.cluster, argv)
    # ['sh', '-c', "python -c '...' > /tmp/disttrain-constraints.txt && python -m pip install
    #   --no-cache-dir -c /tmp/disttrain-constraints.txt disttrain==0.1.0 && exec torchrun ..."]

A pod must train on the image's torch: the CUDA build that matches the node's driver.
A plain `pip install disttrain` may replace it (gigabytes from the mirror, and a build that
may not match the driver) whenever disttrain's `torch>=` floor or a dependency asks for
another version. So the pod first writes what pip sees installed, torch (and numpy, which
torch's extensions are built against), as pip constraints: pip then keeps them, or fails
with the conflict named, instead of changing them.
"""

from __future__ import annotations

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


def install_command(c: ClusterSpec, argv: list[str]) -> list[str]:
    """`argv` behind the pip install of `c.install_disttrain`, the image's torch pinned."""
    if not c.install_disttrain:
        return argv
    pins = ["python", "-c", PIN_SCRIPT]
    pip = ["python", "-m", "pip", "install", "--no-cache-dir", "-c", PINS]
    if c.pip_index_url:
        pip += ["--index-url", c.pip_index_url]
        url = urlparse(c.pip_index_url)
        if url.scheme == "http" and url.hostname:
            pip += ["--trusted-host", url.hostname]  # a plain-HTTP mirror, as in the guide
    pip.append(c.install_disttrain)
    return ["sh", "-c", f"{shlex.join(pins)} > {PINS} && {shlex.join(pip)} && "
                        f"exec {shlex.join(argv)}"]
