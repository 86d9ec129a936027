"""What a run does with an evaluation the loop made: the validation scalars and images, best/ (the weights with
the best --monitor value) and the epoch's line. *When* to evaluate is the recipe's loop's: a line after the step
(every --eval-every-steps steps) and after the epoch (every --eval-every epochs and the last); nothing here keeps a
copy of that rule.

What an evaluation costs the loop besides its forward passes is kept small: its pictures are drawn in a child
process (``common.train.tracking.MetricsLog.images``), and best/ is written by a thread from a copy of the weights
taken at the evaluation. Whatever records the best value (a checkpoint, summary.json, the end of the run) reads
``Evaluator.best``, which waits for that write first: no record runs ahead of the folder. A write that fails leaves
best/ with the previous weights, and the value goes back to theirs; the error is raised at the next evaluation or
at the end."""

from __future__ import annotations

import threading
import time

from common.console import say
from common.errors import ConfigError
from common.train import checkpoint as ckpt
from common.train.metrics import TOP_K


class Evaluator:
    """Owns the best --monitor value and best/, and the epoch's evaluation result. ``model``: the module scored and
    saved (the trained model, or an EMA copy); ``card``: model.json's fields for best/ and final/."""

    def __init__(self, cfg, accelerator, model, data, log, card: dict, run_dir, best, stale: int = 0):
        self.cfg, self.accelerator, self.model = cfg, accelerator, model
        self.data, self.log, self.card, self.run_dir, self._best = data, log, card, run_dir, best
        # evaluations since --monitor last improved (--patience): from the gathered metrics, so the same on every rank
        self.stale = stale
        self.writing = None  # a best/ being written in the background (BestWrite)
        self.failed = None  # ... that failed: raised at the next evaluation or at the end
        self.last = None  # (step, metrics) of the last evaluation recorded (``scored_at``)
        self.epoch_result = None  # (step, metrics) of the last evaluation, for the epoch's line or its own
        self.seconds = None  # how long the last evaluation took
        if cfg.monitor == "eval/top5_accuracy" and data.num_classes <= TOP_K:
            raise ConfigError(
                f"--monitor eval/top5_accuracy needs more than {TOP_K} classes, and {data.source} has "
                f"{data.num_classes}: every image's top {TOP_K} would hold its class. Use --monitor eval/accuracy."
            )

    @property
    def best(self):
        """The best --monitor value, whose weights best/ holds: a best/ still being written is waited for first."""
        self.settle()
        return self._best

    def settle(self) -> None:
        """Wait for the best/ being written; if it failed, best/ kept the previous weights and the value goes back
        to theirs (the error is raised by ``raise_failed``)."""
        writing, self.writing = self.writing, None
        if writing is None:
            return
        writing.join()
        if writing.error is not None:
            self._best, self.failed = writing.previous, writing.error

    def raise_failed(self) -> None:
        self.settle()
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def record(self, metrics: dict, step: int, epoch: int, pictures: bool = False) -> None:
        """An evaluation of the validation split, made now by the loop: logged, and the model kept in best/ when
        --monitor improved (written by a thread from a copy of the weights taken now). Its line is the epoch's when
        the epoch ends next (``epoch_line``), else its own, said when the loop takes its next batch (``say_pending``):
        the loop may evaluate anywhere, and only what it does next tells which it was."""
        self.raise_failed()
        cfg = self.cfg
        self.seconds = metrics.get("seconds") if metrics else None
        self.log_result("eval", metrics, self.data.val, step, pictures=pictures)
        self.last = (step, metrics)
        value = metrics[cfg.monitor.split("/", 1)[1]]
        best = self.best
        improved = (best is None or (value > best if cfg.mode == "max" else value < best)) and value == value
        self.stale = 0 if improved else self.stale + 1
        if improved:  # a NaN is never the best
            card = {**self.card, "metrics": {cfg.monitor: value}, "epoch": epoch + 1, "step": step}
            weights = ckpt.whole_weights(self.accelerator, self.model, copy=True)  # FSDP2: gathered by every rank
            if self.accelerator.is_main_process:  # (save_model_dir writes on the main process only)
                self.writing = BestWrite(self.accelerator, weights, self.run_dir / "best", card, best)
            self._best = value
        self.say_pending()  # an earlier one at another step, not followed by a batch (the loop moved on otherwise)
        self.epoch_result = (step, metrics)

    def scored_at(self, step: int) -> dict | None:
        """The metrics of the evaluation recorded at ``step``, or None: weights already scored are not scored again."""
        return self.last[1] if self.last is not None and self.last[0] == step else None

    def say_pending(self) -> None:
        """The line of an evaluation the loop made mid-epoch (it took another batch after it)."""
        if self.epoch_result is not None:
            (step, m), self.epoch_result = self.epoch_result, None
            say(f"eval at step {step}: loss {m['loss']:.4f} accuracy {m['accuracy']:.4f} ({m['count']} images)")

    def log_result(
        self, split: str, metrics: dict, data_split, step: int, final: bool = False, pictures: bool = False
    ) -> bytes | None:
        """Scalars to metrics.jsonl and the trackers; the final evaluation's pictures (and those asked for) to
        TensorBoard; for the final evaluation, returns the confusion matrix as PNG bytes."""
        per_class = {
            f"{split}/accuracy_class/{name}": acc
            for name, acc in zip(self.data.class_names, metrics.get("per_class_accuracy", []))
        }
        self.log.log(
            {
                f"{split}/loss": metrics["loss"],
                f"{split}/accuracy": metrics["accuracy"],
                **({f"{split}/top5_accuracy": metrics["top5_accuracy"]} if "top5_accuracy" in metrics else {}),
                **per_class,
            },
            step=step,
            extra={f"{split}_time": round(time.time(), 3), f"{split}_seconds": round(metrics["seconds"], 3)},
        )
        return self.log.images(split, metrics, data_split, self.data.class_names, step, final, pictures=pictures)

    def epoch_line(self) -> str:
        """The epoch's evaluation for its line ('' when the epoch was not evaluated); the next epoch starts empty."""
        result, self.epoch_result = self.epoch_result, None
        if result is None:
            return ""
        m = result[1]
        return f" | eval loss {m['loss']:.4f} accuracy {m['accuracy']:.4f} ({m['count']} images)"

    def final(self, metrics: dict | None, step: int, epochs_completed: int):
        """The final evaluation (test split, else validation) logged, and final/ written: (split, scalars, confusion
        matrix as PNG bytes). best/ is complete first."""
        self.raise_failed()
        split = "test" if self.data.test is not None else "val"
        final, confusion = {}, None
        if metrics is not None:
            confusion = self.log_result(
                split, metrics, self.data.test if split == "test" else self.data.val, step, final=True
            )
            final = {f"{split}/{k}": metrics[k] for k in ("loss", "accuracy", "top5_accuracy", "count") if k in metrics}
        ckpt.save_model_dir(
            self.accelerator,
            self.model,
            self.run_dir / "final",
            {**self.card, "metrics": final, "epoch": epochs_completed, "step": step},
        )
        return split, final, confusion


class BestWrite:
    """best/ written by a thread: the scored model's weights copied to the host at the evaluation (training moves the
    live ones on; ``checkpoint.whole_weights``), written by ``checkpoint.save_model_dir`` as the model itself would be
    (temp folder, fsync, swap). ``previous``: the best value before this one, whose weights best/ keeps if the write
    fails (``error``)."""

    def __init__(self, accelerator, weights: dict, path, card: dict, previous):
        self.weights, self.previous, self.error = weights, previous, None
        self.thread = threading.Thread(
            target=self._write, args=(accelerator, path, card), name="best-weights", daemon=False
        )
        self.thread.start()

    def _write(self, accelerator, path, card) -> None:
        try:
            ckpt.save_model_dir(accelerator, self.weights, path, card)
        except BaseException as err:  # raised in the loop's thread (Evaluator.raise_failed)
            self.error = err

    def join(self) -> None:
        self.thread.join()
