"""Fixtures for the Kubernetes tests: schema validation, a fake API server, CLI runs; at
the session's end, the network namespaces that killed run-local runs left (`sweep_namespaces`)."""

from __future__ import annotations

import copy
import functools
import gzip
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_fake_apiserver import FakeApiServer

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
CRD_FILE = HERE / "data" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
# Oldest and newest schemas kubernetes-validate 1.37 ships, and a K3s release in between.
K8S_VERSIONS = ("1.27", "1.31", "1.37")

# The guide's §3.2 values, as flags (its script is train.py in /opt/training-code).
GUIDE_IMAGE = "117.50.188.237:30000/pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime"
GUIDE_FLAGS = [
    "train.py", "--name", "pytorch-training", "--kind", "pod", "--image", GUIDE_IMAGE,
    "--node-selector", '{kubernetes.io/hostname: "10-60-18-8"}',
    "--nproc-per-node", "2", "--gpus", "2", "--gpumem", "12k", "--master-port", "12355",
    "--cpu", '{request: "2", limit: "8"}', "--memory", "{request: 8Gi, limit: 16Gi}",
    "--code", "{host_path: /opt/training-code, mount: /workspace}",
    "--volumes", "[{name: models, pvc: nfs-modelscope, mount: /models, read_only: true},"
                 " {name: data, pvc: nfs-training-data, mount: /data}]",
    "--env", '{HF_ENDPOINT: "https://hf-mirror.com"}', "--nccl-preset", "debug",
]


def _load_yaml(data: bytes) -> Any:
    """A CRD file (hundreds of KiB): libyaml's loader when PyYAML has it (~10x faster)."""
    return yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _crd_schema() -> dict[str, Any]:
    crd = _load_yaml(CRD_FILE.read_bytes())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as kubernetes-validate's strict mode does (the API server
    would silently prune them): every object schema with properties gets
    additionalProperties: false unless it preserves unknown fields."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for item in schema:
            _strict(item)
    return schema


# The gang-safe kinds' CRDs (data/SOURCE.md): kind -> (file, served version)
GANG_CRDS = {"JobSet": ("jobset.x-k8s.io_jobsets-v0.12.0.yaml.gz", "v1alpha2"),
             "PodGroup": ("scheduling.x-k8s.io_podgroups-v0.34.7.yaml.gz", "v1alpha1"),
             "TrainJob": ("trainer.kubeflow.org_trainjobs-v2.3.0.yaml.gz", "v1alpha1"),
             "ClusterTrainingRuntime": (
                 "trainer.kubeflow.org_clustertrainingruntimes-v2.3.0.yaml.gz", "v1alpha1")}


@functools.cache
def gang_crd_schema(kind: str) -> dict[str, Any]:
    file, served = GANG_CRDS[kind]
    crd = _load_yaml(gzip.decompress((HERE / "data" / "gang" / file).read_bytes()))
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == served)
    return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


@functools.cache
def _gang_validator(kind: str) -> Any:
    """One validator per CRD: `jsonschema.validate` would check the (large) schema itself
    again at every call."""
    schema = gang_crd_schema(kind)
    return jsonschema.validators.validator_for(schema)(schema)


def _validate_job_template(template: dict[str, Any]) -> None:
    """A JobSet's replicated Job as a core Job (its pod template included)."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"},
           "spec": template["spec"]}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


def validate_object(obj: dict[str, Any]) -> None:
    """Official schemas (strict) for core kinds; the CRD schema for PyTorchJob, whose pod
    templates are also checked against the core PodTemplate schema; the pinned gang CRDs
    for PodGroup, JobSet, TrainJob and ClusterTrainingRuntime (the Jobs inside as core Jobs)."""
    if obj["kind"] in GANG_CRDS:
        _gang_validator(obj["kind"]).validate(obj)
        if obj["kind"] == "JobSet":
            for rjob in obj["spec"]["replicatedJobs"]:
                _validate_job_template(rjob["template"])
        if obj["kind"] == "ClusterTrainingRuntime":
            for rjob in obj["spec"]["template"]["spec"]["replicatedJobs"]:
                _validate_job_template(rjob["template"])
        return
    if obj["kind"] == "PyTorchJob":
        jsonschema.validate(obj, _crd_schema())
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "t"}, "template": replica["template"]}
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(template, version, strict=True)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def validate_all(objects: list[dict[str, Any]]) -> None:
    assert objects
    for obj in objects:
        validate_object(obj)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """Run `disttrain ...` in-process; returns exit code, stdout, stderr."""
    from disttrain.cli.main import main

    def run(*argv: str) -> CliResult:
        code = main(list(argv))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary current directory holding a small train.py."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import torch\nprint('training')\n")
    return tmp_path


@pytest.fixture
def fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    """A fake API server on 127.0.0.1, made the default cluster through KUBECONFIG."""
    with FakeApiServer() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        yield api


def sweep_namespaces() -> list[str]:
    """`netns.sweep_stale` where namespaces can be made (root, `ip`): the `dt<pid>-*`
    namespaces and /etc/netns folders of runs whose process is gone (a test killed by its
    timeout, a SIGKILLed run-local); a live run's are kept. Returns the names removed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    from disttrain.k8s.netns import sweep_stale

    return sweep_stale()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Sweep at the end of every session that loaded these tests (each xdist worker too:
    only dead owners' namespaces go, so a worker still running keeps its own)."""
    sweep_namespaces()
