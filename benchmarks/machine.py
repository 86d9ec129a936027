"""What a measurement ran on, for the benchmarks' reports: the CPU model and the instruction-set flags that
decide bf16 speed, the GPU, the load average, the library versions; and a free local port for a launch.

    report = {"machine": {**machine_info("cpu"), "load_average_end": load_average()}, "versions": versions()}
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from pathlib import Path

# the flags that say whether bf16 is native (AMX, AVX512-BF16) or emulated (AVX2 only)
CPU_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_info() -> tuple[str, list[str]]:
    """The CPU model and which of CPU_FLAGS it has, from /proc/cpuinfo (imports nothing: a script timed from its
    launch can call it)."""
    cpu_model, flags = platform.processor(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    return cpu_model, sorted(flags & CPU_FLAGS)


def machine_info(device) -> dict:
    """Host, CPU model and flags, usable CPUs, torch threads and, on ``device`` "cuda", the GPU."""
    import torch

    from common.train.accelerator import cpu_bf16_support

    device = torch.device(device)
    cpu_model, flags = cpu_info()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_flags": flags,
        "cpu_bf16_support": cpu_bf16_support() or "none (emulated)",
        "torch_num_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if device.type == "cuda" else 0,
    }


def versions() -> dict:
    import accelerate
    import torch
    import torchvision

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "torchvision": torchvision.__version__,
    }


def load_average():
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
