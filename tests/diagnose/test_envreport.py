"""`disttrain env`: what it reports, what it hides, and GPUs through a fake NVML."""

from __future__ import annotations

import json
import os
import types
from typing import Any

from disttrain.diagnose.envreport import MASK, collect, format_report, masked_env, nvml_report


def test_masks_secret_looking_names_and_url_passwords() -> None:
    env = {"HF_TOKEN": "hf_x", "NCCL_IB_KEY": "k", "TORCH_SECRET": "s",
           "HF_ENDPOINT": "https://user:pw@mirror.example/", "MASTER_ADDR": "10.0.0.1",
           "PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "nope", "RANK": "0",
           "CUDA_DEVICE_MEMORY_LIMIT_0": "12000m", "MY_PASSWORD": "p"}
    out = masked_env(env)
    assert out["HF_TOKEN"] == out["NCCL_IB_KEY"] == out["TORCH_SECRET"] == MASK
    assert out["HF_ENDPOINT"] == f"https://user:{MASK}@mirror.example/"
    assert out["MASTER_ADDR"] == "10.0.0.1" and out["RANK"] == "0"
    assert out["CUDA_DEVICE_MEMORY_LIMIT_0"] == "12000m"
    assert "PATH" not in out and "AWS_SECRET_ACCESS_KEY" not in out and "MY_PASSWORD" not in out
    assert list(out) == sorted(out)


def test_collect_reports_the_guide_commands() -> None:
    r = collect(env={"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_abc",
                     "CUDA_DEVICE_MEMORY_LIMIT_0": "8g", "CUDA_DEVICE_SM_LIMIT": "50"})
    assert r["distributed_available"] is True          # appendix B's python -c check
    assert r["torch"]["version"] and r["env"]["HF_TOKEN"] == MASK
    assert r["hami"]["detected"] and r["hami"]["memory_limit_mib"] == {"0": 8192}
    assert "hf_abc" not in json.dumps(r)
    text = format_report(r)
    assert "torch.distributed.is_available(): True" in text
    assert "memory limit GPU 0: 8192 MiB" in text and "SM limit: 50%" in text
    assert "hf_abc" not in text and "gpus" not in r


class FakeNVML:
    """Two GPUs; the first runs one training process and has two active NVLinks."""

    NVML_TEMPERATURE_GPU = 0
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, count: int = 2, fail_init: bool = False) -> None:
        self.count, self.fail_init, self.shutdown = count, fail_init, False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA GeForce RTX 3090"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=(9000 if h == 0 else 0) * 2**20, total=24576 * 2**20)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return types.SimpleNamespace(gpu=97 if h == 0 else 0, memory=40 if h == 0 else 0)

    def nvmlDeviceGetTemperature(self, h: int, kind: int) -> int:
        return 71

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 301500

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=8800 * 2**20)] if h == 0 \
            else []

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[Any]:
        raise RuntimeError("Not Supported")   # pmon samples are optional

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if h == 1:
            raise RuntimeError("Not Supported")
        return 1 if link < 2 else 0

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return 3


def test_gpus_through_nvml() -> None:
    nvml = FakeNVML()
    g = nvml_report(nvml)
    assert nvml.shutdown and g["available"] and g["driver"] == "550.54.15"
    assert g["cuda_driver"] == "12.4"
    d0, d1 = g["devices"]
    assert (d0["name"], d0["memory_used_mib"], d0["memory_total_mib"]) == (
        "NVIDIA GeForce RTX 3090", 9000, 24576)
    assert (d0["utilization_gpu"], d0["power_w"]) == (97, 301.5)
    assert d0["processes"] == [{"pid": os.getpid(), "name": d0["processes"][0]["name"],
                                "used_memory_mib": 8800, "sm_percent": None,
                                "mem_percent": None}]
    assert [x["active"] for x in d0["nvlink"]] == [True, True, False, False]
    assert d1["nvlink"] == [] and d1["processes"] == []
    text = format_report({**collect(env={}), "gpus": g})
    assert "GPU 0: NVIDIA GeForce RTX 3090 | 9000/24576 MiB | util 97%" in text
    assert "nvlink: link 0 v3, link 1 v3" in text and "no compute processes" in text


def test_no_gpu_is_said_plainly() -> None:
    g = nvml_report(FakeNVML(fail_init=True))
    assert g["available"] is False and g["devices"] == []
    assert g["reason"].startswith("no NVIDIA GPU here")
    zero = nvml_report(FakeNVML(count=0))
    assert zero["available"] is False and "no GPU is visible" in zero["reason"]
    text = format_report({**collect(env={}), "gpus": g})
    assert "no NVIDIA GPU here" in text


def test_real_nvml_on_this_machine() -> None:
    g = collect(env={}, gpus=True)["gpus"]
    assert g["available"] == bool(g["devices"])
    if not g["available"]:
        assert g["reason"]
