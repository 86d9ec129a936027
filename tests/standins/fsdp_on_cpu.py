"""Run a recipe under FSDP version 2 on CPU processes: the stand-in for GPUs (GUIDE section 7).

    accelerate launch --config_file <FSDP2 config> tests/standins/fsdp_on_cpu.py recipes/finetune_folder.py ARGS

Accelerate sets FSDP up on GPUs only (on a CPU it keeps plain DDP, and the recipes refuse the answer there); torch's
``fully_shard`` itself runs on CPU processes over gloo. This script lets the recipe's own checks pass as on a GPU and
puts Accelerate's state where a GPU launch leaves it (distributed type FSDP, the plugin the launcher's answers make),
then runs the recipe unchanged: the sharding, Accelerate's sharded save_state/load_state, the gathered best/ and
final/, all as on GPUs."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common.train.accelerator as accelerator_module  # noqa: E402

checks = accelerator_module.fsdp_asked


def fsdp_asked(cfg, cpu, precision):
    return checks(cfg, False, precision)  # every other check as on a GPU


def require_fsdp2(accelerator):
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* answers, as Accelerator() makes it
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    for shared in (PartialState._shared_state, accelerator.state._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2 and accelerator.num_processes >= 1


accelerator_module.fsdp_asked = fsdp_asked
accelerator_module.require_fsdp2 = require_fsdp2
# fp32 here, whatever the launcher asked: CPU autocast keeps ops in fp32 that CUDA's runs in bf16, so on a CPU with
# native bf16 a model whose parameters FSDP2's mixed-precision policy made bf16 meets fp32 activations (BatchNorm:
# "expected scalar type BFloat16 but found Float"). bf16 under FSDP2 is for the GPU report's row to show.
os.environ["ACCELERATE_MIXED_PRECISION"] = "no"

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
