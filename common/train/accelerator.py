"""The Accelerator every recipe uses, and the startup line that says what the launcher really gave.

    accelerator, note = make_accelerator(cfg)
    print(startup_line(accelerator, cfg, steps_per_epoch, note))

Launcher concerns (process count, precision, machines) come from ``accelerate launch`` and its config,
never from the recipe. Two traps are handled here (docs/launchers.md):

- On a machine with no GPU the Accelerator is told ``cpu=True``: under a multi-process launch
  (torchrun) that is what makes the processes join one gloo group instead of silently running N
  independent single-process jobs.
- ``accelerate launch --cpu`` (or a config with ``use_cpu: true``) asking for several processes starts
  ONE process unless MPI is installed. The recipe sees that (the launcher set a rendezvous address but
  started no process group) and warns in one line.
- fp16 on a CPU is not real fp16 training: warn and use bf16.
- bf16 on a CPU pays only where the CPU computes it natively (AMX or AVX512-BF16: about 1.75x fp32 for
  these models); elsewhere it is emulated and several times slower than fp32 (a 512x512 matmul was 10x
  slower on an AVX2-only CPU). The CPU configs ask for bf16; on a CPU without native bf16 the run uses
  fp32 and says so in the startup line, which also shows what the CPU has.
- bf16 on a GPU without native bf16 (compute capability under 8.0: T4, V100) is emulated and has no cuDNN
  convolutions: the run uses fp32 and says so, naming the fp16 config that fits such a GPU.
- On a GPU ``cudnn.benchmark`` follows --cudnn-benchmark (on by default): the recipes' batch shapes are fixed, so
  cuDNN's kernel search pays once; benchmarks/gpu_report.py's ab/ rows measure it on and off.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import lru_cache

import torch

from common.data.batches import per_process_batch
from common.errors import RecipeError
from common.train.tracking import log_with

CPU_2PROC_CONFIG = "accelerate_configs/cpu_2proc.yaml"


def has_accelerator_device() -> bool:
    """A GPU Accelerate would train on: CUDA, Intel XPU, or a Mac's (MPS, by Accelerate's own test)."""
    from accelerate.utils import is_mps_available

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()) or is_mps_available()


def mps_bf16() -> bool:
    """Whether this Mac's GPU computes bf16: macOS 14 or later, the rule of Accelerate's ``is_bf16_available`` for MPS
    (asked directly: that function finds the device through ``torch.accelerator``, which a CUDA build without a GPU
    answers otherwise)."""
    return bool(torch.backends.mps.is_macos_or_newer(14, 0))


@lru_cache(maxsize=1)
def cpu_bf16_support() -> str:
    """'amx' or 'avx512_bf16' when this CPU computes bf16 natively (bf16 autocast then pays), else ''."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ""
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else ""


def gpu_bf16_native() -> bool:
    """Whether this CUDA GPU computes bf16 natively (compute capability 8.0 and up: A100, H100, RTX 30xx and later).
    ``torch.cuda.is_bf16_supported()`` also says yes on a T4 or V100, where bf16 is emulated and cuDNN has no bf16
    convolutions; its ``including_emulation=False`` and the capability both say no there."""
    return torch.cuda.get_device_capability(torch.cuda.current_device()) >= (8, 0)


def lost_processes_note() -> str:
    """Non-empty when the launcher was asked for several processes but started only this one."""
    single = "WORLD_SIZE" not in os.environ and not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    if single and os.environ.get("MASTER_PORT") and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true"):
        return (
            f"the launch config asks for several CPU processes but without MPI `accelerate launch --cpu` starts "
            f"one: this run has 1 process. Use --config_file {CPU_2PROC_CONFIG} for real multi-process CPU training"
        )
    return ""


def _launcher_args() -> list[str]:
    """The parent's command line when it is `accelerate launch`, else []."""
    try:
        args = open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode(errors="replace").split("\0")
    except OSError:  # no /proc (macOS)
        return []
    return args if any(a.endswith("accelerate") for a in args[:2]) and "launch" in args else []


def _launcher_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` on the launcher's command line (``--flag V`` or ``--flag=V``, with hyphens or underscores
    as `accelerate launch` takes either: ``--num-processes``), or None. Only the launcher's own options count: those
    before the script (after it they are the recipe's)."""

    def spelled(option: str) -> str:
        return "--" + option[2:].replace("-", "_") if option.startswith("--") else option

    for i, a in enumerate(args):
        if a.endswith(".py"):
            break
        if spelled(a.split("=", 1)[0]) == spelled(flag):
            return a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _config_processes(path: str | None):
    """num_processes of the launcher's config file (``path``, else `accelerate config`'s default), or None."""
    import yaml
    from accelerate.commands.config import default_config_file

    try:
        with open(path or default_config_file) as f:
            config = yaml.safe_load(f)  # `accelerate config` writes YAML, `accelerate config default` JSON
    except (OSError, yaml.YAMLError):
        return None
    return config.get("num_processes") if isinstance(config, dict) else None


def idle_cores_note(cpu: bool) -> str:
    """On a machine without a GPU, a launch that leaves CPU cores idle, with what to run instead ('' otherwise):
    `accelerate launch --num_processes N` starts one process there, and `accelerate launch` sets OMP_NUM_THREADS=1,
    so a single process trains on one core of several."""
    if not cpu or "WORLD_SIZE" in os.environ:  # a real multi-process job: its launcher chose processes and threads
        return ""
    args = _launcher_args()
    if not args:
        return ""
    asked, source = _launcher_value(args, "--num_processes"), "--num_processes {}"
    if asked is None:  # the launcher's config file (--config_file, else the one `accelerate config` wrote)
        asked = _config_processes(_launcher_value(args, "--config_file"))
        source = "a config file with num_processes: {}"
    asked = str(asked or "1")
    cores = len(os.sched_getaffinity(0))
    if asked.isdigit() and int(asked) > 1:
        return (
            f"`accelerate launch` with {source.format(asked)} starts one process on a machine without a GPU: this "
            f"run has 1 process at {torch.get_num_threads()} thread(s). For {asked} CPU processes run "
            f"`accelerate launch --config_file {CPU_2PROC_CONFIG} ...` (gloo)"
        )
    if torch.get_num_threads() < cores and os.environ.get("OMP_NUM_THREADS") == "1":
        return (
            f"this process runs on 1 of the {cores} CPU cores (accelerate launch sets OMP_NUM_THREADS=1). To "
            f"use them all: `accelerate launch --num_cpu_threads_per_process {cores} ...`, or 2 processes with "
            f"`--config_file {CPU_2PROC_CONFIG}`"
        )
    return ""


PRECISIONS = ("no", "fp16", "bf16", "fp8")
SHARDING = {  # the environment `accelerate launch` sets for an answer, and the answer as `accelerate config` asks it
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
DDP_INSTEAD = (
    "launch with DDP instead (accelerate_configs/multi_gpu_bf16.yaml, or answer `accelerate config`'s distributed "
    "question with multi-GPU and no to FSDP and DeepSpeed)"
)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def fsdp_asked(cfg, cpu: bool, precision: str) -> bool:
    """True when the launcher asks for FSDP (``accelerate launch --use_fsdp``, a config with distributed_type: FSDP,
    ACCELERATE_USE_FSDP=true) and this run shards with it: FSDP version 2, a recipe whose Config says it shards
    (``shards = True``: the photo recipe, whose models grow past one GPU), on GPUs. Otherwise one paragraph naming
    what to launch instead, before anything is read."""
    env = os.environ
    if not _truthy(env.get("ACCELERATE_USE_FSDP")):
        return False
    version = env.get("FSDP_VERSION", "1").strip()
    asked = "The launcher asks for FSDP (ACCELERATE_USE_FSDP=true: `accelerate config`'s FSDP answer, `accelerate "
    asked += "launch --use_fsdp` or a config with distributed_type: FSDP)"
    if version != "2":
        raise RecipeError(
            f"{asked} in version {version} (FSDP_VERSION={version}; 1 is Accelerate's default when the version is "
            "not given). The recipes shard with FSDP version 2 only (torch's fully_shard): add --fsdp_version 2 to "
            "`accelerate launch`, or fsdp_version: 2 under fsdp_config in the config file."
        )
    if not getattr(cfg, "shards", False):
        raise RecipeError(
            f"{asked}, which this recipe does not take: its model is a few megabytes, a whole copy of which fits "
            "every GPU, and sharding it would only add communication. FSDP is for models too large for one GPU: "
            f"the photo recipe (recipes/finetune_folder.py) shards with it. Here, {DDP_INSTEAD}."
        )
    if cpu:
        raise RecipeError(
            f"{asked} on a machine without a GPU. Accelerate shards with FSDP on GPUs only: on a CPU it would "
            "silently train plain DDP, a whole copy of the model per process, while the run said FSDP. On a CPU, "
            f"launch with --config_file {CPU_2PROC_CONFIG} (DDP over gloo); keep the FSDP answer for GPUs."
        )
    clashes = []
    if getattr(cfg, "ema_decay", 0):
        clashes.append("--ema-decay (the average is a whole copy of the model on every process: use --ema-decay 0)")
    if cfg.eval_only:
        clashes.append(
            "--eval-only (it scores one whole weights file, best/ or final/: launch it without the FSDP answer)"
        )
    if precision == "fp16":
        clashes.append(
            "fp16 (its loss scaler is not sharded with FSDP2 here: use --mixed_precision bf16, or fp32 on a GPU "
            "without native bf16)"
        )
    if clashes:
        raise RecipeError(f"{asked} together with {'; and with '.join(clashes)}. Nothing was read or written.")
    return True


def launcher_answers(cfg, cpu: bool | None = None) -> tuple[str, list[str], bool]:
    """What the launcher asked for (its config file, its flags and ACCELERATE_* variables all arrive here as the
    environment), checked before anything is read: the precision (any letter case), refused in one paragraph where
    the recipes would not do what it says; gradient accumulation asked of Accelerate taken as --grad-accum; FSDP
    (``fsdp_asked``). Returns the precision, the notes for the startup line and whether the model is sharded."""
    env = os.environ
    cpu = not has_accelerator_device() if cpu is None else cpu
    for variable, answer in SHARDING.items():
        if _truthy(env.get(variable)):
            raise RecipeError(
                f"The launcher asks for {answer} ({variable}=true: `accelerate config`'s {answer} answer, "
                f"`accelerate launch --use_{answer.lower().replace('-', '_')}` or a config with distributed_type: "
                f"{answer.upper().replace('-', '_')}), which these recipes do not run: it is not among their "
                "requirements, and on a CPU Accelerate would silently train plain DDP instead. To shard a large "
                "photo model over GPUs, the photo recipe takes FSDP version 2 (`accelerate launch --use_fsdp "
                f"--fsdp_version 2`); every other model here fits one GPU whole: {DDP_INSTEAD}."
            )
    asked = env.get("ACCELERATE_MIXED_PRECISION", "no")
    precision = asked.strip().lower()
    if precision not in PRECISIONS:
        raise RecipeError(
            f"ACCELERATE_MIXED_PRECISION={asked!r} is not a precision Accelerate knows: use no, bf16 or fp16 "
            "(accelerate launch --mixed_precision bf16), or leave it unset."
        )
    if precision == "fp8":
        raise RecipeError(
            "The launcher asks for fp8 (--mixed_precision fp8), which these recipes do not train in: their models "
            "are convolutional, and Accelerate's fp8 backends (torchao, Transformer Engine, MS-AMP) convert linear "
            "layers only, so nearly all the compute would stay in bf16 while the run said fp8. Use bf16 "
            "(accelerate_configs/multi_gpu_bf16.yaml, or --mixed_precision bf16)."
        )
    notes = []
    from_env = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    from_flag = _launcher_value(_launcher_args(), "--gradient_accumulation_steps")
    source = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" if from_env else "accelerate launch --gradient_accumulation_steps"
    steps = from_env or from_flag
    if steps is not None:
        if not steps.strip().isdigit() or int(steps) < 1:
            raise RecipeError(f"{source} is {steps!r}: gradient accumulation takes a whole number of steps, 1 or more.")
        steps = int(steps)
        if steps != cfg.grad_accum and "grad_accum" in getattr(cfg, "explicit", ()):
            raise RecipeError(
                f"The launcher asks for gradient accumulation over {steps} steps ({source}) and the recipe's "
                f"--grad-accum {cfg.grad_accum}: one run cannot do both. Keep one of them (the recipe's flag, "
                "--grad-accum, is the one recorded with the run)."
            )
        if steps != cfg.grad_accum:
            cfg.grad_accum = steps
            cfg.explicit = {*getattr(cfg, "explicit", ()), "grad_accum"}  # recorded and compared on resume as given
            notes.append(
                f"gradient accumulation over {steps} steps from the launcher ({source}), as --grad-accum {steps}"
            )
    return precision, notes, fsdp_asked(cfg, cpu, precision)


def ask_lomo_once() -> None:
    """Accelerate's ``AcceleratedOptimizer.step`` asks ``is_lomo_available()`` twice at every step, each time an
    uncached ``importlib.util.find_spec("lomo_optim")`` and a metadata read: about 0.4 ms of every step on a 2-core
    CPU, where a small model's whole step on a GPU takes a few milliseconds (docs/results.md). Whether a
    package is installed does not change while a run trains: asked once here, the answer is what Accelerate's
    modules get from then on."""
    import accelerate.accelerator
    import accelerate.optimizer
    from accelerate.utils import is_lomo_available

    answer = is_lomo_available()
    for module in (accelerate.optimizer, accelerate.accelerator):
        module.is_lomo_available = lambda: answer


def make_accelerator(cfg, launch=None):
    """Build the Accelerator from ``cfg`` (its --seed and --grad-accum: a resume has taken the run's own by now) and
    ``launch``, what ``launcher_answers`` returned (read here when not given). Returns (accelerator, note), the note
    being '' or a one-line warning."""
    from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration, is_mps_available

    cpu = not has_accelerator_device()
    precision, notes, sharded = launch if launch is not None else launcher_answers(cfg, cpu)
    notes = list(notes)
    notes.insert(0, lost_processes_note())
    if cpu and precision == "fp16":
        precision = "bf16"
        notes.append("fp16 was asked for but this is a CPU: using bf16 instead")
    if cpu and precision == "bf16" and not cpu_bf16_support():
        precision = "no"
        notes.append(
            "bf16 was asked for but this CPU has no native bf16 (no AMX or AVX512-BF16), where it runs "
            "several times slower than fp32: using fp32 instead"
        )
    if not cpu and precision == "bf16" and torch.cuda.is_available() and not gpu_bf16_native():
        precision = "no"
        notes.append(
            f"bf16 was asked for but {torch.cuda.get_device_name()} has no native bf16 (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}; bf16 needs 8.0+): using fp32 instead. For "
            "mixed precision on this GPU use fp16: accelerate_configs/multi_gpu_fp16.yaml"
        )
    if not cpu and precision == "bf16" and not torch.cuda.is_available() and is_mps_available() and not mps_bf16():
        precision = "no"
        notes.append(
            "bf16 was asked for but this Mac's GPU (MPS) takes bf16 from macOS 14 on: using fp32 instead. For mixed "
            "precision on it use fp16 (accelerate launch --mixed_precision fp16)"
        )
    ask_lomo_once()
    if not cpu:  # the recipes' shapes are fixed within a run: cuDNN may pick its fastest kernels once per shape
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    # said once, by the main process: in the startup line (with --eval-only, a NOTE line of its own)
    note = "; ".join(n for n in (*notes, idle_cores_note(cpu)) if n)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum),
        # non_blocking: pinned batches copied to a GPU without waiting for it (on a CPU the copy is a no-op)
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=True),
        step_scheduler_with_optimizer=False,  # the loop steps the scheduler once per optimizer step
        log_with=log_with(cfg.report_to) or None,  # pointed at the run directory once all ranks agree on it
        project_config=ProjectConfiguration(project_dir="."),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s))],
    )
    if sharded:
        require_fsdp2(accelerator)
        note = "; ".join(n for n in (note, whole_on_every_process(accelerator)) if n)
    return accelerator, note


def whole_on_every_process(accelerator) -> str:
    """FSDP2 starts from the model every process builds whole (the same seed, the same --weights), so Accelerate's
    "CPU RAM efficient loading" (the model's weights read on the main process only and sent to the others) is turned
    off: it adds nothing here, and Accelerate's loader fails on a model with buffers (BatchNorm's statistics)."""
    plugin = accelerator.state.fsdp_plugin
    if not plugin.cpu_ram_efficient_loading:
        return ""
    plugin.cpu_ram_efficient_loading = False
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"  # transformers reads it too: every rank loads weights
    return (
        "fsdp_cpu_ram_efficient_loading is off: every process builds the model whole from the same seed and weights "
        "before it is sharded"
    )


def require_fsdp2(accelerator) -> None:
    """The launcher's FSDP answer is what Accelerate set up (it keeps plain DDP, or one process, where it cannot)."""
    if not accelerator.is_fsdp2:
        raise RecipeError(
            f"The launcher asks for FSDP version 2, but Accelerate set up {accelerator.distributed_type.value} with "
            f"{accelerator.num_processes} process(es) on {accelerator.device.type}, which would train a whole copy of "
            "the model per process. FSDP runs under `accelerate launch` with GPUs (--use_fsdp --fsdp_version 2, or "
            "a config with distributed_type: FSDP): launch it that way, or without the FSDP answer."
        )


def startup_line(accelerator, cfg, steps_per_epoch: int, note: str = "", sharded: str = "") -> str:
    dev = accelerator.device
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    elif dev.type == "mps":
        name = "Apple GPU, Metal Performance Shaders"
    elif dev.type != "cpu":
        name = dev.type
    else:
        native = cpu_bf16_support()
        name = f"cpu x{torch.get_num_threads()} threads, " + (f"native bf16: {native}" if native else "no native bf16")
    parts = [
        f"processes={accelerator.num_processes}",
        f"distributed={accelerator.distributed_type.value}",
        f"backend={getattr(accelerator.state, 'backend', None) or 'none'}",
        f"device={dev.type} ({name})",
        f"precision={accelerator.mixed_precision}",
        f"global_batch={cfg.batch_size}",
        f"per_process_batch={per_process_batch(cfg, accelerator.num_processes)}",
        f"grad_accum={cfg.grad_accum}",
        f"steps_per_epoch={steps_per_epoch}",
        # where the peak LR came from (common.schedules.LRRule.follow): a batch the LR was not tuned at is the
        # first thing to suspect when a run diverges or crawls
        f"lr={cfg.lr:g}" + (f" ({cfg.lr_note})" if getattr(cfg, "lr_note", "") else ""),
        *([sharded] if sharded else []),
    ]
    return "startup: " + " ".join(parts) + (f" NOTE: {note}" if note else "")


def on_main(accelerator, fn):
    """Run ``fn`` on the main process; its result, or its RecipeError, reaches every rank."""
    from accelerate.utils import broadcast_object_list

    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except RecipeError as err:
            error = err
    if accelerator.num_processes > 1:
        box = [result, None if error is None else str(error)]
        broadcast_object_list(box, from_process=0)
        result, error = box[0], error or (RecipeError(box[1]) if box[1] is not None else None)
    if error is not None:
        raise error
    return result
