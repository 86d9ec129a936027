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


def write_ending(run, err) -> None:
    """summary.json for a start that ended in ``err`` after the start of training. A stop while reading the data
    (before it) is recorded too, so a requeue script sees this start's "preempted", not an earlier start's status."""
    from common.errors import Preempted

    if run.started or (isinstance(err, Preempted) and run.run_dir is not None):
        try:
            write(run, {} if isinstance(err, Preempted) else {"error": f"{type(err).__name__}: {err}"})
        except OSError:  # a full disk: summary.json keeps its last whole version ("running")
            pass


def table(run, final: dict, summary: dict) -> str:
    acc = run.accelerator
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in final.items()]
    rows += [("best " + run.cfg.monitor, f"{run.best:.4f}" if run.best is not None else "-"),
             ("epochs completed", str(run.epoch)), ("optimizer steps", str(run.global_step)),
             ("wall time", f"{summary['wall_time_s']:.1f} s"), ("processes", str(acc.num_processes)),
             ("precision", acc.mixed_precision), ("run dir", str(run.run_dir))]
    width = max(len(k) for k, _ in rows)
    return "summary:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def finish(run, split: str, final: dict, confusion) -> None:
    """The end of a run that trained to its end: the --target-accuracy check decides the status and exit code;
    curves.png and confusion_matrix.png (the image TensorBoard got, titled with the step), summary.json and the
    printed table."""
    from common.errors import EXIT_OK, EXIT_TARGET_MISSED

    cfg = run.cfg
    value = final.get(f"{split}/accuracy")
    missed = bool(cfg.target_accuracy) and (value is None or value < cfg.target_accuracy)
    run.status, run.exit_code = ("target_missed", EXIT_TARGET_MISSED) if missed else ("completed", EXIT_OK)
    if run.accelerator.is_main_process:
        from common.plots import save_curves_png, save_image_png

        save_curves_png(run.run_dir / "metrics.jsonl", run.run_dir / "curves.png")
        if confusion is not None:
            save_image_png(confusion, run.run_dir / "confusion_matrix.png")
    run.say(table(run, final, write(run, {"final": final})))
    if missed:
        run.say(f"TARGET MISSED: final {split} accuracy {value if value is None else f'{value:.4f}'} "
                f"is below --target-accuracy {cfg.target_accuracy:.4f}.")
    elif cfg.target_accuracy:
        run.say(f"target reached: final {split} accuracy {value:.4f} >= {cfg.target_accuracy:.4f}")
