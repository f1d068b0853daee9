"""Signatures of the network side of a job: the master port, the rendezvous, NCCL/gloo links.

Each pattern is the wording of the code that prints it, in every release where it changed
(where the sources show it; see docs/troubleshooting.md for the table of eras):

- TCPStore: torch 1.0-1.10 `connect() timed out.` (c10d Utils.cpp) and `Socket Timeout`;
  torch 1.11-2.3 `The client socket has timed out after ... while trying to connect to
  (HOST, PORT)` / `has failed to connect to any network address of (HOST, PORT)`; torch
  2.4+ `TCP client failed to connect/validate to host HOST:PORT - timed out`; the master
  side `Timed out after N seconds waiting for clients. 1/2 clients joined.`;
- the store-based barrier after init_process_group: torch 1.x `(world_size=8,
  worker_count=1, ...)`, 2.0-2.2 `num_workers_joined=1`, 2.3+ the same with `error=...`;
- gloo pair connects while a group forms: `connect [ADDR]:PORT: Connection refused`
  (pair.cc, 2017-2022), `Connect timeout [ADDR]`, torch's `Gloo connectFullMesh failed`;
- NCCL socket connects: 2.4-2.11 `Connect to ADDR failed :`, 2.12 `Net : Connect to`,
  2.13+ `socketStartConnect: Connect to`, 2.2x `socketPollConnect to ADDR failed`;
- port in use: `Address already in use` (Linux, every era), EADDRINUSE (torch 2.2+),
  Windows' WSAEADDRINUSE (`system error: 10048 - Only one usage of each socket address`).
"""

from __future__ import annotations

from disttrain.diagnose.log_causes import IFNAME_FIX, NCCL_LINE, PEER_LOST_FIX, PEER_LOST_TITLE
from disttrain.diagnose.log_signature import CONSEQUENCE, LIKELY, RANK, ROOT, Signature, sig

_STORE_TITLE = "could not connect to the master's store at {addr}:{port}"
_BARRIER_FIX = (
    "WORLD_SIZE (--nnodes x --nproc-per-node) must equal the number of processes that "
    "actually start and join: check every node's torchrun arguments, that every pod was "
    "scheduled (`kubectl get pods`), and that no other job uses the same MASTER_ADDR:"
    "MASTER_PORT (more processes joining than WORLD_SIZE means two jobs share one store).")
_GLOO_CONNECT_TITLE = ("gloo could not connect to another rank while the process group formed "
                       "({addr})")
_GLOO_CONNECT_FIX = (
    "The ranks met at the store but could not open gloo connections to each other: every "
    "rank must reach every other rank's address on any port (no firewall or NetworkPolicy "
    "between pods), each rank must advertise a reachable address (set GLOO_SOCKET_IFNAME "
    "to the interface carrying the pod/node IP, e.g. eth0), and every rank must have "
    "started: a rank that never came up (world size larger than the processes started) "
    "looks the same.")

PORT_RULES: tuple[Signature, ...] = (
    sig("port_in_use", ROOT,
        r"server socket has failed to listen on any local network address"
        r"(?:.*?port: (?P<port>\d+))?",
        exclude=r"ignoring the error"),
    sig("port_in_use", ROOT,
        r"Only one usage of each socket address|system error: 10048\b|WSAEADDRINUSE",
        title="the master port is already in use (Windows: WSAEADDRINUSE)"),
    # NCCL's own "bind failed" chatter is retried and harmless; so is the store's bind
    # warning when torchrun's agent store is used instead
    sig("port_in_use", ROOT, r"EADDRINUSE|Address already in use|address already in use",
        exclude=NCCL_LINE + r"|ignoring the error"),
)

NETWORK_RULES: tuple[Signature, ...] = (
    # torch 2.4+ store connects: before the peer-lost rule, which their tail would match
    sig("rendezvous_failure", LIKELY,
        r"TCP client failed to connect/validate to host (?P<addr>[^\s:]+):(?P<port>\d+)",
        title=_STORE_TITLE, exclude=r" - retrying \("),
    # a retry is normal while the master starts; it is evidence only when nothing stronger
    # shows (a job that hung retrying and was killed)
    sig("rendezvous_failure", RANK,
        r"TCP client failed to connect/validate to host (?P<addr>[^\s:]+):(?P<port>\d+) - "
        r"retrying", title=_STORE_TITLE),
    # -- nccl_network_error ----------------------------------------------------------------
    sig("nccl_network_error", LIKELY, r"Unable to find address for: (?P<ifname>\S+)",
        title="GLOO_SOCKET_IFNAME names an interface that does not exist here ({ifname})",
        fix=IFNAME_FIX.format(var="GLOO_SOCKET_IFNAME")),
    sig("nccl_network_error", LIKELY,
        r"Bootstrap : no socket interface found|no NCCL_SOCKET_IFNAME interface found|"
        r"ncclSocketInit: connecting to address .*is neither AF_INET",
        title="NCCL found no usable network interface (check NCCL_SOCKET_IFNAME)",
        fix=IFNAME_FIX.format(var="NCCL_SOCKET_IFNAME")),
    sig("nccl_network_error", LIKELY,
        r"socketStartConnect: Connect to (?P<addr>\S+) failed|WARN Call to connect failed|"
        r"socketPollConnect|Net : Connect to (?P<addr2>\S+) failed|"
        r"NCCL WARN Connect to (?P<addr3>\S+) failed",
        title="NCCL could not connect to another rank ({addr})"),
    sig("nccl_network_error", LIKELY, r"NET/IB : Got completion from peer .* with error",
        title="InfiniBand transport error between ranks",
        fix="Check the IB fabric (`ibstat`, NCCL_IB_HCA), or fall back to TCP sockets with "
            "NCCL_IB_DISABLE=1."),
    sig("nccl_network_error", RANK, r"unhandled system error|ncclSystemError",
        exclude=r"shared memory"),
    sig("nccl_network_error", CONSEQUENCE,
        r"ncclRemoteError|remote process exiting prematurely|Connection closed by (?:remote )?"
        r"peer|Connection reset by peer|connection reset by peer|failed : Broken pipe|"
        r"Failed to recv, got 0 bytes|Connection was likely closed",
        PEER_LOST_TITLE, PEER_LOST_FIX),
    # -- rendezvous_failure ----------------------------------------------------------------
    sig("rendezvous_failure", LIKELY,
        r"gai error: -?\d+ - |socket\.gaierror|Temporary failure in name resolution|"
        r"Name or service not known|nodename nor servname provided",
        title="a host name (MASTER_ADDR or the rendezvous endpoint) does not resolve",
        exclude=r"urlopen|URLError|HTTPS?Connection|Max retries|https?://"),  # downloads
    sig("rendezvous_failure", LIKELY,
        r"client socket has timed out after \S+ while trying to connect to \((?P<addr>[^,]+), "
        r"(?P<port>\d+)\)|client socket has failed to connect to (?:any network address of )?"
        r"[(\[]?(?P<addr2>[^,)\]\s]+)(?:\]:|, )?(?P<port2>\d+)?",
        title=_STORE_TITLE),
    sig("rendezvous_failure", LIKELY,
        r"connect\(\) timed out|waiting for processes to connect has timed out|"
        r"Stop_waiting response is expected",
        title="could not connect to the master's store (MASTER_ADDR:MASTER_PORT) in time"),
    sig("rendezvous_failure", LIKELY,
        r"Timed out initializing process group in store based ?barrier on rank:? "
        r"(?P<hit_rank>\d+), for key: \S+ \(world_size=(?P<expected>\d+), "
        r"(?:worker_count|num_workers_joined)=(?P<joined>\d+)",
        title="the process group's store-based barrier counted {joined} processes for a world "
              "size of {expected}",
        fix=_BARRIER_FIX),
    sig("rendezvous_failure", LIKELY,
        r"waiting for clients\. (?P<joined>\d+)/(?P<expected>\d+) clients joined",
        title="only {joined} of {expected} processes joined (world size mismatch or a "
              "worker never started)",
        fix=_BARRIER_FIX),
    sig("rendezvous_failure", LIKELY,
        r"environment variable (?P<var>[A-Z_]+) expected, but not set",
        title="the rendezvous environment is incomplete ({var} is not set)",
        fix="Launch with torchrun (or `disttrain run`), which sets MASTER_ADDR, MASTER_PORT, "
            "RANK and WORLD_SIZE; an mp.spawn script must set MASTER_ADDR and MASTER_PORT "
            "itself before spawning (or pass init_method='tcp://HOST:PORT')."),
    sig("rendezvous_failure", LIKELY,
        r"Gloo connectFullMesh failed|\] connect \[(?P<addr>[^\]]*)\]:\d+: (?:Connection "
        r"refused|Connection timed out|No route to host)|\] Connect timeout \[(?P<addr2>[^\]]*)",
        title=_GLOO_CONNECT_TITLE, fix=_GLOO_CONNECT_FIX),
    sig("rendezvous_failure", LIKELY, r"RendezvousTimeoutError|RendezvousConnectionError|"
        r"Socket Timeout\b|RuntimeError: Wait timeout|DistStoreError: Wait timeout|"
        r"The connection to the C10d store has failed"),
    sig("rendezvous_failure", CONSEQUENCE, r"RendezvousClosedError",
        title="the rendezvous was closed (another node failed, or the job is shutting down)"),
    # -- collective_timeout ----------------------------------------------------------------
    # disttrain's own stall watchdog (disttrain.resilience.watchdog) names the rank that
    # stopped (`subject_rank`: the rank the line is about, whichever rank printed it): it
    # is the root cause of the timeouts and "connection closed" errors the others print.
    # The same watchdog when a whole host went silent (a partition or a lost node): the
    # host is named (`subject_host`), not the rank's pod that printed the line.
    sig("collective_timeout", ROOT,
        r"rank (?P<subject_rank>\d+) \(pid \d+, host (?P<subject_host>[^)\s]+)\) made no "
        r"progress for (?P<secs>[\d.]+) ?s; last seen: (?P<where>[^;\n]+); nothing arrives "
        r"from host",
        title="host {subject_host} unreachable: nothing from rank {subject_rank} for {secs} s "
              "(last seen: {where})",
        fix="The ranks on that host stopped reaching the others: a network partition (a "
            "link, switch or NetworkPolicy), a lost node, or a stopped process there. Check "
            "the node (`kubectl get nodes`, `disttrain k8s status`) and the network between "
            "the pods; with --max-restarts the job resumes from its last checkpoint once the "
            "host is back. --timeout-s sets how long a silent host is waited for."),
    sig("collective_timeout", ROOT,
        r"ranks? (?P<subject_rank>\d+)(?:,[\d, ]+)? \(pids? [\d, ]+?(?:, host "
        r"(?P<subject_host>[^)\s]+))?\) made no progress for "
        r"(?P<secs>[\d.]+) ?s; last seen: (?P<where>[^;\n]+)",
        title="rank {subject_rank} stalled: no progress for {secs} s (last seen: {where})",
        fix="That rank stopped making progress (SIGSTOPped, deadlocked, stuck in I/O, or "
            "waiting in a collective the others never entered). `py-spy dump --pid PID` "
            "shows where it is; check what it does at the last-seen step and phase (rank-0-"
            "only work without a barrier, uneven data, a hung filesystem). --timeout-s sets "
            "how long a rank may stall before the job is ended."),
    sig("collective_timeout", CONSEQUENCE,
        r"Watchdog caught collective operation timeout(?:: WorkNCCL\(.*?OpType=(?P<op>\w+))?"),
    sig("collective_timeout", CONSEQUENCE,
        r"Timed out waiting \d+ms for (?:recv|send) operation|Some NCCL operations have "
        r"failed or timed out|watchdog got stuck for \d+ seconds|timed out in "
        r"monitoredBarrier|failed to pass monitoredBarrier|NCCL timeout|"
        r"\] Read timeout \[|\] Write timeout \["),
)
