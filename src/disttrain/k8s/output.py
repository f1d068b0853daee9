"""Printing rendered objects: YAML documents headed by what the image needs, or a JSON List.

    print(to_yaml(render(spec).objects))
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from disttrain.k8s.labels import ANNOTATION_IMAGE


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """Multi-document YAML, each document headed by a comment saying what the image needs."""
    docs = []
    for obj in objects:
        meta = obj.get("metadata", {})
        head = f"# {obj['kind']} {meta.get('name')}"
        needs = _annotation(obj, ANNOTATION_IMAGE)
        if needs:
            head += f" -- image needs: {needs}"
        docs.append(head + "\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=4096,
                                             allow_unicode=True))
    return "---\n".join(docs)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (ConfigMap files) as readable `|` blocks, and no YAML aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


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
