"""A fake Kubernetes API server for contract tests of `disttrain.k8s.client`.

It speaks just enough of the REST API (core/v1 pods, services, configmaps, PVCs, events,
pod logs, and the cluster-scoped nodes; batch/v1 jobs; kubeflow.org/v1 pytorchjobs; the
gang kinds: JobSets, TrainJobs, PodGroups and the cluster-scoped ClusterTrainingRuntimes;
pods of all namespaces) for the real `kubernetes` client to
talk to it over HTTP on 127.0.0.1, keeps objects in memory, and records every request
so tests can assert what the client asked for. A test double: never used by the library.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

_PATH = re.compile(
    r"^/(?P<prefix>api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|status))?$")
KINDS = {"pods": "Pod", "services": "Service", "configmaps": "ConfigMap",
         "persistentvolumeclaims": "PersistentVolumeClaim", "jobs": "Job",
         "pytorchjobs": "PyTorchJob", "jobsets": "JobSet", "trainjobs": "TrainJob",
         "podgroups": "PodGroup", "clustertrainingruntimes": "ClusterTrainingRuntime",
         "events": "Event", "nodes": "Node"}
CLUSTER_SCOPED = ("nodes", "clustertrainingruntimes")  # stored under namespace ""


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    headers: dict[str, str]

    @property
    def plural(self) -> str | None:
        m = _PATH.match(self.path)
        return m.group("plural") if m else None


@dataclass
class FakeState:
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    crds: bool = True  # is the PyTorchJob CRD installed?
    absent: set[str] = field(default_factory=set)  # plurals of CRDs not installed
    delete_lingers: int = 0  # GETs that still see an object after DELETE (finalizers)
    _lingering: dict[tuple[str, str, str], int] = field(default_factory=dict)
    version: int = 0

    def put(self, obj: dict[str, Any]) -> None:
        """Seed an object (e.g. a pod the Job controller would have made)."""
        plural = {v: k for k, v in KINDS.items()}[obj["kind"]]
        meta = obj["metadata"]
        ns = "" if plural in CLUSTER_SCOPED else meta.get("namespace", "default")
        self.objects[(plural, ns, meta["name"])] = obj

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method in ("POST", "PUT", "PATCH", "DELETE")]


class _Handler(BaseHTTPRequestHandler):
    state: FakeState
    lock: threading.Lock
    protocol_version = "HTTP/1.1"  # keep-alive and chunked follow-logs, like the real server
    connections: set[socket.socket]

    def setup(self) -> None:
        super().setup()
        self.connections.add(self.connection)

    def finish(self) -> None:
        self.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_chunked(self, pieces: list[str]) -> None:
        """A followed log: one HTTP chunk per line, as the API server streams it."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            data = piece.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "reason": reason, "message": message, "code": code})

    def _handle(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        headers = {k.lower(): v for k, v in self.headers.items()}
        req = Request(self.command, url.path, parse_qs(url.query), body, headers)
        with self.lock:
            self.state.requests.append(req)
            self._route(req)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    def _route(self, req: Request) -> None:
        m = _PATH.match(req.path)
        if not m or m.group("plural") not in KINDS:
            return self._status(404, "NotFound", "the server could not find the requested "
                                                 "resource")
        plural, ns, name, sub = m.group("plural"), m.group("ns"), m.group("name"), m.group("sub")
        if (ns is None) != (plural in CLUSTER_SCOPED) and not (
                plural == "pods" and name is None and req.method == "GET"):
            return self._status(404, "NotFound", f"{plural} is not served at {req.path}")
        ns = ns or ""
        if (plural == "pytorchjobs" and not self.state.crds) or plural in self.state.absent:
            return self._status(404, "NotFound", "the server could not find the requested "
                                                 "resource")
        key = (plural, ns, name or "")
        st = self.state
        if sub == "log":
            if key not in st.objects:
                return self._status(404, "NotFound", f'pods "{name}" not found')
            text = st.logs.get(name or "", "")
            if req.query.get("follow") == ["true"]:
                return self._send_chunked(text.splitlines(keepends=True))
            return self._send(200, text, "text/plain")
        if req.method == "GET" and name is None:
            sel = dict(p.split("=", 1) for p in
                       (req.query.get("labelSelector", [""])[0].split(",")) if "=" in p)
            items = [o for (pl, n, _), o in sorted(st.objects.items())
                     if pl == plural and (n == ns or m.group("ns") is None) and all(
                         (o["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
            return self._send(200, {"kind": KINDS[plural] + "List", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(st.version)},
                                    "items": items})
        if req.method == "GET":
            if key in st._lingering:
                st._lingering[key] -= 1
                if st._lingering[key] <= 0:
                    del st._lingering[key]
                    st.objects.pop(key, None)
            if key not in st.objects:
                return self._status(404, "NotFound", f'{plural} "{name}" not found')
            return self._send(200, st.objects[key])
        if req.method == "POST":
            obj = copy.deepcopy(req.body)
            key = (plural, ns, obj["metadata"]["name"])
            if key in st.objects:
                return self._status(409, "AlreadyExists", f'{plural} "{key[2]}" already exists')
            st.version += 1
            obj["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=str(st.version),
                                   creationTimestamp="2026-01-01T00:00:00Z")
            st.objects[key] = obj
            return self._send(201, obj)
        if req.method == "PUT":
            if key not in st.objects:
                return self._status(404, "NotFound", f'{plural} "{name}" not found')
            have = st.objects[key]["metadata"].get("resourceVersion")
            if req.body["metadata"].get("resourceVersion") != have:
                return self._status(409, "Conflict", "the object has been modified")
            st.version += 1
            obj = copy.deepcopy(req.body)
            obj["metadata"]["resourceVersion"] = str(st.version)
            st.objects[key] = obj
            return self._send(200, obj)
        if req.method == "DELETE":
            if key not in st.objects:
                return self._status(404, "NotFound", f'{plural} "{name}" not found')
            obj = st.objects[key]
            if st.delete_lingers:
                st._lingering[key] = st.delete_lingers
            else:
                del st.objects[key]
            return self._send(200, obj)
        return self._status(405, "MethodNotAllowed", req.method)


class FakeApiServer:
    """`with FakeApiServer() as api:` serves on 127.0.0.1:<free port> until exit."""

    def __init__(self) -> None:
        self.state = FakeState()
        self.connections: set[socket.socket] = set()
        handler = type("Handler", (_Handler,), {"state": self.state, "lock": threading.Lock(),
                                                "connections": self.connections})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": namespace}}],
        }))
        return path

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        for conn in list(self.connections):  # end kept-alive handler threads too
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.httpd.server_close()
        self.thread.join(timeout=5)
