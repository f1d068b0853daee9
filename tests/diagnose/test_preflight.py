"""Preflight checks fail when they should, with fakes for every probe of the machine."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from disttrain.diagnose import preflight
from disttrain.diagnose.preflight import FAIL, OK, WARN, Probe, ifname_matches, run_checks
from disttrain.diagnose.system import Interface, TorchInfo, hami_limits, parse_limit

MiB = 2**20
IFACES = {"lo": Interface("lo", True, ("127.0.0.1", "::1")),
          "eth0": Interface("eth0", True, ("10.42.0.17",)),
          "docker0": Interface("docker0", False, ())}
GPU_TORCH = TorchInfo(version="2.4.1+cu121", cuda="12.1", cuda_available=True, device_count=2,
                      nccl="2.20.5", distributed=True,
                      backends={"gloo": True, "nccl": True, "mpi": False})
CPU_TORCH = TorchInfo(version="2.13.0+cpu", cuda=None, distributed=True,
                      backends={"gloo": True, "nccl": False})


def fake(**kw: Any) -> Probe:
    """A healthy 2-GPU pod; override what a test breaks."""
    base: dict[str, Any] = dict(
        env={}, torch=lambda: GPU_TORCH, gpu_count=lambda: 2, port_in_use=lambda port: False,
        port_owner=lambda port: None, resolve=lambda host, t: ["10.42.0.9"],
        connect=lambda addr, port, t: "open", interfaces=lambda: IFACES,
        shm=lambda: (2048 * MiB, 2000 * MiB), nofile=lambda: (65536, 65536),
        cpu_load=lambda: (0.4, 16), hostname=lambda: "trainer-0")
    base.update(kw)
    return Probe(**base)


def by_name(probe: Probe) -> dict[str, preflight.Check]:
    return {c.name: c for c in run_checks(probe)}


def test_healthy_pod_is_all_ok() -> None:
    checks = run_checks(fake(gpus=2, nproc_per_node=2))
    assert [c.status for c in checks] == [OK] * len(preflight.CHECKS), checks
    assert not preflight.failed(checks)


def test_taken_port_on_loopback_fails() -> None:
    """A real listener bound by the test on 127.0.0.1, probed by the real bind test."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        probe = fake(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                     port_in_use=preflight.system.port_in_use)
        c = by_name(probe)["master_port"]
    assert c.status == FAIL and str(port) in c.detail and f"MASTER_PORT={port + 1}" in c.fix
    assert preflight.failed(run_checks(fake(port_in_use=lambda p: True)))


def test_free_port_is_ok_and_remote_master_port_not_probed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    probe = fake(master_port=free, port_in_use=preflight.system.port_in_use)
    assert by_name(probe)["master_port"].status == OK
    probed: list[int] = []
    remote = fake(env={"MASTER_ADDR": "10.42.0.9", "MASTER_PORT": "29500"},
                  port_in_use=lambda p: probed.append(p) or True)
    assert by_name(remote)["master_port"].status == OK and probed == []


@pytest.mark.parametrize("value", ["abc", "70000"])
def test_bad_master_port(value: str) -> None:
    assert by_name(fake(env={"MASTER_PORT": value}))["master_port"].status == FAIL


def test_missing_interface_fails() -> None:
    c = by_name(fake(env={"NCCL_SOCKET_IFNAME": "eth2"}))["socket_ifname"]
    assert c.status == FAIL and "eth2" in c.detail and "eth0" in c.detail


def test_gloo_ifname_exclusion_syntax_fails() -> None:
    c = by_name(fake(env={"GLOO_SOCKET_IFNAME": "^lo,docker"}))["socket_ifname"]
    assert c.status == FAIL and "concrete" in c.fix


def test_ifname_ok_down_and_loopback_only() -> None:
    assert by_name(fake(env={"NCCL_SOCKET_IFNAME": "eth"}))["socket_ifname"].status == OK
    assert by_name(fake(env={"NCCL_SOCKET_IFNAME": "docker"}))["socket_ifname"].status == WARN
    lo = fake(env={"NCCL_SOCKET_IFNAME": "lo", "MASTER_ADDR": "10.42.0.9"})
    assert by_name(lo)["socket_ifname"].status == WARN


def test_ifname_syntax() -> None:
    names = ["docker0", "eth0", "eth1", "ib0", "lo"]
    assert ifname_matches("eth", names) == ["eth0", "eth1"]
    assert ifname_matches("=eth0", names) == ["eth0"]
    assert ifname_matches("^lo,docker", names) == ["eth0", "eth1", "ib0"]
    assert ifname_matches("^=eth0", names) == ["docker0", "eth1", "ib0", "lo"]


@pytest.mark.parametrize(("size", "status"), [(64 * MiB, FAIL), (512 * MiB, WARN),
                                              (2048 * MiB, OK)])
def test_shm_size(size: int, status: str) -> None:
    assert by_name(fake(shm=lambda: (size, size)))["shm"].status == status


def test_missing_shm_warns() -> None:
    assert by_name(fake(shm=lambda: None))["shm"].status == WARN


@pytest.mark.parametrize(("load", "status"), [((0.9, 2), OK), ((1.4, 2), WARN),
                                              ((5.5, 16), OK), (None, OK)])
def test_cpu_load(load: tuple[float, int] | None, status: str) -> None:
    check = by_name(fake(cpu_load=lambda: load))["cpu_load"]
    assert check.status == status
    assert ("--threads 1" in check.fix) is (status == WARN)


@pytest.mark.parametrize(("soft", "status"), [(256, FAIL), (1024, WARN), (65536, OK)])
def test_open_files(soft: int, status: str) -> None:
    assert by_name(fake(nofile=lambda: (soft, soft)))["open_files"].status == status


def test_fewer_gpus_than_requested_fails() -> None:
    checks = by_name(fake(gpus=4))
    assert checks["gpus"].status == FAIL and "hami-scheduler" in checks["gpus"].fix


def test_more_processes_than_gpus_fails() -> None:
    c = by_name(fake(nproc_per_node=4))["gpus"]
    assert c.status == FAIL and "Duplicate GPU" in c.fix


def test_cpu_build_with_gpus_requested() -> None:
    checks = by_name(fake(torch=lambda: CPU_TORCH, gpu_count=lambda: None, gpus=1))
    assert checks["torch"].status == FAIL and checks["torch.distributed"].status == FAIL
    cpu_ok = by_name(fake(torch=lambda: CPU_TORCH, gpu_count=lambda: None))
    assert cpu_ok["torch"].status == OK and "gloo" in cpu_ok["torch"].detail


def test_torch_missing() -> None:
    checks = by_name(fake(torch=lambda: TorchInfo(error="ModuleNotFoundError: torch")))
    assert checks["torch"].status == FAIL and checks["torch.distributed"].status == FAIL


def test_master_addr_unresolvable_unreachable_refused() -> None:
    def no_dns(host: str, t: float) -> list[str]:
        raise OSError("[Errno -2] Name or service not known")

    env = {"MASTER_ADDR": "trainer-0.trainer-svc", "MASTER_PORT": "29500"}
    assert by_name(fake(env=env, resolve=no_dns))["master_addr"].status == FAIL
    assert by_name(fake(env=env, connect=lambda a, p, t: "timeout"))["master_addr"].status == FAIL
    assert by_name(fake(env=env, connect=lambda a, p, t: "refused"))["master_addr"].status == WARN
    assert by_name(fake(env=env))["master_addr"].status == OK


def test_master_addr_connects_only_to_the_master() -> None:
    seen: list[tuple[str, int]] = []

    def connect(addr: str, port: int, t: float) -> str:
        seen.append((addr, port))
        return "open"

    run_checks(fake(env={"MASTER_ADDR": "trainer-1", "MASTER_PORT": "29400"}, connect=connect))
    assert seen == [("10.42.0.9", 29400)]
    seen.clear()
    run_checks(fake(env={"MASTER_ADDR": "localhost"}, connect=connect,
                    resolve=lambda h, t: ["127.0.0.1"]))
    assert seen == []


def test_real_resolver_is_bounded() -> None:
    with pytest.raises(OSError):
        preflight.system.resolve("no-such-host.invalid", 2.0)


def test_hami_limits_seen_in_container() -> None:
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": "12000m", "CUDA_DEVICE_MEMORY_LIMIT_1": "12g",
           "CUDA_DEVICE_SM_LIMIT": "30"}
    c = by_name(fake(env=env))["hami"]
    assert c.status == WARN and "GPU 0: 12000 MiB" in c.detail and "GPU 1: 12288 MiB" in c.detail
    assert "SM limit 30%" in c.detail
    assert by_name(fake())["hami"].status == OK


def test_hami_new_nccl_warns_about_cumem() -> None:
    new = TorchInfo(**{**GPU_TORCH.to_dict(), "nccl": "2.27.3"})
    env = {"CUDA_DEVICE_MEMORY_LIMIT_0": "12000m"}
    assert "NCCL_CUMEM_HOST_ENABLE=0" in by_name(fake(env=env, torch=lambda: new))["hami"].fix
    env["NCCL_CUMEM_HOST_ENABLE"] = "0"
    assert by_name(fake(env=env, torch=lambda: new))["hami"].status == OK


def test_parse_limit() -> None:
    assert parse_limit("12000m") == 12000 * MiB and parse_limit("1g") == 2**30
    assert parse_limit("4096") == 4096 and parse_limit("bogus") is None
    assert hami_limits({"CUDA_DEVICE_MEMORY_LIMIT_0": "0"})["memory_limit_mib"] == {"0": None}


def test_dist_env() -> None:
    assert by_name(fake(env={"RANK": "2", "WORLD_SIZE": "2"}))["dist_env"].status == FAIL
    assert by_name(fake(env={"RANK": "x"}))["dist_env"].status == FAIL
    gpu = fake(gpus=2, env={"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"})
    assert by_name(gpu)["dist_env"].status == FAIL
    assert by_name(fake(env={"RANK": "1", "WORLD_SIZE": "2"}))["dist_env"].status == OK


def test_a_broken_probe_reports_fail_not_crash() -> None:
    def broken() -> tuple[int, int]:
        raise RuntimeError("statvfs exploded")

    c = by_name(fake(shm=broken))["shm"]
    assert c.status == FAIL and "statvfs exploded" in c.detail


def test_real_machine_runs() -> None:
    """The default probes work on this machine (whatever their verdicts)."""
    checks = run_checks(Probe(timeout_s=0.5))
    assert [c.name for c in checks][:3] == ["torch", "torch.distributed", "gpus"]
    assert all(c.status in (OK, WARN, FAIL) for c in checks)
