"""Run a recipe (or another stand-in) as on a CPU with native bf16: the GPU report's rehearsal's stand-in for a GPU's
bf16, so that a row asking for bf16 trains in bf16 on any CPU and a fallback to fp32 is a failure there too.

    accelerate launch --mixed_precision bf16 tests/standins/native_bf16_on_cpu.py recipes/mnist_convnet.py ARGS

On a CPU without AMX or AVX512-BF16, ``make_accelerator`` runs a bf16 launch in fp32 (emulated bf16 is several times
slower). This script makes the capability check answer as an AMX CPU's does, and only that: torch still computes
bf16 autocast, emulated, so the rows are slower, never different in what they check."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common.train.accelerator as accelerator_module  # noqa: E402

if not accelerator_module.cpu_bf16_support():
    accelerator_module.cpu_bf16_support = lambda: "amx (stand-in: emulated bf16)"

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
