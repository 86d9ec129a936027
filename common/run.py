"""``TrainingRun``: the bookkeeping of a training run, so that a recipe's loop holds only the training math.

A recipe reads like this (recipes/mnist_convnet.py is a whole one)::

    def train(cfg, run):                          # called by TrainingRun(cfg, RECIPE).execute(train)
        data = run.load_data()
        ...build loaders, model, optimizer; accelerator.prepare(...); scheduler...
        run.start(model, optimizer, scheduler, train_loader, data, transform)   # fresh or resumed
        for epoch in run.epochs():
            for images, labels in run.batches(train_loader):
                ...forward, loss, accelerator.backward...
                run.track_loss(loss)                   # no device sync
                if accelerator.sync_gradients:
                    run.guard_step()                   # the one collective of a step; no sync
                ...optimizer.step()...
                if accelerator.sync_gradients:
                    if run.step_was_taken(): scheduler.step()
                    run.end_step()                     # log, checkpoint, preemption, --max-steps
                if run.eval_due():                     # --eval-every-steps
                    run.record_eval(evaluate(...), model)
            if run.eval_due():                         # epoch end; never the same weights twice
                run.record_eval(evaluate(...), model)  # keeps best/
            run.end_epoch()                            # checkpoint
        run.finish(model, evaluate(...))               # final/ weights, summary.json, target check

What each call promises:

- **Exact resume.** ``start`` loads the newest complete checkpoint (or the one named) into everything
  prepared, restores the epoch and batch position, and ``batches`` skips what was already consumed;
  ``augment_generator`` seeds augmentation from (seed, epoch, batch, rank), so a resumed run draws
  what the uninterrupted one drew. Learning rate, weight decay and momentum given on the resuming
  command line are applied (and printed); a checkpoint of another model or global batch is refused.
- **Every rank agrees, and the host never waits for the device between log steps.** ``guard_step``
  does one small all-reduce per optimizer step carrying (loss sum, any non-finite loss?, any stop
  request?) and reads it one step late (``common.guard``): a NaN/inf loss on any rank is masked out of
  the update on the device and stops every rank at the next step, before anything is written; a signal
  or a lost launcher on any rank makes every rank checkpoint at the same step and exit 75.
- **fp16 skipped steps are detected from the loss scale** (a fused optimizer hides them from
  ``optimizer_step_was_skipped``); they don't advance the schedule; too many in a row stop the run.
- **Crash-safe, one writer**: checkpoints through ``common.checkpoint``; the run directory is locked
  for the run's life (``common.rundir``).
- **How it ended** is written to ``summary.json`` (``status``) for every ending after the start:
  completed, target_missed, preempted, nonfinite_loss, bad_input, crashed. Through
  ``accelerate launch`` every failure exits 1, so scripts should read that field.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from common import checkpoint as ckpt
from common import rundir
from common.accelerator import make_accelerator, on_main, startup_line
from common.augment import batch_generator
from common import evalonly, resume, summary
from common.config import sanitize_for_hparams
from common.data import data_fingerprint, load_image_data, split_loader
from common.errors import EXIT_OK, EXIT_TARGET_MISSED, NonFiniteLoss, Preempted, RecipeError, report
from common.guard import LossScaleWatch, StepGuard, nonfinite_advice, unclipped_grad_norm
from common.profiler import StepProfiler
from common.stopping import StopFlag
from common.tracking import MetricsLog, Progress, Throughput


class TrainingRun:
    def __init__(self, cfg, recipe: str):
        self.cfg, self.recipe = cfg, recipe
        self.exit_code, self.status = EXIT_OK, "running"
        self.accelerator, self.stop = None, None
        self.run_dir, self.resume_path, self.lock, self.made_dir, self.started = None, None, None, False, False
        self.log, self.profiler, self.progress = None, None, None
        self.epoch, self.global_step, self.best, self.skipped_before = 0, 0, None, 0
        self.t_start, self.train_start = time.time(), None
        # which start of the run wrote summary.json (slurm/train.sbatch sets it per job start)
        self.start_id = os.environ.get("RECIPES_START_ID") or f"{os.getpid()}-{int(self.t_start)}"

    # --- start and end ---------------------------------------------------------------------------

    def execute(self, train) -> int:
        """Set up (Accelerator, signals, the run directory and its lock), call ``train(cfg, run)``, and
        turn how it ended into an exit code, a one-paragraph message and summary.json's ``status``."""
        err = None
        self.recipe_file = str(Path(inspect.getfile(train)).resolve())  # model.json names it for the tools
        try:
            self.accelerator, self.note = make_accelerator(self.cfg)
            self.stop = StopFlag()
            if self.cfg.eval_only:
                self.eval_note = evalonly.adopt_run_config(self.cfg, self.say)
            else:
                rundir.claim(self)
            train(self.cfg, self)
        except (RecipeError, Preempted) as caught:
            err = caught
            self.status, self.exit_code = caught.status, caught.exit_code
            if isinstance(caught, Preempted):
                self.say(str(caught))
            else:
                report(caught)
        except BaseException as caught:
            storage = rundir.storage_error(caught, self.run_dir)  # a full or read-only disk: one paragraph
            if storage is None:  # a bug or an interrupt: recorded, then raised with its traceback
                err, self.status = caught, "crashed"
                raise
            err, self.status, self.exit_code = storage, storage.status, storage.exit_code
            report(storage)
        finally:
            self._close(err)
        return self.exit_code

    def _close(self, err) -> None:
        # A stop while reading the data (before the start) is recorded too, so a requeue script sees this start's
        # "preempted" rather than an earlier start's summary.
        if err is not None and (self.started or (isinstance(err, Preempted) and self.run_dir is not None)):
            try:
                summary.write(self, {} if isinstance(err, Preempted) else {"error": f"{type(err).__name__}: {err}"})
            except OSError:  # a full disk: summary.json keeps its last whole version ("running")
                pass
        if self.stop is not None:
            self.stop.close()
        if self.profiler is not None:
            self.profiler.close()
        if self.log is not None and err is not None:
            try:
                self.log.close()
            except OSError:
                pass
        rundir.release(self)  # the lock; a folder this start made and left empty goes too

    def say(self, text: str) -> None:
        """Print on the main process, through the progress bar when one is shown."""
        if self.progress is not None:
            self.progress.say(text)
        elif self.accelerator is None or self.accelerator.is_main_process:
            print(text, flush=True)

    def _on_main(self, fn):
        return on_main(self.accelerator, fn)

    # --- data ------------------------------------------------------------------------------------

    def load_data(self):
        """Decode (once per node, cached) or read the cache; hold out validation from train if needed. A stop
        request ends this phase at once (nothing to checkpoint yet)."""
        self.stop.interruptible("reading the data")
        data = load_image_data(self.cfg, self.cfg.dataset, self.accelerator.is_main_process, self.say)
        self.stop.interruptible(None)
        return data

    def loader(self, split, train: bool = False, alternating_flip: bool = False):
        """A DataLoader over a decoded split (``common.data.split_loader``): the global --batch-size split over
        processes and accumulation steps for training, --eval-batch-size over processes for evaluation."""
        return split_loader(self.cfg, self.accelerator, split, train, alternating_flip)

    # --- resume or fresh start -------------------------------------------------------------------

    def start(self, model, optimizer, scheduler, train_loader, data, transform) -> None:
        cfg, acc = self.cfg, self.accelerator
        self.model, self.optimizer, self.scheduler, self.train_loader = model, optimizer, scheduler, train_loader
        self.data, self.transform = data, transform
        self.steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
        self.total_steps = min(self.steps_per_epoch * cfg.epochs, cfg.max_steps or math.inf)
        unwrapped = acc.unwrap_model(model)
        self.card = ckpt.model_card(self.recipe, self.recipe_file, unwrapped, data, transform, cfg)
        self.data_fingerprint = data_fingerprint(data)
        state = resume.start_state(self)  # the newest readable checkpoint's, or a fresh start's
        self.started = True
        self.epoch, self.start_batch, self.global_step = state["epoch"], state["batches_in_epoch"], state["global_step"]
        self.best, self.skipped_before = state["best"], state["skipped_steps"]
        self.saved_step = self.global_step if self.resume_path is not None else None
        self.done = self.global_step >= self.total_steps
        self.log = MetricsLog(acc, self.run_dir, self.global_step if self.resume_path is not None else None,
                              self.recipe, sanitize_for_hparams(dataclasses.asdict(cfg)))
        self.profiler = StepProfiler(acc, cfg.profile, self.run_dir)
        self.progress = Progress(acc, self.total_steps, cfg.epochs, cfg.progress_every_s)
        self.meter = Throughput(acc.device)
        self.guard, self.scale_watch = StepGuard(acc, optimizer), LossScaleWatch(acc.scaler)
        self.last_loss, self.last_speed, self.stopping, self.step_lr = None, None, False, None
        self.epoch_eval, self.eval_now, self.checkpoint_after_eval = None, False, False
        self.evaluated_step, self.epoch_open, self.in_epoch = None, False, False
        self.say(startup_line(acc, cfg, self.steps_per_epoch, self.note))
        self.say(f"run dir: {self.run_dir}  model: {self.card['model']} "
                 f"{sum(p.numel() for p in unwrapped.parameters()):,} params  data: {data.source} "
                 f"train={len(data.train)} val={len(data.val) if data.val else 0} "
                 f"test={len(data.test) if data.test else 0}")
        self.train_start = time.time()
        # "running" first: a start killed outright (OOM killer, node loss) leaves this start's "running", never
        # an earlier start's "preempted" that a requeue script would act on
        summary.write(self, {})

    # --- the loop --------------------------------------------------------------------------------

    def epochs(self):
        """Epoch numbers from the resumed one to --epochs; stops early at --max-steps."""
        self.progress.begin(self.global_step)
        # A run stopped on an epoch's last step resumes into that epoch with no batches left: its evaluation
        # and epoch end still run (also when that was the run's last step).
        while self.epoch < self.cfg.epochs and (not self.done or self.start_batch == len(self.train_loader)):
            self.epoch_open, self.in_epoch, started = True, False, self.epoch
            self.train_loader.set_epoch(self.epoch)  # a new shuffle every epoch, the same on every rank
            if hasattr(self.train_loader.dataset, "set_epoch"):  # Accelerate tells the sampler only
                self.train_loader.dataset.set_epoch(self.epoch)
            self.epoch_t0, self.epoch_eval = time.time(), None
            yield self.epoch
            if self.epoch_open:
                raise RecipeError(f"The recipe's loop did not call run.end_epoch() at the end of epoch {started + 1}: "
                                  "the epoch was neither checkpointed nor counted, and the next one would repeat its "
                                  "data order. Call run.end_epoch() as the last line of the epoch loop.")
        # the final evaluation follows; the last checkpoint holds everything trained, so a stop ends it at once
        self.stop.interruptible("running the final evaluation")

    def batches(self, loader):
        """This epoch's batches, resuming mid-epoch where the checkpoint left off."""
        if not getattr(self, "epoch_open", False):
            raise RecipeError("run.batches() was called outside `for epoch in run.epochs():` (or after run.end_epoch()): "
                              "run.epochs() sets each epoch's shuffle and resume position, so every epoch would repeat "
                              "the first one's data order. Loop over run.epochs() and call run.batches() inside it.")
        first, self.start_batch = self.start_batch, 0
        total = len(loader)
        if self.cfg.max_steps:  # the bar's total and ETA respect --max-steps
            total = min(total, first + (self.cfg.max_steps - self.global_step) * self.cfg.grad_accum)
        batches = self.accelerator.skip_first_batches(loader, first) if first else loader
        self.batch, self.consumed, self.in_epoch, steps_before = first, first, True, self.global_step
        t_wait = time.perf_counter()
        for images, labels in self.progress.wrap(batches, self.epoch, first, total):
            self.meter.add(labels.shape[0] * self.accelerator.num_processes, time.perf_counter() - t_wait)
            yield images, labels
            self.consumed = self.batch = self.batch + 1
            if self.done:
                break
            t_wait = time.perf_counter()
        self.progress.close_bar()
        self.in_epoch = False
        if self.consumed - first >= self.cfg.grad_accum and self.global_step == steps_before:
            raise RecipeError("The recipe's loop did not call run.end_step() after its optimizer steps: nothing was "
                              "counted, logged or checkpointed. Call run.end_step() after each optimizer step "
                              "(inside `if accelerator.sync_gradients:`).")

    def augment_generator(self) -> torch.Generator:
        """Augmentation draws for this batch, seeded by (seed, epoch, batch, rank): no RNG state to save."""
        return batch_generator(self.cfg.seed, self.epoch, self.batch, self.accelerator.process_index,
                               self.accelerator.device)

    def track_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-step's loss to this optimizer step's sums, on the device (no sync)."""
        self.guard.track(loss)

    def guard_step(self, grad_norm=None) -> None:
        """Before the optimizer step, once per optimizer step: one small all-reduce (``common.guard``),
        no sync. A non-finite loss on any rank is masked out of this update on the device and stops every
        rank at the next step (with fp16 the loss scaler skips the step instead); a stop request is
        honoured at a step boundary every rank agrees on (``end_step``). ``grad_norm``: the norm
        ``clip_grad_norm_`` returned when the recipe clips; without clipping the norm is measured at log
        steps only (two passes over the gradients saved at every other step)."""
        step = self.global_step + 1
        if grad_norm is None and (step % self.cfg.log_every == 0 or step >= self.total_steps):
            grad_norm = unclipped_grad_norm(self.accelerator, self.model)
        if grad_norm is not None:
            self.meter.add_grad_norm(grad_norm)
        self._act_on(self.guard.check(bool(self.stop), step))
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, before the scheduler moves it

    def _act_on(self, flags) -> None:
        if flags is None:
            return
        if flags.nonfinite and self.accelerator.mixed_precision != "fp16":
            raise NonFiniteLoss(nonfinite_advice(self.run_dir, flags.step, self.epoch))
        self.stopping = self.stopping or flags.stop

    def _settle(self) -> None:
        """Read this step's flags now (a sync): before anything is logged, evaluated or written."""
        self._act_on(self.guard.collect())

    def step_was_taken(self) -> bool:
        """False when fp16 loss scaling skipped this optimizer step (overflow): then the schedule and a
        weight average must not advance. Too many skips in a row stop the run (``common.guard``)."""
        return self.scale_watch.step_taken()

    @property
    def skipped_steps(self) -> int:
        watch = getattr(self, "scale_watch", None)  # absent when start() failed before creating it
        return self.skipped_before + (watch.skipped if watch is not None else 0)

    def end_step(self) -> None:
        """After each optimizer step: log, progress, checkpoint, stop (``eval_due`` says whether to evaluate)."""
        cfg = self.cfg
        self.global_step += 1
        self.profiler.step()
        self.done = self.global_step >= self.total_steps
        log_now = self.global_step % cfg.log_every == 0 or self.done
        checkpoint_now = bool(cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0)
        self.eval_now = bool(cfg.eval_every_steps and self.global_step % cfg.eval_every_steps == 0)
        if log_now or checkpoint_now or self.eval_now or self.stopping:
            self._settle()
        if log_now:
            self._log_window()
        if self.stopping:
            path = self._checkpoint(batches_in_epoch=self.batch + 1)
            raise Preempted(f"stopped by {self.stop.reason or 'a stop request on another process'} at step "
                            f"{self.global_step}: checkpoint written to {path}. Rerun the same command with "
                            f"--output-dir {self.run_dir} --resume-from latest to continue.")
        # An evaluation due at this step goes first (record_eval then writes the checkpoint), so the checkpoint
        # holds its result; at an epoch's last step end_epoch checkpoints after the epoch's evaluation.
        if checkpoint_now and self.batch + 1 < len(self.train_loader):
            if self.eval_now:
                self.checkpoint_after_eval = True
            else:
                self._checkpoint(batches_in_epoch=self.batch + 1)

    def _log_window(self) -> None:
        loss_sum, count = self.guard.read(self.guard.window)
        if not count:
            return
        values = {"train/loss": loss_sum / count, "train/lr": self.step_lr, **self.meter.read_and_reset()}
        self.last_loss, self.last_speed = values["train/loss"], values["train/samples_per_sec"]
        self.log.log(values, step=self.global_step)
        self.progress.update(self.global_step, self.epoch, self.last_loss, self.last_speed)

    def _checkpoint(self, batches_in_epoch: int, epoch: int | None = None) -> Path:
        state = {"epoch": self.epoch if epoch is None else epoch, "batches_in_epoch": batches_in_epoch,
                 "global_step": self.global_step, "best": self.best, "skipped_steps": self.skipped_steps,
                 "data_fingerprint": self.data_fingerprint,
                 **ckpt.checkpoint_meta(self.cfg, self.accelerator, self.model)}
        path = ckpt.save_checkpoint(self.accelerator, self.run_dir, state, self.cfg.keep_checkpoints)
        self.saved_step = self.global_step
        return path

    # --- evaluation ------------------------------------------------------------------------------

    def eval_due(self) -> bool:
        """The one place that decides whether to evaluate now. Inside the batch loop: at every --eval-every-steps
        step. After it: at the end of every --eval-every epochs, the last epoch, and where --max-steps stops.
        Never twice for the same weights (an --eval-every-steps step that ends an epoch is the epoch's)."""
        if self.data.val is None or self.evaluated_step == self.global_step:
            return False
        if self.in_epoch:
            return self.eval_now  # set by end_step; no sync
        self._settle()
        return (self.epoch + 1) % self.cfg.eval_every == 0 or self.epoch + 1 == self.cfg.epochs or self.done

    def record_eval(self, metrics: dict, model) -> None:
        """Log a validation result (scalars, per-class accuracy, confusion matrix, misclassified images)
        and keep the model in best/ when --monitor improved."""
        self._log_eval("eval", metrics, self.data.val)
        self.evaluated_step = self.global_step
        value = metrics[self.cfg.monitor.split("/", 1)[1]]
        if self.best is None or (value > self.best if self.cfg.mode == "max" else value < self.best):
            self.best = value
            ckpt.save_model_dir(self.accelerator, model, self.run_dir / "best",
                                {**self.card, "metrics": {self.cfg.monitor: value}, "epoch": self.epoch + 1,
                                 "step": self.global_step})
        if self.eval_now and self.batch + 1 < len(self.train_loader):  # mid-epoch: its own line, not the epoch's
            self.say(f"eval at step {self.global_step}: loss {metrics['loss']:.4f} accuracy {metrics['accuracy']:.4f} "
                     f"({metrics['count']} images)")
        else:
            self.epoch_eval = metrics
        self.eval_now = False
        if self.checkpoint_after_eval:  # --checkpoint-every fell on this step too: the checkpoint knows this result
            self.checkpoint_after_eval = False
            self._checkpoint(batches_in_epoch=self.batch + 1)

    def _log_eval(self, split: str, metrics: dict, data_split, final: bool = False) -> np.ndarray | None:
        """Scalars to metrics.jsonl and the trackers, images to TensorBoard; returns the confusion matrix image."""
        per_class = {f"{split}/accuracy_class/{name}": acc
                     for name, acc in zip(self.data.class_names, metrics.get("per_class_accuracy", []))}
        self.log.log({f"{split}/loss": metrics["loss"], f"{split}/accuracy": metrics["accuracy"], **per_class},
                     step=self.global_step, extra={f"{split}_time": round(time.time(), 3),
                                                   f"{split}_seconds": round(metrics["seconds"], 3)})
        return self.log.images(split, metrics, data_split, self.data.class_names, self.global_step, final)

    def end_epoch(self) -> None:
        """Print the epoch line; checkpoint at the epoch end (or where --max-steps stopped)."""
        self._settle()
        self.epoch_open = False
        finished = self.consumed == len(self.train_loader)
        line = f"epoch {self.epoch + 1}/{self.cfg.epochs}:"
        loss_sum, count = self.guard.read(self.guard.epoch)
        if count:
            line += f" train loss {loss_sum / count:.4f}"
        if self.epoch_eval is not None:
            m = self.epoch_eval
            line += f" | eval loss {m['loss']:.4f} accuracy {m['accuracy']:.4f} ({m['count']} images)"
        self.say(f"{line} | {time.time() - self.epoch_t0:.1f} s")
        if finished:
            self.epoch += 1
        if self.saved_step != self.global_step:  # an epoch end right after a --checkpoint-every save: same state
            self._checkpoint(batches_in_epoch=0 if finished else self.consumed)

    # --- the end ---------------------------------------------------------------------------------

    def finish(self, model, metrics: dict | None) -> None:
        """Final evaluation result (test split, else validation), final/ weights, hparams, summary.json,
        curves.png and confusion_matrix.png, and the --target-accuracy check."""
        cfg, acc = self.cfg, self.accelerator
        self.stop.interruptible(None)  # final/ and summary.json are written whole
        self._settle()
        self._log_window()  # a partial window (e.g. --max-steps below --log-every) is logged too
        split = "test" if self.data.test is not None else "val"
        final, confusion = {}, None
        if metrics is not None:
            confusion = self._log_eval(split, metrics, self.data.test if split == "test" else self.data.val,
                                       final=True)
            final = {f"{split}/loss": metrics["loss"], f"{split}/accuracy": metrics["accuracy"],
                     f"{split}/count": metrics["count"]}
        ckpt.save_model_dir(acc, model, self.run_dir / "final",
                            {**self.card, "metrics": final, "epoch": self.epoch, "step": self.global_step})
        self.log.hparams(sanitize_for_hparams(dataclasses.asdict(cfg)),
                         {k: v for k, v in final.items() if not k.endswith("/count")})
        self.log.close()
        summary.finish(self, split, final, confusion)  # status, exit code, PNGs, summary.json, the table

    # --- --eval-only (common.evalonly) -------------------------------------------------------------

    def load_weights(self, model) -> None:
        """--eval-only: load the weights in --checkpoint (a run, best/, final/ or a checkpoint folder)."""
        self.stop.interruptible("evaluating (--eval-only)")  # nothing to save: a stop request ends it at once
        self.weights = evalonly.load_weights(self.cfg, self.accelerator, model)

    def report_eval_only(self, data, metrics: dict | None) -> None:
        """Print and write eval-<split>.json beside the weights (a new file if one exists); target check."""
        self.stop.interruptible(None)
        if evalonly.report(self.cfg, self.accelerator, self.say, self.weights, self.eval_note, data, metrics):
            self.exit_code, self.status = EXIT_TARGET_MISSED, "target_missed"
