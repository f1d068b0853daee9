"""Printing rendered objects: YAML documents headed by what the image needs, or a JSON List.

    print(to_yaml(render(spec).objects))

Shipped files (ConfigMap `data`) print as `|` blocks, byte for byte: PyYAML quotes a
multi-line string as soon as one line ends in a space or holds a tab, which turns a source
file into one unreadable line; a literal block holds both exactly, so `_Dumper` allows it
there. Only what a block cannot hold (CR line ends, control characters, a BOM) stays
double-quoted, and every document is read back and compared before it is printed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from disttrain.k8s.labels import ANNOTATION_FILES, ANNOTATION_IMAGE


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """Multi-document YAML, each document headed by a comment saying what the image needs."""
    docs = []
    for obj in objects:
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
# reader turns them into LF), the BOM, and C0 controls other than tab and LF.
_NOT_IN_BLOCK = re.compile("[\x00-\x08\x0b-\x1f\x7f\x85\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")


class _Base(yaml.SafeDumper):
    """No YAML aliases: every object is printed in full."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class _Dumper(_Base):
    """Multi-line strings as `|` blocks, also where lines end in spaces or hold tabs."""

    def analyze_scalar(self, scalar: str) -> Any:
        analysis = super().analyze_scalar(scalar)
        if analysis.multiline and not analysis.allow_block and not _NOT_IN_BLOCK.search(scalar):
            analysis.allow_block = True
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


_Dumper.add_representer(str, _block)
_Escaping.add_representer(str, _quoted)


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
    if "template" in spec:
        return spec["template"]
    for replica in (spec.get("pytorchReplicaSpecs") or {}).values():
        return replica.get("template")
    return None
