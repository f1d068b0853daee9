"""A pretrained model read from disk by one rank, its weights sent to the others.

    pretrained = Pretrained(model_dir, dtype=torch.float32, lora=LoraSettings(r=8))
    model = pretrained.build()            # every rank: parameters on the meta device
    model = pretrained.load(model, rt, strategy, wrap)   # one rank per node reads, the others receive

Why: every torchrun rank calling `from_pretrained` holds its own copy of the weights in
host memory, so a 2-GPU pod needs twice the model in RAM before training starts and is
OOM-killed (pytorch#122582; `low_cpu_mem_usage` alone does not help). Here every rank
builds the model's structure on the meta device (no memory; real buffers, which the
model computes itself: rotary frequencies), and one rank reads the safetensors files,
a bounded chunk at a time (`CHUNK_BYTES`):

- ddp / none: each rank allocates its parameters on its device (`to_empty`), local rank 0
  of each node reads the node's own copy of the files and copies the chunks in, and every
  parameter and buffer is broadcast from it to its node's ranks only (`node_group`: one
  process group per node), so no weight crosses the network between nodes (DDP's own
  start-up broadcast is turned off, `init_sync=False`, after `check_nodes_agree`);
- fsdp (FSDP2): the meta model is sharded first (`fully_shard`), then `to_empty` gives each
  rank its shard only, and `set_model_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)` (torch.distributed.checkpoint.state_dict; pytorch#125339)
  sends each tensor from rank 0 and keeps the local shard. No rank holds more than its
  shard plus one chunk.

LoRA adapters (peft) are added on the meta model; their starting values (peft's own init:
A like nn.Linear, B zero) are made by the reading rank, from the RNG state every rank
shares (the same on every node), and sent with the base weights. FSDP1 is
refused for LoRA: it flattens frozen and trainable parameters into one FlatParameter
("FlatParameter requires uniform requires_grad", pytorch#100945).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain import envvars
from disttrain.distributed.runtime import Runtime
from disttrain.errors import StrategyError
from disttrain.train.task import TaskError

CHUNK_BYTES = 64 << 20   # rank 0 holds at most this much of the checkpoint at once (+ one tensor)
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class LoraSettings:
    """peft LoraConfig's knobs the recipe exposes; target_modules None = per architecture."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str | None = None   # str: "all-linear" or a regex


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of a Hugging Face model directory, safetensors first.

    Raises:
        TaskError: none is there, or an index names a shard that is missing (file and
            directory named).
    """
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = model_dir / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise TaskError(f"model: {index} is not a weight index ({exc})") from None
            missing = [n for n in names if not (model_dir / n).is_file()]
            if missing:
                raise TaskError(f"model: {index.name} names {missing[0]}, which is not in "
                                f"{model_dir} ({len(missing)} of {len(names)} shard(s) missing)")
            return [model_dir / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (model_dir / single).is_file():
            return [model_dir / single]
    present = ", ".join(sorted(p.name for p in model_dir.iterdir())[:12]) or "nothing"
    raise TaskError(f"model: no model.safetensors (or {SAFETENSORS_INDEX}, pytorch_model.bin) in "
                    f"{model_dir}; it holds: {present}")


def _file_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(key, read) for each tensor of one checkpoint file; `read` loads that tensor only."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                yield key, (lambda k=key: f.get_tensor(k))
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for key in list(state):
        yield key, (lambda k=key: state[k])


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    `with torch.device("meta")` would put the buffers there too, and a model's non-persistent
    buffers (rotary frequencies) are not in the checkpoint: it computes them. Parameters
    are re-registered on meta as the model's constructor registers them (accelerate's
    `init_empty_weights(include_buffers=False)` does the same)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass
class Pretrained:
    """A causal LM in a local Hugging Face directory, built on meta and loaded once."""

    model_dir: Path
    dtype: torch.dtype = torch.float32
    lora: LoraSettings | None = None
    # model state_dict key (after peft) -> checkpoint key; filled by build()
    names: dict[str, str] = field(default_factory=dict)
    hf_model: Any = None      # the transformers model (inside peft's wrapper with LoRA)
    lora_start: dict[str, torch.Tensor] = field(default_factory=dict)  # adapters' first values
    peft_model: Any = None    # peft's wrapper, with LoRA
    _hf_ids: dict[int, str] = field(default_factory=dict)   # id(tensor) -> key before peft

    # -- every rank ---------------------------------------------------------------------
    def build_structure(self) -> nn.Module:
        """The model (inside peft's wrapper with LoRA), parameters on meta, buffers real."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(self.model_dir))
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()   # re-registered parameters lost the tie between them
        # from_config builds in config.json's dtype (bf16 for most published models): the
        # parameters take the recipe's dtype (on meta: nothing is converted yet).
        recast = False
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != self.dtype:
                    module._parameters[name] = nn.Parameter(p.to(self.dtype),
                                                            requires_grad=p.requires_grad)
                    recast = True
        if recast:
            model.tie_weights()
        self.hf_model = model
        self._hf_ids = {id(t): key for key, t in _named_tensors(model)}
        if self.lora is not None:
            model = self._add_lora(model)
            self.peft_model = model
        return model

    def build(self) -> nn.Module:
        """The model's structure on meta (LoRA adapters added when asked), and where each
        of its weights is in the checkpoint files."""
        model = self.build_structure()
        before = self._hf_ids
        file_keys = self._file_keys()
        prefix = getattr(model, "base_model_prefix", "") or getattr(self.hf_model, "base_model_prefix", "")
        for key, t in _named_tensors(model):
            hf_key = before.get(id(t))
            if hf_key is None:
                continue  # a LoRA parameter: made on rank 0 at load
            for candidate in (hf_key, hf_key.removeprefix(f"{prefix}."), f"{prefix}.{hf_key}"):
                if candidate in file_keys:
                    self.names[key] = candidate
                    break
        return model

    def _add_lora(self, model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        lora = self.lora
        assert lora is not None
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=(list(lora.target_modules) if isinstance(lora.target_modules, tuple)
                                         else lora.target_modules),
                         task_type="CAUSAL_LM")
        try:
            return get_peft_model(model, cfg)
        except ValueError as exc:  # no module matches target_modules
            raise TaskError(f"lora.target_modules: {exc}") from None

    def _file_keys(self) -> set[str]:
        keys: set[str] = set()
        for path in weight_files(self.model_dir):
            keys.update(key for key, _ in _file_tensors(path))
        return keys

    def load(self, model: nn.Module, rt: Runtime, strategy: str,
             wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
        """Give `model` (from build, on meta) rank 0's values and wrap it for `strategy`."""
        self._check_complete(model)
        # DDP: local rank 0 of each node reads (from the node's own /models) and sends within
        # the node; FSDP: rank 0 of the job, whose shards go to every rank anyway.
        group, reader = (None, 0) if strategy == "fsdp" else node_group(rt)
        if self.lora is not None and rt.rank == reader:   # before wrap: plain tensors, on CPU
            with torch.random.fork_rng(devices=[]):  # the reader's RNG stays the others' twin
                self.lora_start = self._lora_start(model)
        if strategy == "fsdp":
            from disttrain.distributed.fsdp import fsdp_version

            if fsdp_version() != 2:
                raise StrategyError(f"the causal-LM recipe loads weights into FSDP2 (fully_shard); "
                                    f"this torch runs FSDP1: use strategy ddp, or unset "
                                    f"{envvars.FSDP_VERSION}")
            buffers = _real_buffers(model)
            model = wrap(model)
            model.to_empty(device=rt.device)
            _restore_buffers(model, buffers, rt.device)
            self._send_fsdp(model, rt)
            return model
        buffers = _real_buffers(model)
        model.to_empty(device=rt.device)
        _restore_buffers(model, buffers, rt.device)
        self.hf_model.tie_weights()
        if rt.rank == reader:
            with torch.no_grad():
                params = dict(_named_tensors(model))
                for chunk in self._chunks(model):
                    for key, value in chunk.items():
                        params[key].copy_(value)
        if rt.distributed and rt.world_size > 1:
            with torch.no_grad():
                for _, tensor in _named_tensors(model):
                    dist.broadcast(tensor, src=reader, group=group)
        if group is None:
            return wrap(model)
        check_nodes_agree(model, self.model_dir)
        # DDP's start-up sync would broadcast every weight from rank 0 over the network again
        return wrap(model, init_sync=False)

    # -- rank 0's reading ---------------------------------------------------------------------
    def _chunks(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """{model key: value} in chunks of at most CHUNK_BYTES: checkpoint tensors first
        (read one at a time), then the LoRA adapters' starting values."""
        wanted = {file_key: key for key, file_key in self.names.items()}
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for path in weight_files(self.model_dir):
            for file_key, read in _file_tensors(path):
                key = wanted.get(file_key)
                if key is None:
                    continue
                tensor = read()
                chunk[key] = tensor
                size += tensor.numel() * tensor.element_size()
                if size >= CHUNK_BYTES:
                    yield chunk
                    chunk, size = {}, 0
        chunk.update(self.lora_start)
        if chunk:
            yield chunk

    def _lora_start(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """peft's initial adapter values, made on CPU (each LoRA layer's own reset)."""
        if self.lora is None:
            return {}
        from peft.tuners.lora import LoraLayer

        out: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            adapters = [n for n in ("lora_A", "lora_B") if hasattr(module, n)]
            # A CPU stand-in of the layer's adapters, reset the way peft resets them.
            stand_in = _AdapterStandIn({a: getattr(module, a) for a in adapters}, module)
            stand_in.reset()
            for a in adapters:
                for k, t in stand_in.adapters[a].state_dict().items():
                    out[f"{name}.{a}.{k}"] = t
        return out

    def _send_fsdp(self, model: nn.Module, rt: Runtime) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        # Every rank makes one call per chunk: rank 0 says before each whether one follows.
        source = self._chunks(model) if rt.is_rank0 else None
        while True:
            chunk = next(source, None) if source is not None else None
            more = [chunk is not None]
            dist.broadcast_object_list(more, src=0)
            if not more[0]:
                break
            set_model_state_dict(model, chunk if rt.is_rank0 else {}, options=opts)

    def _check_complete(self, model: nn.Module) -> None:
        """Every parameter of the base model has a value in the checkpoint (tied ones
        share their twin's); a checkpoint of another architecture is named here."""
        tied = _tied_names(model)
        lora = {k for k in dict(_named_tensors(model)) if ".lora_" in k}
        persistent = set(model.state_dict())
        missing = sorted(k for k, _ in _named_tensors(model)
                         if k in persistent and k not in self.names and k not in tied
                         and k not in lora)
        if missing:
            raise TaskError(f"model: {len(missing)} weight(s) of the model built from "
                            f"{self.model_dir / 'config.json'} are not in its checkpoint files, e.g. "
                            f"{', '.join(missing[:3])}; is the directory complete?")


def node_group(rt: Runtime) -> tuple[Any, int]:
    """(this node's process group, the global rank of its local rank 0, which reads).

    Every rank says which global rank is its node's local rank 0 (`rank - local_rank`:
    torchrun numbers a node's ranks contiguously); with one node, or a numbering where
    that rank is not a local rank 0, it is (the default group, rank 0). Otherwise one
    subgroup per node, made by every rank in the same order (`new_subgroups_by_enumeration`),
    so a node's weights travel over its own loopback / shared memory, not the network.
    The subgroups live as long as the default group (destroyed with it)."""
    if not rt.distributed or rt.world_size < 2:
        return None, 0
    leads = rt.all_gather_object(rt.rank - rt.local_rank)
    nodes = sorted(set(leads))
    if len(nodes) < 2 or any(leads[lead] != lead for lead in nodes):
        return None, 0
    ranks = [[r for r, lead in enumerate(leads) if lead == node] for node in nodes]
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group, leads[rt.rank]


def check_nodes_agree(model: nn.Module, model_dir: Path) -> None:
    """Every node loaded the same weights (a collective over the job): the names and shapes,
    then one float64 sum per tensor, min and max over the ranks; numbers, not weights,
    cross the network. Each node read its own copy of `model_dir`, and DDP is told not to
    sync at start, so copies that differ between nodes would train apart unseen.

    Raises:
        TaskError: the copies differ (the first differing tensor named).
    """
    import hashlib

    named = list(_named_tensors(model))
    layout = hashlib.sha256(repr([(k, tuple(t.shape)) for k, t in named]).encode()).hexdigest()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, layout)
    if len(set(gathered)) > 1:
        raise TaskError(f"model: the nodes built different models from {model_dir / 'config.json'} "
                        f"(names or shapes differ by rank); every node must hold the same files")
    with torch.no_grad():
        sums = torch.stack([t.detach().sum(dtype=torch.float64) for _, t in named])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (~torch.isclose(low, high, rtol=0.0, atol=0.0, equal_nan=True)).nonzero()
    if differ.numel():
        raise TaskError(f"model: the nodes' copies of {model_dir} differ ({named[int(differ[0])][0]} "
                        f"and {differ.numel() - 1} more tensor(s)); every node must hold the same files")


class _AdapterStandIn:
    """The adapters of one LoRA layer, materialised on CPU and reset by peft's own code."""

    def __init__(self, adapters: dict[str, nn.Module], layer: Any) -> None:
        import copy

        self.layer = layer
        self.adapters = {}
        for name, module in adapters.items():
            clone = copy.deepcopy(module)
            clone.to_empty(device="cpu")
            self.adapters[name] = clone

    def reset(self) -> None:
        saved = {name: getattr(self.layer, name) for name in self.adapters}
        try:
            for name, clone in self.adapters.items():
                self.layer._modules[name] = clone
            for adapter in list(self.layer.lora_A.keys()):
                self.layer.reset_lora_parameters(adapter, True)
        finally:
            for name, module in saved.items():
                self.layer._modules[name] = module


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, each once (a tied parameter under its first name)."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _tied_names(model: nn.Module) -> set[str]:
    first: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.add(name)
        else:
            first[id(p)] = name
    return tied


def _real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the model computed itself (not on meta): to_empty would wipe them."""
    return {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}


def _restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor], device: torch.device) -> None:
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in saved:
                buf.copy_(saved[name].to(device))
