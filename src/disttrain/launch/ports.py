"""One bind test for "is this TCP port taken?", shared by the launcher and the doctor.

A leaf module (stdlib only) so `disttrain doctor` answers without importing torch.
"""

from __future__ import annotations

import errno
import socket


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` right now (as TCPStore would bind it).

    Raises:
        OSError: other bind errors, e.g. EADDRNOTAVAIL for an address this host lacks.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True
