"""Every TCP socket probe disttrain makes: is a port free, pick a free one, does anyone listen.

    port_free(29500)                 # False while another job's TCPStore holds it
    free_port()                      # a port the OS just handed out on 127.0.0.1
    listening("127.0.0.1", 29500)    # True once the job's store accepts connections

A leaf module (stdlib only) so `disttrain doctor` and the rank-side heartbeat can ask
without importing torch; the launcher, the watchdog, the heartbeat, the doctor and
`disttrain.testing` all ask here, so "free" and "listening" mean one thing everywhere.
"""

from __future__ import annotations

import errno
import socket

# A store on this machine or the next one answers well within this; a missing one is
# then reported as "not listening" instead of holding the caller up.
CONNECT_TIMEOUT_S = 1.0


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago (the OS picks it: bind to port 0).

    Another process may take it before the caller binds it; the launcher picks again
    when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """True when something accepts TCP connections at host:port.

    Asked before a TCPStore client is made: a client that cannot connect retries and
    prints C++ stack traces, which must not land in the user's log.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
