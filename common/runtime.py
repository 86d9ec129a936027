"""Process-level plumbing every recipe needs: the Accelerator, the run directory, the startup line,
metric logging, stop signals and the per-step guard. No training logic lives here."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import warnings
from datetime import datetime, timedelta
from pathlib import Path

import torch

EXIT_BAD_INPUT = 2      # bad data, config or checkpoint: one paragraph on stderr
EXIT_NONFINITE = 3      # the loss became NaN/inf; nothing written after the last good checkpoint
EXIT_TARGET_MISSED = 4  # --target-accuracy was not reached
EXIT_PREEMPTED = 75     # stopped by SIGTERM/SIGINT/SIGUSR1 after writing a checkpoint; rerun to resume


class RecipeError(Exception):
    """An error the user can fix; printed as one paragraph, no traceback."""

    exit_code = EXIT_BAD_INPUT


class NonFiniteLoss(RecipeError):
    exit_code = EXIT_NONFINITE


def has_accelerator_device() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def make_accelerator(cfg):
    """Build the Accelerator. Returns (accelerator, precision_note).

    - On a machine with no GPU the Accelerator is told ``cpu=True``: under a multi-process launch that
      is what makes it start gloo instead of silently running N independent single-process jobs.
    - fp16 on a CPU is not real fp16 training: warn and fall back to bf16.
    """
    from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    cpu = not has_accelerator_device()
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    precision, note = asked, ""
    if cpu and asked == "fp16":
        precision, note = "bf16", "fp16 was asked for but this is a CPU: using bf16 instead"
        warnings.warn(note)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                  non_blocking=not cpu),
        step_scheduler_with_optimizer=False,  # the loop steps the scheduler once per optimizer step
        log_with="tensorboard",  # the run directory is set once all ranks agree on it
        project_config=ProjectConfiguration(project_dir="."),  # placeholder, replaced before logging starts
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s))],
    )
    return accelerator, note


def set_run_dir(accelerator, run_dir: Path) -> None:
    """Point Accelerate's project (and its TensorBoard tracker) at the run directory."""
    accelerator.project_configuration.set_directories(str(run_dir))
    accelerator.project_configuration.logging_dir = str(run_dir)


def distributed_info():
    """(rank, world_size) from the launcher's environment, before any Accelerator exists."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def fail(err: Exception) -> None:
    """Print a RecipeError (or a data/config error) as one paragraph and exit with its code."""
    rank, world = distributed_info()
    prefix = f"[rank {rank}] " if world > 1 else ""
    sys.stderr.write(f"{prefix}error: {err}\n")
    sys.stderr.flush()
    raise SystemExit(getattr(err, "exit_code", EXIT_BAD_INPUT))


# --- run directory -------------------------------------------------------------------------------

RUN_MARKERS = ("config.json", "checkpoints", "metrics.jsonl")


def resolve_run_dir(cfg, recipe: str, stamp: str) -> tuple[Path, bool]:
    """Decide the run directory and whether we resume. Call it on the main process only and share the
    answer (``share_from_main``): other ranks could see the directory the main process just made."""
    from common.checkpoint import find_latest, is_complete

    if cfg.resume_from and cfg.resume_from != "latest":
        ckpt = Path(cfg.resume_from).expanduser()
        if not is_complete(ckpt):
            raise RecipeError(
                f"--resume-from {cfg.resume_from} is not a complete checkpoint (no such folder, or it lacks the "
                "completion marker because its write was interrupted). Pass --resume-from latest to pick the "
                "newest complete one, or another checkpoint folder under <run>/checkpoints/.")
        run_dir = Path(cfg.output_dir).expanduser() if cfg.output_dir else ckpt.parent.parent
        return run_dir, True
    if cfg.output_dir:
        run_dir = Path(cfg.output_dir).expanduser()
    else:
        if cfg.resume_from == "latest":
            raise RecipeError("--resume-from latest needs --output-dir <run directory> to know which run to "
                              "continue. Pass the same --output-dir as the run you want to resume.")
        run_dir = Path("runs") / f"{recipe}-{stamp}"
    if cfg.resume_from == "latest":
        return run_dir, find_latest(run_dir) is not None
    if run_dir.exists() and any((run_dir / m).exists() for m in RUN_MARKERS):
        raise RecipeError(
            f"The output directory {run_dir} already holds a run. Nothing was overwritten. Pass "
            "--resume-from latest to continue that run, or choose a new --output-dir.")
    return run_dir, False


def shared_stamp(accelerator) -> str:
    """A timestamp chosen by the main process and shared with all ranks."""
    from accelerate.utils import broadcast_object_list

    box = [datetime.now().strftime("%Y%m%d-%H%M%S")]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]


# --- startup line --------------------------------------------------------------------------------

def startup_line(accelerator, cfg, per_process_batch: int, steps_per_epoch: int, note: str) -> str:
    dev = accelerator.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    backend = getattr(accelerator.state, "backend", None) or "none"
    parts = [
        f"processes={accelerator.num_processes}",
        f"distributed={accelerator.distributed_type.value}",
        f"backend={backend}",
        f"device={dev.type} ({name})",
        f"precision={accelerator.mixed_precision}",
        f"global_batch={cfg.batch_size}",
        f"per_process_batch={per_process_batch}",
        f"grad_accum={cfg.grad_accum}",
        f"steps_per_epoch={steps_per_epoch}",
    ]
    line = "startup: " + " ".join(parts)
    return line + (f" NOTE: {note}" if note else "")


def per_process_batch(cfg, num_processes: int) -> int:
    div = num_processes * cfg.grad_accum
    if cfg.batch_size % div:
        raise RecipeError(
            f"--batch-size {cfg.batch_size} is the global batch and must split evenly over {num_processes} "
            f"process(es) x {cfg.grad_accum} accumulation step(s) (= {div}); it leaves "
            f"{cfg.batch_size / div:g} per process. Pass a multiple of {div}, e.g. --batch-size "
            f"{max(div, cfg.batch_size // div * div)}.")
    return cfg.batch_size // div


# --- logging -------------------------------------------------------------------------------------

class MetricsLog:
    """TensorBoard (through Accelerate's tracker, main process only) plus metrics.jsonl."""

    def __init__(self, accelerator, run_dir: Path, resume_step: int | None):
        self.accelerator = accelerator
        self.path = run_dir / "metrics.jsonl"
        if accelerator.is_main_process:
            kwargs = {}
            if resume_step is not None:
                kwargs["purge_step"] = resume_step + 1  # hide events a crashed run logged past the checkpoint
                self._truncate_after(resume_step)
            accelerator.init_trackers("tensorboard", init_kwargs={"tensorboard": kwargs})

    def _truncate_after(self, step: int):
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(k + "\n" for k in keep))

    @property
    def writer(self):
        return self.accelerator.get_tracker("tensorboard", unwrap=True) if self.accelerator.is_main_process else None

    def log(self, values: dict, step: int):
        if not self.accelerator.is_main_process:
            return
        values = {k: float(v) for k, v in values.items()}
        self.accelerator.log(values, step=step)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")

    def hparams(self, hparams: dict, metrics: dict):
        """One HParams session in the main event file: the sanitized config and the final metrics."""
        if not self.accelerator.is_main_process:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        writer = self.writer
        exp, ssi, sei = hparams_summary(hparams, metrics)
        fw = writer._get_file_writer()
        for summary in (exp, ssi, sei):
            fw.add_summary(summary)

    def close(self):
        if self.accelerator.is_main_process:
            self.accelerator.end_training()


# --- signals and the per-step guard --------------------------------------------------------------

class StopRequest:
    """SIGTERM / SIGINT / SIGUSR1 set a flag; the loop finishes its step, checkpoints and exits."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)):
            if sig is not None:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


class StepGuard:
    """One tiny all-reduce per micro-step carries (non-finite loss?, stop requested?, loss): every rank
    learns at the same step that it must stop, and the logged loss is the mean over processes."""

    def __init__(self, accelerator, stop: StopRequest, fp16: bool):
        self.accelerator, self.stop, self.fp16 = accelerator, stop, fp16

    def check(self, loss: torch.Tensor) -> tuple[bool, bool, float]:
        """Returns (any_nonfinite, any_stop, mean_loss) agreed by all ranks."""
        detached = loss.detach().float()
        packed = torch.stack([(~torch.isfinite(detached)).float(),
                              torch.tensor(float(self.stop.signum != 0), device=detached.device),
                              torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0)])
        packed = self.accelerator.reduce(packed, reduction="sum")
        nonfinite, stop, loss_sum = packed.tolist()
        return nonfinite > 0, stop > 0, loss_sum / self.accelerator.num_processes


class Throughput:
    """What the recipes log every --log-every steps besides loss and LR: global samples/s, the share of
    wall time spent waiting for data, the mean gradient norm, and peak memory."""

    def __init__(self, device=None):
        self.device = device
        self.t0 = time.perf_counter()
        self.samples = 0
        self.data_wait = 0.0
        self.norm_sum, self.norms = None, 0

    def add(self, n: int, wait: float):
        self.samples += n
        self.data_wait += wait

    def add_grad_norm(self, norm):
        """The total gradient norm of one optimizer step (a tensor: no device sync until it is logged)."""
        norm = torch.as_tensor(norm).detach().float()
        self.norm_sum = norm if self.norm_sum is None else self.norm_sum + norm
        self.norms += 1

    def read_and_reset(self) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        out = {"train/samples_per_sec": self.samples / elapsed, "train/data_wait_fraction": self.data_wait / elapsed}
        if self.norms:
            out["train/grad_norm"] = self.norm_sum.item() / self.norms
        if self.device is not None:
            out["train/peak_memory_mb"] = peak_memory_mb(self.device)
        self.t0, self.samples, self.data_wait, self.norm_sum, self.norms = now, 0, 0.0, None, 0
        return out


def peak_memory_mb(device) -> float:
    """Peak CUDA memory allocated by this process, or its peak resident set size (RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:  # pragma: no cover
        return math.nan


def show_progress(accelerator) -> bool:
    """Progress bars on the local main process only, and only on a terminal (not in log files)."""
    return accelerator.is_local_main_process and sys.stderr.isatty()


class StepProfiler:
    """--profile N: skip one optimizer step, warm up one, then record N with the PyTorch profiler. Each
    rank writes a trace to <run dir>/profile (TensorBoard's PyTorch Profiler plugin, torch-tb-profiler,
    shows it; so do Perfetto and chrome://tracing). Does nothing when N is 0."""

    def __init__(self, accelerator, steps: int, run_dir: Path):
        self.prof, self.accelerator = None, accelerator
        if not steps:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else [])
        self.dir, self.steps, self.left = run_dir / "profile", steps, steps + 2
        self.prof = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                            on_trace_ready=tensorboard_trace_handler(str(self.dir),
                                                                     worker_name=f"rank{accelerator.process_index}"),
                            record_shapes=True)
        self.prof.start()

    def step(self):
        if self.prof is None:
            return
        self.prof.step()
        self.left -= 1
        if self.left <= 0:
            self.close()
            self.accelerator.print(f"profiler: trace of {self.steps} optimizer step(s) per process written to "
                                   f"{self.dir} (tensorboard --logdir {self.dir.parent}, PyTorch Profiler tab)")

    def close(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


# --- main process first --------------------------------------------------------------------------

def share_from_main(accelerator, fn, others_run: bool = False):
    """Run ``fn`` on the main process first. Its result (``others_run=False``) or its error reaches
    every rank, so a bad input stops all ranks with the same message instead of leaving them waiting
    in a barrier. With ``others_run=True`` the other ranks then call ``fn`` themselves (e.g. to read
    the cache the main process just wrote)."""
    from accelerate.utils import broadcast_object_list

    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except RecipeError as err:
            error = err
        except Exception as err:  # data/config errors carry their own types
            if type(err).__name__ not in ("DataError", "ConfigError"):
                raise
            error = RecipeError(str(err))
    if accelerator.num_processes > 1:
        box = [None if others_run else result, None if error is None else (type(error), str(error))]
        broadcast_object_list(box, from_process=0)
        if box[1] is not None and error is None:
            error = box[1][0](box[1][1])
        if not accelerator.is_main_process:
            result = fn() if (others_run and error is None) else box[0]
    if error is not None:
        raise error
    return result
