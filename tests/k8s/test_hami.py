"""HAMi units, ranges, annotations and the scheduler check (docs/cluster.md)."""

from __future__ import annotations

from typing import Any

import pytest

from disttrain.errors import SpecError
from disttrain.k8s import hami
from disttrain.spec.cluster import ClusterSpec, parse_gpumem
from disttrain.spec.job import JobSpec, field_index


def test_field_names_stay_unique_across_sections() -> None:
    index = field_index()  # raises on a duplicate
    for name in ("gpumem", "gpu_type", "vgpu_workarounds", "image_pull_secrets", "elastic_nodes"):
        assert index[name][0] == "cluster"


@pytest.mark.parametrize(("value", "mib"), [(12000, 12000), ("12000", 12000), ("12k", 12000),
                                            ("3k", 3000), (" 500 ", 500)])
def test_gpumem_is_integer_mib(value: Any, mib: int) -> None:
    assert parse_gpumem(value) == mib
    assert ClusterSpec(gpumem=value).gpumem == mib


@pytest.mark.parametrize(("value", "hint"), [
    ("8Gi", "write 8192"), ("3000M", "write 3000"), ("12G", "write 12000"), ("1.5Gi", "1536"),
    ("0", "at least 1"), (0, "at least 1"), ("-5", "integer"), ("lots", "integer"),
    (2_000_000, "more memory than any GPU"), (True, "MiB"),
])
def test_gpumem_rejects_units_hami_misreads(value: Any, hint: str) -> None:
    with pytest.raises(ValueError, match=hint):
        parse_gpumem(value)


@pytest.mark.parametrize(("cluster", "field"), [
    ({"gpucores": 101}, "gpucores"), ({"gpucores": -1}, "gpucores"),
    ({"gpumem_percentage": 0}, "gpumem_percentage"),
    ({"gpumem_percentage": 101}, "gpumem_percentage"),
    ({"gpus": -1}, "gpus"), ({"gpus": 0, "gpumem": 1000}, "gpumem needs gpus >= 1"),
    ({"gpumem": 1000, "gpumem_percentage": 50}, "not both"),
    ({"gpu_uuid": "GPU-123"}, "GPU UUID"), ({"gpu_policy": "fastest"}, "unknown policy"),
    ({"node_policy": "numa"}, "node_policy"), ({"vgpu_workarounds": "no-ib"}, "vgpu_workarounds"),
    ({"install_disttrain": "disttrain; rm -rf /"}, "pip requirement"),
    ({"pip_index_url": "ftp://x"}, "http"), ({"pip_index_url": "http://x"}, "install_disttrain"),
    ({"shm": "lots"}, "quantity"), ({"cpu": {"limit": "eight"}}, "quantity"),
    ({"namespace": "Team_A"}, "namespace"), ({"elastic_nodes": "4:1"}, "MIN:MAX"),
    ({"code": {"host_path": "/a", "pvc": "b"}}, "not both"),
    ({"code": {"configmap": True, "host_path": "/a"}}, "pick one"),
    ({"code": {"configmap": False}}, "neither"), ({"code": {"mount": "work"}}, "absolute"),
    ({"volumes": [{"name": "data", "mount": "/d"}]}, "exactly one"),
    ({"volumes": [{"name": "code", "pvc": "x", "mount": "/d"}]}, "used by disttrain"),
    ({"volumes": [{"name": "d", "pvc": "x", "mount": "/d", "create": True}]}, "size"),
    ({"add_capabilities": ["ALL; x"]}, "capability"),
])
def test_impossible_values_name_the_field(cluster: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        JobSpec.from_dict({"cluster": cluster})


def test_resources_in_order_as_strings() -> None:
    c = ClusterSpec(gpus=2, gpumem="12k", gpucores=30)
    assert hami.hami_resources(c) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "12000",
                                      "nvidia.com/gpucores": "30"}
    assert hami.hami_resources(ClusterSpec(gpus=0)) == {}


def test_annotations() -> None:
    c = ClusterSpec(gpu_type="A100, V100", gpu_policy="spread", node_policy="binpack")
    assert hami.hami_annotations(c) == {"nvidia.com/use-gputype": "A100,V100",
                                        "hami.io/gpu-scheduler-policy": "spread",
                                        "hami.io/node-scheduler-policy": "binpack"}


def test_every_workaround_names_its_hami_issue() -> None:
    from disttrain.spec.cluster import VGPU_WORKAROUNDS

    assert set(hami.WORKAROUNDS) == set(VGPU_WORKAROUNDS)
    for w in hami.WORKAROUNDS.values():
        assert w.issues and all(i.startswith("https://github.com/Project-HAMi/") for i in w.issues)


def _pod(scheduler: str | None, limits: dict[str, str], node: str | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "t", "resources": {"limits": limits}}]}
    if scheduler:
        spec["schedulerName"] = scheduler
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": "p", "annotations": annotations or {}}, "spec": spec}


def test_scheduler_warning_catches_pods_hami_did_not_place() -> None:
    vgpu = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}
    assert "default-scheduler" in hami.scheduler_warnings(_pod(None, vgpu))[0]
    assert "volcano" in hami.scheduler_warnings(_pod("volcano", vgpu))[0]
    bound_elsewhere = _pod("hami-scheduler", vgpu, node="n1")
    assert "without HAMi's allocation" in hami.scheduler_warnings(bound_elsewhere)[0]
    placed = _pod("hami-scheduler", vgpu, node="n1",
                  annotations={"hami.io/vgpu-devices-allocated": "GPU-x,NVIDIA,3000,0:;"})
    assert hami.scheduler_warnings(placed) == []
    assert hami.scheduler_warnings(_pod(None, {"cpu": "1"})) == []
    assert hami.scheduler_warnings(_pod("hami-scheduler", vgpu)) == []  # still pending
