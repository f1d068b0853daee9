"""Printing rendered objects: YAML documents headed by what the image needs, or a JSON List.

    print(to_yaml(render(spec).objects))

Every shipped file (ConfigMap `data`) prints as a `|` block, byte for byte, one line or
many: PyYAML quotes a multi-line string as soon as one line ends in a space or holds a tab,
which turns a source file into one unreadable line; a literal block holds both exactly, so
`_Dumper` allows it there. What a block cannot hold (`block_safe`: CR line ends, which a
YAML reader turns into LF, control characters, a BOM) never reaches `data`: k8s/code.py
ships such a file base64 in `binaryData` and says so. Every document is read back and
compared before it is printed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from disttrain.k8s.labels import ANNOTATION_FILES, ANNOTATION_IMAGE


def block_safe(text: str) -> bool:
    """Whether a YAML literal block holds `text` exactly (what code.py may put in `data`)."""
    return not _NOT_IN_BLOCK.search(text)


class _File(str):
    """A shipped file's content: always a block, also when it is one line."""

    __slots__ = ()


def _files_as_blocks(obj: dict[str, Any]) -> dict[str, Any]:
    if obj.get("kind") != "ConfigMap" or not obj.get("data"):
        return obj
    return {**obj, "data": {k: _File(v) for k, v in obj["data"].items()}}


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """Multi-document YAML, each document headed by a comment saying what the image needs
    and, for the ConfigMap, which files it ships and why."""
    docs = []
    for obj in map(_files_as_blocks, objects):
        meta = obj.get("metadata", {})
        head = f"# {obj['kind']} {meta.get('name')}"
        needs = _annotation(obj, ANNOTATION_IMAGE)
        if needs:
            head += f" -- image needs: {needs}"
        files = meta.get("annotations", {}).get(ANNOTATION_FILES)
        if files:
            head += f" -- ships: {files}"
        docs.append(head + "\n" + _dump(obj))
    return "---\n".join(docs)


def _dump(obj: dict[str, Any]) -> str:
    text = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)
    if yaml.safe_load(text) == obj:
        return text
    # NOTE: PyYAML's own styles do not always read back either (a raw NEL in a block or
    # in quotes); double quotes with every non-ASCII character escaped always do.
    return yaml.dump(obj, Dumper=_Escaping, sort_keys=False, width=4096, allow_unicode=False)


# What a literal block cannot hold exactly: CR and the other YAML 1.1 line breaks (a
# reader turns them into LF), the BOM, and what YAML calls non-printable (C0 controls other
# than tab and LF, DEL, the C1 controls, surrogates, U+FFFE / U+FFFF).
_NOT_IN_BLOCK = re.compile(
    "[^\t\n\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]|[\u2028\u2029\ufeff]")


class _Base(yaml.SafeDumper):
    """No YAML aliases: every object is printed in full."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class _Dumper(_Base):
    """Multi-line strings as `|` blocks, also where lines end in spaces or hold tabs."""

    def analyze_scalar(self, scalar: str) -> Any:
        analysis = super().analyze_scalar(scalar)
        if not analysis.allow_block and not _NOT_IN_BLOCK.search(scalar):
            analysis.allow_block = True  # only a string represented as `|` asks for it
        return analysis


class _Escaping(_Base):
    """The fallback: multi-line strings double-quoted, escapes and all."""


def _block(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = None
    if "\n" in value:
        style = '"' if _NOT_IN_BLOCK.search(value) else "|"
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _quoted(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if "\n" in value or _NOT_IN_BLOCK.search(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _file(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if _NOT_IN_BLOCK.search(value) else "|"
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style=style)


_Dumper.add_representer(str, _block)
_Dumper.add_representer(_File, _file)
_Escaping.add_representer(str, _quoted)
_Escaping.add_representer(_File, _quoted)


def to_json(objects: list[dict[str, Any]]) -> str:
    """A kubectl-style `List` of the objects."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2)


def _annotation(obj: dict[str, Any], key: str) -> str | None:
    meta = obj.get("metadata", {})
    if key in meta.get("annotations", {}):
        return meta["annotations"][key]
    template = _first_template(obj)
    return (template.get("metadata", {}).get("annotations") or {}).get(key) if template else None


def _first_template(obj: dict[str, Any]) -> dict[str, Any] | None:
    spec = obj.get("spec", {})
    if obj.get("kind") in ("JobSet", "ClusterTrainingRuntime"):  # the replicated Job's pods
        jobset = spec if obj["kind"] == "JobSet" else spec.get("template", {}).get("spec", {})
        for rjob in jobset.get("replicatedJobs") or []:
            return rjob.get("template", {}).get("spec", {}).get("template")
        return None
    if "template" in spec:
        return spec["template"]
    for replica in (spec.get("pytorchReplicaSpecs") or {}).values():
        return replica.get("template")
    return None
