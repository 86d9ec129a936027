"""When a run evaluates, and what it does with a result: the one place that decides "evaluate now", the
validation scalars and images, best/ (the weights with the best --monitor value) and the epoch's line.

Inside the batch loop an evaluation is due at every --eval-every-steps step; after it, at the end of every
--eval-every epochs, the last epoch, and where --max-steps stops. The same weights are never evaluated twice
(an --eval-every-steps step that ends an epoch is the epoch's evaluation). An evaluation due on a
--checkpoint-every step runs before that checkpoint is written, so the checkpoint holds its result and a resumed
run never loses it (nor keeps a worse model in best/)."""

from __future__ import annotations

import time

import numpy as np

from common import checkpoint as ckpt


class Validation:
    def __init__(self, run, best):
        self.run, self.best = run, best
        self.now = False                # an --eval-every-steps evaluation is due at this step (set by end_step)
        self.checkpoint_after = False   # ... and --checkpoint-every fell on it too: checkpoint after the result
        self.evaluated_step = None      # the step whose weights were evaluated last
        self.epoch_result = None        # the epoch's evaluation, for the epoch line

    def at_step(self, step: int, checkpoint_now: bool, mid_epoch: bool) -> bool:
        """end_step: is an evaluation due at this step? True when the step's checkpoint must wait for it."""
        every = self.run.cfg.eval_every_steps
        self.now = bool(every and step % every == 0) and self.run.data.val is not None  # else nothing to evaluate
        self.checkpoint_after = self.now and checkpoint_now and mid_epoch
        return self.checkpoint_after

    def due(self, in_epoch: bool, epoch_end_due) -> bool:
        run = self.run
        if run.data.val is None or self.evaluated_step == run.global_step:
            return False
        return self.now if in_epoch else epoch_end_due()

    def record(self, metrics: dict, model) -> None:
        run, cfg = self.run, self.run.cfg
        self.log("eval", metrics, run.data.val)
        self.evaluated_step = run.global_step
        value = metrics[cfg.monitor.split("/", 1)[1]]
        if self.best is None or (value > self.best if cfg.mode == "max" else value < self.best):
            self.best = value
            ckpt.save_model_dir(run.accelerator, model, run.run_dir / "best",
                                {**run.card, "metrics": {cfg.monitor: value}, "epoch": run.epoch + 1,
                                 "step": run.global_step})
        if self.now and run.batch + 1 < len(run.train_loader):  # mid-epoch: its own line, not the epoch's
            run.say(f"eval at step {run.global_step}: loss {metrics['loss']:.4f} accuracy {metrics['accuracy']:.4f} "
                    f"({metrics['count']} images)")
        else:
            self.epoch_result = metrics
        self.now = False
        if self.checkpoint_after:  # the checkpoint of this step knows this result
            self.checkpoint_after = False
            run.checkpoint(batches_in_epoch=run.batch + 1)

    def log(self, split: str, metrics: dict, data_split, final: bool = False) -> np.ndarray | None:
        """Scalars to metrics.jsonl and the trackers, images to TensorBoard; returns the confusion matrix image."""
        run = self.run
        per_class = {f"{split}/accuracy_class/{name}": acc
                     for name, acc in zip(run.data.class_names, metrics.get("per_class_accuracy", []))}
        run.log.log({f"{split}/loss": metrics["loss"], f"{split}/accuracy": metrics["accuracy"], **per_class},
                    step=run.global_step, extra={f"{split}_time": round(time.time(), 3),
                                                 f"{split}_seconds": round(metrics["seconds"], 3)})
        return run.log.images(split, metrics, data_split, run.data.class_names, run.global_step, final)

    def epoch_line(self) -> str:
        m = self.epoch_result
        return "" if m is None else f" | eval loss {m['loss']:.4f} accuracy {m['accuracy']:.4f} ({m['count']} images)"

    def final(self, model, metrics: dict | None):
        """The final evaluation (test split, else validation) logged, and final/ written: (split, scalars, confusion
        matrix image)."""
        run = self.run
        split = "test" if run.data.test is not None else "val"
        final, confusion = {}, None
        if metrics is not None:
            confusion = self.log(split, metrics, run.data.test if split == "test" else run.data.val, final=True)
            final = {f"{split}/{k}": metrics[k] for k in ("loss", "accuracy", "count")}
        ckpt.save_model_dir(run.accelerator, model, run.run_dir / "final",
                            {**run.card, "metrics": final, "epoch": run.epoch, "step": run.global_step})
        return split, final, confusion
