"""JobSpec -> Kubernetes objects, as a pure function (no cluster, no `kubernetes` import).

    rendered = render(spec, base_dir=Path("."))
    print(to_yaml(rendered.objects))        # what `disttrain k8s render` prints (output.py)
    for w in rendered.warnings: ...

Kinds (docs/cluster.md, "The kinds"): `pod` is one Pod running torchrun on all its
GPUs, as a hand-written training Pod does; the multi-pod kinds `job` (Indexed Job +
headless Service), `pytorchjob` (Kubeflow PyTorchJob v1), `jobset` (JobSet) and `trainjob`
(Kubeflow Trainer v2) are built in k8s/workloads.py, their gang options (Kueue queue,
Coscheduling PodGroup) in k8s/gang.py. The container command is `launch.argv.torchrun_argv`,
the same argv `disttrain run` uses, so what runs in the pod is what ran locally and in
`disttrain k8s run-local`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from disttrain import envvars
from disttrain.distributed.torch_compat import image_note, minimum_torch, show
from disttrain.errors import SpecError
from disttrain.k8s import gang, hami
from disttrain.k8s.code import SPEC_PATH, CodePlan, configmap_data, plan_code, task_folder
from disttrain.k8s.install import install_setup
from disttrain.k8s.labels import (
    ANNOTATION_CODE,
    ANNOTATION_FILES,
    ANNOTATION_IMAGE,
    LABEL_JOB,
    LABEL_KIND,
    LABEL_MANAGED_BY,
    LABEL_NEEDS_DISTTRAIN,
    LABEL_WORKLOAD,
    RESERVED_PREFIXES,
    pod_name_hosts,
)
from disttrain.k8s.mesh_layout import ANNOTATION_MESH, mesh_layout
from disttrain.k8s.output import to_json, to_yaml
from disttrain.k8s.output_place import output_dir_warning
from disttrain.k8s.security import baseline_violations, container_security, pod_security
from disttrain.k8s.stopping import grace_period_s, pod_command, run_dir_warning, stop_env
from disttrain.k8s.workloads import TRAINER_PORT, workload_objects
from disttrain.launch.argv import resolve_nproc, torchrun_argv
from disttrain.spec.fields import parse_quantity
from disttrain.spec.job import JobSpec
from disttrain.spec.paths import locate_task_file

__all__ = ["Rendered", "pod_name_hosts", "quantity", "render", "spec_to_objects", "to_json",
           "to_yaml"]

LOCAL_IMAGE = "disttrain.local/run-local"  # placeholder image of `run-local` renders
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Rendered:
    """The objects to apply, in apply order, and what the user should know about them."""

    objects: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


def render(spec: JobSpec, base_dir: Path | str = ".", *, local: bool = False) -> Rendered:
    """Render `spec` for its `cluster.kind`.

    Args:
        spec: the job.
        base_dir: where the script and code.files are read from.
        local: render for `disttrain k8s run-local` (no image needed: this machine runs it).

    Returns:
        Rendered objects (PVCs, ConfigMap, Service, workload) and warnings.

    Raises:
        SpecError: the spec cannot run on a cluster; the message names field and fix.
    """
    return _Renderer(spec, Path(base_dir), local).render()


def spec_to_objects(spec: JobSpec, base_dir: Path | str = ".") -> list[dict[str, Any]]:
    """Just the objects of `render`."""
    return render(spec, base_dir).objects


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity's value (the grammar of `disttrain.spec.fields`).

    Example: quantity("8Gi") == 8 * 2**30; quantity("500m") == Decimal("0.5")
    """
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


class _Renderer:
    """One render of one spec: checks first, then builds the objects."""

    def __init__(self, spec: JobSpec, base_dir: Path, local: bool) -> None:
        located = locate_task_file(spec.task, task_folder(spec, base_dir)) if spec.task else None
        if located is not None:  # a task file: shipped and imported from its own folder
            spec = spec.model_copy(update={"task": located[0], "task_dir": str(located[1])})
        self.spec, self.c, self.local = spec, spec.cluster, local
        self.warnings: list[str] = []
        self.name = spec.name
        self.port = spec.launch.master_port
        self.nproc = resolve_nproc(spec, gpus=self.c.gpus)
        self.image = self.c.image or (LOCAL_IMAGE if local else None)
        self._check()
        # A recreated pod (restarts, or preemption: k8s/stopping.py) starts with torchrun's
        # restart count at 0, so the built-in job resumes by itself (none found: from scratch)
        pod_spec = spec
        if (spec.launch.max_restarts or self.c.kind != "pod") and not spec.script:
            pod_spec = spec.model_copy(update={"train": spec.train.model_copy(
                update={"resume": True})})
        if spec.task:  # the pod imports the task from the code mount (shipped or a volume)
            pod_spec = pod_spec.model_copy(update={"task_dir": self.c.code.mount})
        # what the image's tag says about its torch; a torch too old for the job is refused
        self.torch_note = (image_note(pod_spec, self.image) if self._needs_disttrain()
                           and not local else None)
        self.code: CodePlan = plan_code(spec, base_dir, pod_spec.to_yaml(),
                                         image_imports=not local)
        self.warnings += self.code.notes

    # -- checks -----------------------------------------------------------------------
    def _check(self) -> None:
        c, n = self.c, self.spec.launch.nnodes
        if not self.image:
            raise SpecError(f"cluster.image: a {c.kind} needs a container image; pass --image "
                            f"REGISTRY/NAME:TAG (the guide's is 117.50.188.237:30000/pytorch/"
                            f"pytorch:2.1.0-cuda12.1-cudnn8-runtime)")
        hami.check_processes(self.nproc, c, self.spec.launch.backend)
        # tp within a pod, pp across pods (k8s/mesh_layout.py); None for plain data parallel
        self.mesh = mesh_layout(self.spec, self.nproc)
        self.warnings += self.mesh.warnings if self.mesh is not None else []
        if c.kind == "pod" and n > 1:
            raise SpecError(f"launch.nnodes: kind pod runs one node but nnodes is {n}; use "
                            f"--kind job (Indexed Job + Service) or --kind pytorchjob")
        if c.elastic_nodes and c.kind != "pytorchjob":
            raise SpecError("cluster.elastic_nodes: only kind pytorchjob has an elasticPolicy")
        if c.elastic_nodes:
            lo, hi = (int(x) for x in c.elastic_nodes.split(":"))
            if not lo <= n <= hi:
                raise SpecError(f"launch.nnodes: {n} is outside cluster.elastic_nodes "
                                f"{c.elastic_nodes}")
        gang.check(self.spec)
        if c.kind == "trainjob" and self.port != TRAINER_PORT:
            raise SpecError(f"launch.master_port: Kubeflow Trainer fixes the master port of a "
                            f"TrainJob at {TRAINER_PORT}; drop --master-port {self.port}")
        if c.kind != "pod" and n > 1 and self.port == 0:
            raise SpecError("launch.master_port: 0 (a free port) cannot be a rendezvous "
                            "endpoint other pods connect to; use e.g. 29500")
        longest = pod_name_hosts(self.spec)[-1]
        if len(longest) > 63:
            raise SpecError(f"name: pod hostname {longest!r} would exceed 63 characters; "
                            f"use a shorter --name")
        if c.kind in ("job", "jobset", "trainjob") and not _DNS1035.match(self.name):
            raise SpecError(f"name: {self.name!r} names the headless Service, which must start "
                            f"with a letter (DNS-1035); e.g. 'job-{self.name}'")
        for key, value in c.labels.items():
            if not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
                raise SpecError(f"cluster.labels: {key!r} is not a valid label key")
            if key.startswith(RESERVED_PREFIXES):
                raise SpecError(f"cluster.labels: {key} is set by disttrain, which finds the "
                                f"job by it; use another key")
            if not _LABEL_VALUE.match(value) or len(value) > 63:
                raise SpecError(f"cluster.labels: {key}={value!r} is not a valid label value")
        for what, rl in (("cpu", c.cpu), ("memory", c.memory)):
            if rl.request and rl.limit and quantity(rl.request) > quantity(rl.limit):
                raise SpecError(f"cluster.{what}: request {rl.request} is above limit "
                                f"{rl.limit}; Kubernetes rejects that")
        if not self.spec.script and not self.local and not (
                c.image_has_disttrain or c.install_disttrain):
            job = f"the task {self.spec.task}"
            raise SpecError(
                f"cluster.image: {job} runs `python -m "
                f"disttrain.worker` in the pod, so the image needs disttrain; pass "
                f"--image-has-disttrain if {self.image} has it, or --install-disttrain "
                f"'disttrain' (with --pip-index-url of your mirror) to pip install it at "
                f"start, or run your own script that needs only torch")
        if self.spec.launch.launcher != "torchrun":
            self.warnings.append(f"launch.launcher: pods always start workers with torchrun; "
                                 f"{self.spec.launch.launcher} applies to `disttrain run` only")
        if c.image_has_disttrain and c.install_disttrain:
            self.warnings.append("cluster.install_disttrain: the image already has disttrain "
                                 "(image_has_disttrain); installing again at every start")

    # -- top level ----------------------------------------------------------------------
    def render(self) -> Rendered:
        objects = [self._pvc(v) for v in self.c.volumes if v.create]
        if gang.renders_pod_group(self.spec):  # before its pods exist (k8s/gang.py)
            objects.append(gang.pod_group(self.spec, self._labels()))
        if self.code.needs_configmap:
            objects.append(self._configmap())
        if self.c.kind == "pod":
            objects.append(self._pod())
        else:
            objects += workload_objects(self)
        self._warn(objects)
        return Rendered(objects, self.warnings)

    def _meta(self, name: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "namespace": self.c.namespace, "labels": self._labels(), **extra}

    def _labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "disttrain", "app.kubernetes.io/instance": self.name,
                LABEL_MANAGED_BY: "disttrain", LABEL_JOB: self.name,
                LABEL_KIND: self.c.kind, LABEL_WORKLOAD: "script" if self.spec.script else "task",
                LABEL_NEEDS_DISTTRAIN: str(self._needs_disttrain()).lower(),
                **self.c.labels}

    def _pod_meta(self) -> dict[str, Any]:
        notes = {ANNOTATION_IMAGE: self._image_needs(), **hami.hami_annotations(self.c)}
        if self.mesh is not None:
            notes[ANNOTATION_MESH] = self.mesh.describe()
        if self.code.needs_configmap:
            # new code = new pod: files mounted with subPath never change in a running pod
            data = json.dumps(configmap_data(self.code), sort_keys=True).encode()
            notes[ANNOTATION_CODE] = hashlib.sha256(data).hexdigest()[:32]
        return {"labels": self._labels(), "annotations": notes}

    def _script_entry(self) -> bool:  # scripts get the heartbeat entry where the pod has disttrain
        return bool(self.c.image_has_disttrain or self.c.install_disttrain)

    def _needs_disttrain(self) -> bool:
        return not self.spec.script or bool(self.c.install_disttrain)

    def _image_needs(self) -> str:
        if self.spec.script and not self.c.install_disttrain:
            return "torch (the user script runs under torchrun)"
        version, need = minimum_torch(self.spec)
        torch = f"torch >= {show(version)}" + (f" ({need.what})" if need else "")
        tag = f"; {self.torch_note}" if self.torch_note else ""
        if self.c.install_disttrain:
            where = self.c.pip_index_url or "the image's pip configuration"
            return (f"{torch} and pip; {self.c.install_disttrain} is pip-installed at start "
                    f"from {where}, keeping the image's torch{tag}")
        job = f"task {self.spec.task}" if self.spec.task else "built-in job"
        return f"{torch} and disttrain ({job}: python -m disttrain.worker){tag}"

    # -- objects ------------------------------------------------------------------------
    def _pvc(self, vol: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {"accessModes": [vol.access_mode],
                                "resources": {"requests": {"storage": vol.size}}}
        if vol.storage_class:
            spec["storageClassName"] = vol.storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": self._meta(vol.pvc), "spec": spec}

    def _configmap(self) -> dict[str, Any]:
        data, binary = configmap_data(self.code)
        files = ", ".join(f"{f.mount_path} ({f.why})" if f.why else f.mount_path
                          for f in self.code.files)
        obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": self._meta(f"{self.name}-code",
                                                      annotations={ANNOTATION_FILES: files})}
        if data:
            obj["data"] = data
        if binary:
            obj["binaryData"] = binary
        return obj

    def _pod(self) -> dict[str, Any]:
        env = [(envvars.MASTER_ADDR, "localhost"), (envvars.MASTER_PORT, str(self.port))]
        argv = torchrun_argv(self._pod_spec_view(), nproc=self.nproc, spec_path=self._spec_path(),
                             script_entry=self._script_entry())
        meta = self._meta(self.name)
        meta["annotations"] = self._pod_meta()["annotations"]
        meta["labels"].update(gang.queue_labels(self.c))  # Kueue's plain-Pod integration
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": self._podspec(self._container("trainer", argv, env))}

    # -- pod pieces ---------------------------------------------------------------------
    def _pod_spec_view(self) -> JobSpec:
        """The spec as the pod sees it: the script at its in-pod path."""
        if self.code.script_in_pod is None:
            return self.spec
        return self.spec.model_copy(update={"script": self.code.script_in_pod})

    def _spec_path(self) -> str:
        return SPEC_PATH

    def _workdir(self) -> str | None:
        return self.code.mount if self.code.delivery == "configmap" else None

    def _container(self, name: str, argv: list[str], env: list[tuple[str, Any]],
                   unbuffered: bool = True) -> dict[str, Any]:
        ctr: dict[str, Any] = {"name": name, "image": self.image,
                               "imagePullPolicy": self.c.image_pull_policy}
        if self.local:  # run-local runs the torchrun argv itself
            ctr["command"] = argv
        else:  # PID 1 forwards SIGTERM and exits 75 when stopped (k8s/stopping.py)
            ctr["command"], ctr["args"] = pod_command(install_setup(self.c)), argv
        if self.code.delivery == "configmap":
            ctr["workingDir"] = self.code.mount
        ctr["env"] = self._env(env, unbuffered)
        ctr["resources"] = self._resources()
        ctr["volumeMounts"] = self._mounts()
        ctr["securityContext"] = container_security(self.c)
        return ctr

    def _env(self, rendered: list[tuple[str, Any]], unbuffered: bool) -> list[dict[str, Any]]:
        """User env first (the guide's order), then ours unless the user set the same name."""
        pairs: list[tuple[str, Any]] = list(self.c.env.items())
        pairs += rendered + hami.nccl_env(self.c) + stop_env(self.spec, self._workdir())
        if unbuffered:
            pairs.append((envvars.PYTHONUNBUFFERED, "1"))  # so `logs -f` shows progress live
        out, seen = [], set()
        for key, value in pairs:
            if key in seen:
                continue
            seen.add(key)
            out.append({"name": key, "valueFrom": value} if isinstance(value, dict)
                       else {"name": key, "value": value})
        return out

    def _resources(self) -> dict[str, Any]:
        c, requests, limits = self.c, {}, {}
        for key, rl in (("cpu", c.cpu), ("memory", c.memory)):
            if rl.request:
                requests[key] = rl.request
            if rl.limit:
                limits[key] = rl.limit
        vgpu = hami.hami_resources(c)
        limits.update(vgpu)  # HAMi's webhook reads limits only
        out: dict[str, Any] = {}
        if requests:
            out["requests"] = {**requests, **vgpu}  # extended resources: request == limit
        if limits:
            out["limits"] = limits
        return out

    def _mounts(self) -> list[dict[str, Any]]:
        code, mounts = self.code, []
        if code.delivery == "configmap":
            mounts.append({"name": "workspace", "mountPath": code.mount})
        else:
            mounts.append({"name": "code", "mountPath": code.mount})
        cm_volume = "code" if code.delivery == "configmap" else "jobspec"
        for f in code.files:
            mounts.append({"name": cm_volume, "mountPath": f.mount_path, "subPath": f.key,
                           "readOnly": True})
        for vol in self.c.volumes:
            m: dict[str, Any] = {"name": vol.name, "mountPath": vol.mount}
            if vol.read_only:
                m["readOnly"] = True
            mounts.append(m)
        if self.c.shm:
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        return mounts

    def _volumes(self) -> list[dict[str, Any]]:
        code, c, vols = self.code, self.c, []
        cm = {"configMap": {"name": f"{self.name}-code"}}
        if code.delivery == "configmap":
            vols.append({"name": "workspace", "emptyDir": {}})
            if code.files:
                vols.append({"name": "code", **cm})
        else:
            source = ({"hostPath": {"path": c.code.host_path, "type": "DirectoryOrCreate"}}
                      if code.delivery == "host_path"
                      else {"persistentVolumeClaim": {"claimName": c.code.pvc}})
            vols.append({"name": "code", **source})
            if code.files:
                vols.append({"name": "jobspec", **cm})
        for vol in c.volumes:
            if vol.pvc:
                vols.append({"name": vol.name, "persistentVolumeClaim": {"claimName": vol.pvc}})
            else:
                vols.append({"name": vol.name, "hostPath": {"path": vol.host_path,
                                                            "type": "DirectoryOrCreate"}})
        if c.shm:
            vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c.shm}})
        return vols

    def _podspec(self, container: dict[str, Any], subdomain: str | None = None) -> dict[str, Any]:
        c, spec = self.c, {}
        if c.scheduler:
            spec["schedulerName"] = c.scheduler
        if c.node_selector:
            spec["nodeSelector"] = dict(c.node_selector)
        if c.runtime_class:
            spec["runtimeClassName"] = c.runtime_class
        if c.image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": s} for s in c.image_pull_secrets]
        if subdomain:
            spec["subdomain"] = subdomain
        spec["securityContext"] = pod_security()
        spec["containers"] = [container]
        spec["volumes"] = self._volumes()
        spec["restartPolicy"] = "Never"
        spec["terminationGracePeriodSeconds"] = grace_period_s(self.spec)
        return spec

    # -- warnings -----------------------------------------------------------------------
    def _warn(self, objects: list[dict[str, Any]]) -> None:
        c, w = self.c, self.warnings
        lost = None if self.local else run_dir_warning(self.spec, self._workdir())
        w += [lost] if lost else []
        model_lost = output_dir_warning(self.spec, self.code.mount)   # k8s/output_place.py
        w += [model_lost] if model_lost else []
        half_start = None if self.local else gang.no_gang_note(self.spec)
        w += [half_start] if half_start else []
        if c.code.host_path:
            w.append(f"cluster.code.host_path: the code must already be in {c.code.host_path} "
                     f"on the node, which pins the job to nodes holding it (use --node-selector);"
                     f" the ConfigMap default needs nothing on the nodes")
        for vol in c.volumes:
            if vol.host_path:
                w.append(f"cluster.volumes.{vol.name}: hostPath {vol.host_path} pins the job to "
                         f"nodes that hold it; prefer a PVC")
            if (vol.create and c.kind != "pod" and self.spec.launch.nnodes > 1
                    and vol.access_mode == "ReadWriteOnce" and not vol.read_only):
                w.append(f"cluster.volumes.{vol.name}: a ReadWriteOnce PVC is shared by "
                         f"{self.spec.launch.nnodes} pods, which then must all run on one node "
                         f"(K3s local-path is RWO only); use ReadWriteMany storage (e.g. NFS)")
        if hami.hami_resources(c) and c.scheduler != hami.HAMI_SCHEDULER:
            w.append(f"cluster.scheduler: {c.scheduler or 'the default scheduler'} with HAMi "
                     f"resources: HAMi's webhook leaves pods of other schedulers alone, so "
                     f"gpumem/gpucores are not enforced; use {hami.HAMI_SCHEDULER}")
        if c.shm and c.memory.limit and quantity(c.shm) > quantity(c.memory.limit):
            w.append(f"cluster.shm: {c.shm} of /dev/shm counts against the memory limit "
                     f"{c.memory.limit}; raise --memory or lower --shm")
        if "no-vgpu-control" in c.vgpu_workarounds:
            w.append("cluster.vgpu_workarounds: no-vgpu-control turns HAMi's GPU memory and "
                     "core isolation off for this job (CUDA_DISABLE_CONTROL=true)")
        for v in baseline_violations(objects):
            w.append(f"{v} is outside the Pod Security Standards 'baseline' level; a "
                     f"namespace enforcing it rejects this pod")

