"""summary.json: how a run ended (``status``: running, completed, target_missed, preempted, nonfinite_loss,
bad_input, storage_error, out_of_memory, unfinished, crashed), which start wrote it, what it reached, its timing and
the versions it ran with; and the summary table printed at the end. Written atomically at the start of training and
at every ending."""

from __future__ import annotations

import errno
import json
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from common.console import say
from common.errors import Preempted
from common.files import write_atomic
from common.train.plots import save_image_png

RESERVED_BYTES = 16384  # summary.json keeps this much allocated, so that an ending can be recorded on a full disk


def installed_version(package: str) -> str | None:
    """The installed version of ``package``, or None where it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_summary(path, text: str) -> None:
    """Atomically, padded with trailing spaces (still one JSON document) to ``RESERVED_BYTES``; when the disk is full,
    written over the file's own blocks instead (no new space needed), so a run that filled the disk still records
    how it ended (``storage_error``) instead of leaving ``running``."""
    data = text.encode()
    try:
        write_atomic(path, (data + b" " * max(0, RESERVED_BYTES - len(data))).decode())
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file() or path.stat().st_size < len(data):
            raise
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.write(data + b" " * (size - len(data)))
            f.flush()
            os.fsync(f.fileno())


class Summary:
    """Writes ``<run>/summary.json`` from the values it is given (main process only). Owns what only it needs:
    when this start began (``t_start``) and which start it is (``start_id``); ``train_start`` is set when training
    starts, ``path`` when the run directory is known."""

    def __init__(self, recipe: str, accelerator):
        self.recipe, self.accelerator = recipe, accelerator
        self.t_start = time.time()
        # which start of the run wrote summary.json (slurm/train.sbatch sets it per job start)
        self.start_id = os.environ.get("RECIPES_START_ID") or f"{os.getpid()}-{int(self.t_start)}"
        self.train_start, self.first_step_at, self.path = None, None, None

    def write(self, status: str, values: dict, extra: dict | None = None) -> dict:
        """``values``: best ({monitor: value}), epochs_completed, global_step, skipped_steps; ``extra``: final,
        error."""
        acc, now = self.accelerator, time.time()
        summary = {
            "recipe": self.recipe,
            "status": status,
            "start_id": self.start_id,
            "final": {},
            **values,
            "wall_time_s": round(now - self.t_start, 2),
            "timing": {
                "train_start": self.train_start,
                "first_step_at": self.first_step_at,
                "train_s": round(now - (self.train_start or now), 2),
            },
            "processes": acc.num_processes,
            "distributed": acc.distributed_type.value,  # FSDP when the model was sharded
            "precision": acc.mixed_precision,
            "device": acc.device.type,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "accelerate": version("accelerate"),
                "datasets": installed_version("datasets"),  # optional where the data is pre-decoded (None)
                "platform": platform.platform(),
            },
            **(extra or {}),
        }
        if acc.is_main_process:
            write_summary(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def write_ending(self, status: str, err, values: dict, started: bool, resumed: bool = False) -> None:
        """summary.json for a start that ended in ``err`` after the start of training. A stop while reading the data
        (before it) is recorded too, so a requeue script sees this start's "preempted", not an earlier start's
        status; so is a resume that ends before training (``resumed``: refused for other data or other prepared
        objects), over the run's summary.json, keeping its final scores and naming the status it had (``previous``)."""
        extra = {} if isinstance(err, Preempted) else {"error": f"{type(err).__name__}: {err}"}
        if not (started or (isinstance(err, Preempted) or resumed) and self.path is not None):
            return
        if resumed and not started:
            try:
                old = json.loads((self.path / "summary.json").read_text())
            except (OSError, ValueError):
                old = {}
            old = old if isinstance(old, dict) else {}
            extra = {"final": old.get("final", {}), **extra}
            extra["previous"] = {"status": old.get("status"), "start_id": old.get("start_id")}
        try:
            self.write(status, values, extra)
        except OSError:  # a full disk: summary.json keeps its last whole version ("running")
            pass

    def finish(self, cfg, values: dict, split: str, final: dict, confusion, curves: bytes | None = None) -> str:
        """The end of a run that trained to its end: the --target-accuracy check decides the status (returned);
        curves.png (``curves``: its PNG) and confusion_matrix.png (``confusion``: the PNG TensorBoard
        got, titled with the step), summary.json and the printed table."""
        value = final.get(f"{split}/accuracy")
        missed = bool(cfg.target_accuracy) and not (value is not None and value >= cfg.target_accuracy)  # NaN: missed
        status = "target_missed" if missed else "completed"
        if self.accelerator.is_main_process:
            if curves is not None:  # None: it could not be drawn, and a NOTE said so
                save_image_png(curves, self.path / "curves.png")
            if confusion is not None:
                save_image_png(confusion, self.path / "confusion_matrix.png")
        say(self.table(cfg.monitor, values, final, self.write(status, values, {"final": final})))
        if missed:
            say(
                f"TARGET MISSED: final {split} accuracy {value if value is None else f'{value:.4f}'} "
                f"is below --target-accuracy {cfg.target_accuracy:.4f}."
            )
        elif cfg.target_accuracy:
            say(f"target reached: final {split} accuracy {value:.4f} >= {cfg.target_accuracy:.4f}")
        return status

    def table(self, monitor: str, values: dict, final: dict, summary: dict) -> str:
        acc, best = self.accelerator, values["best"][monitor]
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in final.items()]
        damaged = values.get("damaged_photos", {}).get("count")  # a photo run's skipped photos, named in summary.json
        rows += [
            ("best " + monitor, f"{best:.4f}" if best is not None else "- (no evaluation during the run: no best/)"),
            ("epochs completed", str(values["epochs_completed"])),
            ("optimizer steps", str(values["global_step"])),
            *([("damaged photos", f"{damaged} skipped (summary.json)")] if damaged else []),
            ("wall time", f"{summary['wall_time_s']:.1f} s"),
            ("processes", str(acc.num_processes)),
            ("precision", acc.mixed_precision),
            ("run dir", str(self.path)),
        ]
        width = max(len(k) for k, _ in rows)
        return "summary:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
