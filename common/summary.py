"""summary.json: how a run ended (``status``: running, completed, target_missed, preempted, nonfinite_loss,
bad_input, crashed), which start wrote it, what it reached, its timing and the versions it ran with; and the
summary table printed at the end. Written atomically at the start of training and at every ending."""

from __future__ import annotations

import json
import platform
import time
from importlib.metadata import version

import torch

from common.files import write_atomic


def write(run, extra: dict) -> dict:
    acc = run.accelerator
    now = time.time()
    summary = {
        "recipe": run.recipe, "status": run.status, "start_id": run.start_id, "final": {},
        "best": {run.cfg.monitor: run.best},
        "epochs_completed": run.epoch, "global_step": run.global_step, "skipped_steps": run.skipped_steps,
        "wall_time_s": round(now - run.t_start, 2),
        "timing": {"train_start": run.train_start, "train_s": round(now - (run.train_start or now), 2), "compile_s": 0.0},
        "processes": acc.num_processes, "precision": acc.mixed_precision, "device": acc.device.type,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "accelerate": version("accelerate"), "datasets": version("datasets"),
                     "platform": platform.platform()},
        **extra,
    }
    if acc.is_main_process:
        write_atomic(run.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def table(run, final: dict, summary: dict) -> str:
    acc = run.accelerator
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in final.items()]
    rows += [("best " + run.cfg.monitor, f"{run.best:.4f}" if run.best is not None else "-"),
             ("epochs completed", str(run.epoch)), ("optimizer steps", str(run.global_step)),
             ("wall time", f"{summary['wall_time_s']:.1f} s"), ("processes", str(acc.num_processes)),
             ("precision", acc.mixed_precision), ("run dir", str(run.run_dir))]
    width = max(len(k) for k, _ in rows)
    return "summary:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
