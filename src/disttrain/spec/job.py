"""The job spec: one description of a training job, for local runs and the cluster.

    spec = JobSpec.from_yaml("job.yaml", overrides={"epochs": 3})
    spec = JobSpec()                      # the built-in main job (digits)
    spec = JobSpec(task="mytask:make_task", task_args={"hidden": 256})

A `JobSpec` is loaded from YAML and every field can be overridden by a CLI flag of the
same name (`--epochs 3`, `--nproc-per-node 2`): field names are unique across sections
so flags need no section prefix. The spec package is a leaf (it imports nothing of
disttrain but `errors`) so every other module can take a JobSpec without import cycles.

Every job is either a `script` (the user's own loop under torchrun) or a `task` (a
TrainTask reference the built-in Trainer trains): the built-in jobs are tasks too, and a
job with neither trains `disttrain.examples.digits:make_task`. An old spec's `example: NAME`
is read as `task: disttrain.examples.NAME:make_task`; the example options that used to be
`train` fields (data_dir, download, num_samples, input_size, hidden_size) are the task's
arguments (`task_args`), and a spec that still sets one is refused naming the new form.
Without a `name`, a job is named after its task or script (`chargpt`, `train`).

Bad input raises `SpecError` whose message names the file, the field path, the value
and what is allowed; the CLI prints it and exits 2. Cross-field rules the spec alone
decides are validators here and name the flag to change; rules that need the machine
(GPUs, WORLD_SIZE) are in `disttrain.spec.rules`.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path, PurePath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from disttrain.errors import SpecError
from disttrain.spec.cluster import ClusterSpec
from disttrain.spec.fields import (
    DEFAULT_TASK,
    EXAMPLES,
    CommHook,
    StrictModel,
    dns_label,
    example_task,
    is_dns1123_label,
    parse_task_reference,
    task_job_name,
)
from disttrain.spec.parallelism import (
    ParallelismSpec,
    check_microbatches,
    check_supported,
    resolve_degrees,
)
from disttrain.spec.paths import check_readable_file

MAX_PROCS = 1024  # processes or threads per node: more is a typo, not a machine

# The built-in examples' options that were `train` fields, with the value an old job.yaml
# holds when they were not set: such a dump still loads; any other value is refused, naming
# task_args (they are the arguments of the tasks that take them: disttrain.examples.*).
MOVED_TO_TASK_ARGS: dict[str, Any] = {"data_dir": None, "download": False, "num_samples": None,
                                      "input_size": None, "hidden_size": 512}


class LaunchSpec(StrictModel):
    """How the worker processes are started (torchrun's options)."""

    nnodes: int = Field(1, ge=1, description="number of nodes (hosts / pods)")
    nproc_per_node: int | Literal["auto"] = Field(
        "auto", description="processes per node; auto = one per GPU, else 2 on CPU (1 with "
        "--strategy dp: one process drives all GPUs)"
    )
    node_rank: int = Field(0, ge=0, description="this node's rank (multi-node, static rendezvous)")
    master_addr: str = Field("127.0.0.1", description="address of the rank-0 node")
    master_port: int = Field(29500, ge=0, le=65535, description="rendezvous port (0 = free port)")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous (multi-node); default master_addr:port"
    )
    rdzv_id: str | None = Field(None, description="rendezvous id (default: the job name)")
    max_restarts: int = Field(0, ge=0, description="torchrun elastic restarts of failed workers")
    rdzv_timeout_s: int | None = Field(
        None, ge=10, le=24 * 3600,
        description="seconds every node has to reach the rendezvous before the job fails "
                    "naming who is missing (default 180 with several nodes; torchrun's is 600)"
    )
    launcher: Literal["torchrun", "spawn", "env"] = Field(
        "torchrun", description="torchrun (default), spawn (mp.spawn), env (one rank from env vars)"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto = nccl when every local rank has its own GPU, else gloo"
    )
    timeout_s: float = Field(
        300.0, gt=0, le=7 * 24 * 3600,
        description="stall / collective timeout: a stuck rank ends the job after this (s)"
    )
    stop_grace_s: int = Field(
        120, ge=5, le=24 * 3600,
        description="seconds a stopped job (SIGTERM: preemption, eviction, Ctrl-C) has to "
                    "agree on a step and write its checkpoint; the pods' "
                    "terminationGracePeriodSeconds"
    )
    port_explicit: bool = Field(
        False, description="(set by the CLI) master_port was asked for explicitly: never move it"
    )

    @field_validator("nproc_per_node")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_PROCS:
            raise ValueError(f"must be 1 to {MAX_PROCS} or 'auto'")
        return v


class TrainSpec(StrictModel):
    """How the built-in Trainer trains a task: loop settings only (what to train, and its
    options, are the task and its `task_args`). Ignored by user scripts, which get `args`."""

    strategy: Literal["none", "dp", "ddp", "fsdp"] = Field("ddp", description="parallel strategy")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision")
    epochs: int = Field(10, ge=1, description="training epochs")
    batch_size: int = Field(32, ge=1, description="per-process batch size")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(0.001, gt=0, description="base learning rate (before lr_scaling)")
    lr_scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear", description="scale lr with global batch / batch_size (deployment guide §7.2)"
    )
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up in optimizer steps")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="optimizer")
    comm_hook: CommHook = Field(
        "none", description="DDP gradient compression hook"
    )
    grad_ckpt: bool = Field(False, description="activation checkpointing of model blocks")
    fsdp_sharding: Literal["full", "hybrid", "none"] = Field("full", description="FSDP sharding")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="random seed (model init, data order)")
    run_dir: str | None = Field(None, description="output folder (default runs/<name>; a "
                                "script's attempts: <run dir or runs/<script stem>>/run-N)")
    output_dir: str | None = Field(
        None, description="where the trained model is saved in its library's format at the end "
        "(the causal-LM recipe: a Hugging Face directory; docs/finetune.md); on the cluster a "
        "PVC or hostPath mount, not the pod's emptyDir"
    )
    checkpoint_every_epochs: int = Field(1, ge=0, description="checkpoint interval, 0 = off")
    checkpoint_every_steps: int = Field(0, ge=0, description="checkpoint every N optimizer steps")
    resume: bool = Field(False, description="continue from the run dir's last checkpoint")
    log_every_steps: int = Field(10, ge=1, description="loss logging interval (steps)")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank")
    threads: int | None = Field(
        None, ge=1, le=MAX_PROCS,
        description="torch threads per process (default: cores / local processes)"
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    sync_batchnorm: bool = Field(
        False, description="convert BatchNorm layers to SyncBatchNorm (DDP): every rank normalises "
        "with the statistics of the global batch"
    )
    cpu_offload: bool = Field(
        False, description="FSDP: keep each rank's shard of the parameters, its gradients and "
        "the optimizer state in host memory (FSDP2's CPUOffloadPolicy); the device holds one "
        "unit's gathered parameters at a time and the optimizer steps on the CPU"
    )


class JobSpec(StrictModel):
    """A training job: what to run, how to launch it, how to train, where (cluster)."""

    name: str = Field("disttrain", description="job name (DNS-1123: lower case, digits, '-'; "
                      "default: from the task or script, `disttrain` for the built-in job)")
    script: str | None = Field(None, description="user training script run by torchrun")
    task: str | None = Field(
        None, description="what the built-in Trainer trains: a TrainTask factory, "
        "module:function or path/file.py:function (e.g. mytask:make_task; the built-in jobs "
        f"are disttrain.examples.NAME:make_task, the default {DEFAULT_TASK}; docs/your-model.md)"
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the task's function, a mapping "
        "(e.g. '{hidden: 256}')"
    )
    task_dir: str | None = Field(
        None, description="(set by the CLI) the spec file's folder, searched first for the task's module"
    )
    args: list[str] = Field(default_factory=list, description="arguments passed to the script")
    launch: LaunchSpec = Field(default_factory=LaunchSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)

    @field_validator("name")
    @classmethod
    def _dns1123(cls, v: str) -> str:
        if not is_dns1123_label(v):
            raise ValueError(
                "must be a DNS-1123 label: at most 63 lower-case letters, digits or '-', "
                "starting and ending with a letter or digit (e.g. 'mnist-ddp')"
            )
        return v

    @field_validator("task")
    @classmethod
    def _task_reference(cls, v: str | None) -> str | None:
        if v is not None:
            parse_task_reference(v)  # the syntax only: importing it is the CLI's and the worker's
        return v

    @field_validator("task_args")
    @classmethod
    def _json_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        # They travel in job.yaml to every rank and pod and become the factory's keyword
        # arguments: plain YAML/JSON values only, and finite numbers (the base's inf/NaN
        # rule sees only fields typed as floats, not values inside a mapping).
        for key, value in v.items():
            if not key.isidentifier():
                raise ValueError(f"{key!r} is not a keyword argument name")
            problem = _json_problem(value)
            if problem:
                raise ValueError(f"{key}: {problem}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _one_kind_of_job(cls, data: Any) -> Any:
        """A script or a task, nothing else: the old `example:` becomes its task reference,
        old example fields in `train` are refused naming their new place, a job without a
        script or a task trains the default task, and an unnamed job is named after its
        task or script (the built-in default job keeps `disttrain`)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        example = data.pop("example", None)
        if example is not None:
            if example not in EXAMPLES:
                raise ValueError(f"example: must be one of {', '.join(EXAMPLES)} (got {example!r})")
            if data.get("script"):
                raise ValueError("give either 'script' or 'example', not both")
            if data.get("task"):
                raise ValueError("task: give either 'task' (your TrainTask) or 'example' (a built-in "
                                 f"job, short for task: {example_task(example)}), not both")
            data["task"] = example_task(example)
        train = data.get("train")
        if isinstance(train, dict):
            for key, value in train.items():
                if key in MOVED_TO_TASK_ARGS and value != MOVED_TO_TASK_ARGS[key]:
                    raise ValueError(
                        f"train.{key}: an example option is a task argument now: write "
                        f"task_args: {{{key}: {value}}} (or --{key.replace('_', '-')}) for a task "
                        f"that takes it (docs/your-model.md)")
            data["train"] = {k: v for k, v in train.items() if k not in MOVED_TO_TASK_ARGS}
        script, task = data.get("script"), data.get("task")
        if "name" not in data and isinstance(script, str) and script:
            data["name"] = dns_label(PurePath(script).stem, fallback="script")
        elif "name" not in data and isinstance(task, str) and task:
            with contextlib.suppress(ValueError):  # a bad reference: the field's own message
                data["name"] = task_job_name(task)
        if not script and not task:
            data["task"] = DEFAULT_TASK
        return data

    @model_validator(mode="after")
    def _one_workload(self) -> JobSpec:
        if self.task and self.script:
            raise ValueError("task: give either 'task' (a TrainTask the built-in Trainer trains) or "
                             "'script' (your own loop under torchrun), not both")
        if self.task_args and self.script:
            raise ValueError("task_args: they are the arguments of a task's function, and a script "
                             "takes its own after --; remove task_args, or give --task instead")
        return self

    @model_validator(mode="after")
    def _rendezvous_deadline(self) -> JobSpec:
        if (self.launch.rdzv_timeout_s is not None and self.launch.nnodes == 1
                and not self.cluster.elastic_nodes):
            raise ValueError("launch.rdzv_timeout_s: one node has no rendezvous between "
                             "nodes to wait for; drop it, or use --nnodes 2 or more")
        return self

    @model_validator(mode="after")
    def _builtin_strategy(self) -> JobSpec:
        """Combinations every worker of the built-in job would reject (or crash on) at start,
        refused at load time with the flag to change. Only for the built-in job: a user
        script reads its own arguments, not `train`. Rules that depend on the machine (GPUs,
        WORLD_SIZE) are in `disttrain.spec.rules.check_runnable`."""
        if self.script:
            return self
        cfg, launch = self.train, self.launch
        nproc = launch.nproc_per_node
        if cfg.strategy == "dp" and isinstance(nproc, int) and nproc > 1:
            raise ValueError(
                f"launch.nproc_per_node: strategy dp runs ONE process that drives all visible "
                f"GPUs (nn.DataParallel), not {nproc}; use --nproc-per-node 1, or "
                f"--strategy ddp for one process per GPU (recommended)")
        if cfg.strategy == "dp" and launch.nnodes > 1:
            raise ValueError(
                f"launch.nnodes: strategy dp is one process on one machine, not {launch.nnodes} "
                f"nodes; use --strategy ddp across nodes")
        if cfg.strategy == "dp" and cfg.sync_batchnorm:
            raise ValueError("train.sync_batchnorm: SyncBatchNorm syncs the statistics of one "
                             "process per GPU, and strategy dp is one process; use --strategy "
                             "ddp, or --no-sync-batchnorm")
        if cfg.cpu_offload and cfg.strategy != "fsdp":
            raise ValueError(
                f"train.cpu_offload: offloading parameters, gradients and optimizer state to "
                f"host memory is FSDP's (fully_shard's CPUOffloadPolicy), and strategy "
                f"{cfg.strategy} keeps them on the device; use --strategy fsdp --cpu-offload, "
                f"or drop --cpu-offload")
        if cfg.strategy == "fsdp" and cfg.comm_hook == "powersgd":
            raise ValueError("train.comm_hook: powersgd is a DDP comm hook and FSDP has none; "
                             "use --strategy ddp, or --comm-hook bf16/fp16 with fsdp")
        return self

    @model_validator(mode="after")
    def _mesh_degrees(self) -> JobSpec:
        """The parallelism degrees against the world size, when the spec alone fixes it
        (an `auto` process count is checked in every rank: `check_runnable`)."""
        if self.parallelism == ParallelismSpec():
            return self
        if self.script:
            raise ValueError("parallelism: the built-in Trainer's mesh; a script builds its own "
                             "(torch.distributed.device_mesh); remove the section or the flags")
        check_microbatches(self.parallelism, self.train.batch_size)
        hook = self.train.comm_hook
        if self.parallelism.model_parallel and hook != "none" and self.train.strategy != "fsdp":
            # a split model's replicas average by hand (distributed.composed.average_grads),
            # not through DDP's hook; FSDP2 x TP takes fp16 / bf16 as its reduce dtype (and
            # powersgd with fsdp is refused with the other fsdp runs: TrainSpec's check)
            raise ValueError(f"train.comm_hook: {hook} with tp / pp does not apply: the data-"
                             "parallel copies of a split model average their gradients in one "
                             "all-reduce of their own, not through DDP's hook; drop "
                             "--comm-hook, or use --strategy fsdp with --tp and fp16 / bf16")
        nproc = self.launch.nproc_per_node
        if isinstance(nproc, int) and not self.cluster.elastic_nodes:
            check_supported(resolve_degrees(self.parallelism, self.launch.nnodes * nproc),
                            self.train.strategy)
        return self

    # -- derived values -------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.train.run_dir or f"runs/{self.name}")

    # -- loading --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, overrides: dict[str, Any] | None = None,
                  source: str = "spec") -> JobSpec:
        """Validate `data` (a YAML mapping) with flat `overrides` (field name -> value)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a mapping of fields at the top level, "
                            f"got {type(data).__name__}")
        merged = apply_overrides(data, overrides or {})
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: dict[str, Any] | None = None) -> JobSpec:
        """Load a YAML spec file (or the defaults when `path` is None)."""
        if path is None:
            return cls.from_dict({}, overrides, source="flags")
        p = check_readable_file(path, kind="job spec",
                                missing="no such file; pass an existing job spec with -f")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:  # e.g. removed since the check
            raise SpecError(f"{p}: cannot read the spec ({exc})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise SpecError(f"{p}:{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        except (ValueError, RecursionError) as exc:  # e.g. a date like 2024-02-30
            raise SpecError(f"{p}: not a usable YAML value ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None
        return cls.from_dict(data, overrides, source=str(p))

    def to_yaml(self) -> str:
        exclude: dict[str, Any] = {"launch": {"port_explicit"}}
        if self.parallelism == ParallelismSpec():  # a plain data-parallel job's dump stays as it was
            exclude["parallelism"] = True
        return yaml.safe_dump(self.model_dump(mode="json", exclude=exclude), sort_keys=False)


SECTIONS: dict[str, type[StrictModel]] = {"launch": LaunchSpec, "train": TrainSpec,
                                           "parallelism": ParallelismSpec, "cluster": ClusterSpec}


def field_index() -> dict[str, tuple[str | None, Any]]:
    """Every flag-able field: name -> (section or None for top level, pydantic FieldInfo)."""
    index: dict[str, tuple[str | None, Any]] = {}
    for name, info in JobSpec.model_fields.items():
        if name not in SECTIONS:
            index[name] = (None, info)
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            if name in index:
                raise RuntimeError(f"field name {name!r} is not unique across spec sections")
            index[name] = (section, info)
    return index


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `data` with flat field overrides put into their sections."""
    index = field_index()
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for name, value in overrides.items():
        if name == "example":  # the short form of a task reference (`_one_kind_of_job`)
            merged[name] = value
            continue
        if name not in index:
            raise SpecError(f"unknown option {name!r}")
        section, _ = index[name]
        if section is None:
            merged[name] = value
        else:
            target = merged.setdefault(section, {})
            if not isinstance(target, dict):
                raise SpecError(f"{section}: expected a mapping, got {type(target).__name__}")
            target[name] = value
    return merged


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One readable line per problem: where, what was given, what is allowed."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        named = _FIELD_PREFIX.match(msg) if not err["loc"] else None
        if named:  # a cross-field rule names the field to change itself
            path, msg = named.group(1), msg[named.end():]
        if err["type"] == "extra_forbidden":
            section = err["loc"][:-1]
            model = _model_at(section)
            known = sorted(model.model_fields) if model else []
            msg = "unknown field" + (f"; known fields here: {', '.join(known)}" if known else "")
        elif err["type"] == "literal_error":
            msg = f"must be one of {err.get('ctx', {}).get('expected', '')}"
        given = err.get("input")
        shown = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(given, dict) \
            else f" (got {given!r})"
        lines.append(f"{source}: {path}: {msg}{shown}")
    return "\n".join(lines)


_FIELD_PREFIX = re.compile(r"((?:launch|train|cluster|parallelism)\.[a-z_]+|task|task_args|example"
                           r"|parallelism): ")


def _json_problem(value: Any, depth: int = 0) -> str | None:
    """Why `value` is not a plain YAML/JSON value (None when it is)."""
    if depth > 32:
        return "nested too deeply"
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"must be a finite number (got {value!r})"
    if isinstance(value, list):
        return next((p for p in (_json_problem(x, depth + 1) for x in value) if p), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "mapping keys must be strings"
        return next((p for p in (_json_problem(x, depth + 1) for x in value.values()) if p), None)
    return f"must be a YAML/JSON value (text, number, bool, list, mapping), got {type(value).__name__}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = JobSpec
    for part in loc:
        if model is None or not isinstance(part, str):
            return None
        info = model.model_fields.get(part)
        ann = getattr(info, "annotation", None)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model
