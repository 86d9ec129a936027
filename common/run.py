"""``TrainingRun``: the bookkeeping of a training run, so that a recipe's loop holds only the training math.

A recipe reads like this (recipes/mnist_convnet.py is a whole one)::

    def train(cfg, run):                          # called by TrainingRun(cfg, RECIPE).execute(train)
        data = run.load_data()
        ...build loaders, model, optimizer; accelerator.prepare(...); scheduler...
        run.start(model, optimizer, scheduler, train_loader, data, transform,   # fresh or resumed
                  evaluate=lambda: validate(val_loader))                          # called when due
        for epoch in run.epochs():                 # each epoch's end: evaluation, epoch line, checkpoint
            for images, labels in run.batches(train_loader):   # after each step: scheduler, log, checkpoint,
                ...forward, loss...                            # stop, --eval-every-steps evaluation
                accelerator.backward(loss)
                run.step(loss)                     # loss sums, clipping, the guard's all-reduce; no sync
                optimizer.step(); optimizer.zero_grad()
        run.finish(validate(final_loader))         # final/ weights, summary.json, target check

The loop holds the training math and five calls; when to evaluate, checkpoint-after-evaluation, best/ and the
epoch end are the run's, so none can be forgotten or misordered. Leaving out ``run.step`` stops the run at its
first batch, saying so. (The finer calls the run makes itself, ``track_loss``, ``guard_step``, ``end_step``,
``eval_due``, ``record_eval`` and ``end_epoch``, remain for loops written before ``evaluate=``.)

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

import contextlib
import dataclasses
import inspect
import math
import os
import time
from pathlib import Path

import torch

from common import checkpoint as ckpt
from common import rundir
from common.accelerator import make_accelerator, startup_line
from common.augment import batch_generator
from common import evalonly, resume, summary
from common.config import sanitize_for_hparams
from common.data import data_fingerprint, load_image_data, place_on_device, split_loader
from common.errors import EXIT_OK, EXIT_TARGET_MISSED, Preempted, RecipeError, report
from common.guard import StepChecks, unclipped_grad_norm
from common.profiler import StepProfiler
from common.stopping import StopFlag
from common.tracking import MetricsLog, Progress, Throughput
from common.validation import Validation


class TrainingRun:
    def __init__(self, cfg, recipe: str):
        self.cfg, self.recipe = cfg, recipe
        self.exit_code, self.status = EXIT_OK, "running"
        self.accelerator, self.stop = None, None
        self.run_dir, self.resume_path, self.lock, self.made_dir, self.started = None, None, None, False, False
        self.log, self.profiler, self.progress = None, None, None
        self.epoch, self.global_step, self.validation, self.checks = 0, 0, None, None
        self.evaluate, self.after_step, self.scored, self.stepped = None, None, None, False  # run.start() sets them
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
        if err is not None:
            summary.write_ending(self, err)
        for part in (self.stop, self.profiler):  # signal handlers and the launcher watch; a --profile trace
            if part is not None:
                part.close()
        if self.log is not None and err is not None:
            with contextlib.suppress(OSError):  # a full disk: the trackers' files stay as they were
                self.log.close()
        rundir.release(self)  # the lock; a folder this start made and left empty goes too
        if self.accelerator is not None and err is None:  # every rank got here: all together (MetricsLog.close: why)
            self.accelerator.wait_for_everyone()
            self.accelerator.state.destroy_process_group()

    def say(self, text: str) -> None:
        """Print on the main process, through the progress bar when one is shown."""
        if self.progress is not None:
            self.progress.say(text)
        elif self.accelerator is None or self.accelerator.is_main_process:
            print(text, flush=True)

    # --- data ------------------------------------------------------------------------------------

    def load_data(self, reader=load_image_data):
        """Decode (once per node, cached) or read the cache; hold out validation from train if needed. A stop
        request ends this phase at once (nothing to checkpoint yet). ``reader``: another way to read the data with
        load_image_data's signature (``common.photos.load_photos``: file lists, decoded per batch)."""
        self.stop.interruptible("reading the data")
        data = reader(self.cfg, self.cfg.dataset, self.accelerator.is_main_process, self.say)
        self.stop.interruptible(None)
        if data.note:
            self.say(f"data {data.source}: {data.note}")
        if reader is load_image_data:
            placed = place_on_device(self.cfg, self.accelerator, data)
            self.note = "; ".join(n for n in (self.note, placed) if n)
        self.data = data
        return data

    def loader(self, split, train: bool = False, alternating_flip: bool = False):
        """A DataLoader over a decoded split (``common.data.split_loader``): the global --batch-size split over
        processes and accumulation steps for training, --eval-batch-size over processes for evaluation."""
        return split_loader(self.cfg, self.accelerator, split, train, alternating_flip)

    # --- resume or fresh start -------------------------------------------------------------------

    def start(self, model, optimizer, scheduler, train_loader, data, transform, evaluate=None, after_step=None,
              scored=None) -> None:
        """Fresh, or resumed exactly from the newest complete checkpoint. ``evaluate``: a function returning the
        validation metrics (``common.metrics.evaluate``), called by the run when an evaluation is due (at
        --eval-every-steps, at the epoch ends --eval-every chooses, at the last); ``after_step``: called after each
        optimizer step that was taken, after the scheduler's step (a weight average's update); ``scored``: the
        module evaluated and saved in best/ and final/ when it is not ``model`` (an EMA copy)."""
        cfg, acc = self.cfg, self.accelerator
        self.model, self.optimizer, self.scheduler, self.train_loader = model, optimizer, scheduler, train_loader
        self.evaluate, self.after_step, self.scored = evaluate, after_step, model if scored is None else scored
        self.stepped = False  # run.step() seen since the last batch
        self.data, self.transform = data, transform
        self.steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
        self.total_steps = min(self.steps_per_epoch * cfg.epochs, cfg.max_steps or math.inf)
        unwrapped = acc.unwrap_model(model)
        self.card = ckpt.model_card(self.recipe, self.recipe_file, unwrapped, data, transform, cfg)
        self.data_fingerprint = data_fingerprint(data)
        state = resume.start_state(self)  # the newest readable checkpoint's, or a fresh start's
        self.started = True
        self.epoch, self.start_batch, self.global_step = state["epoch"], state["batches_in_epoch"], state["global_step"]
        self.validation = Validation(self, state["best"])
        self.checks = StepChecks(acc, optimizer, self.run_dir, state["skipped_steps"])  # the guard (common.guard)
        self.saved_step = self.global_step if self.resume_path is not None else None
        self.done = self.global_step >= self.total_steps
        self.log = MetricsLog(acc, self.run_dir, self.global_step if self.resume_path is not None else None,
                              self.recipe, sanitize_for_hparams(dataclasses.asdict(cfg)))
        self.profiler = StepProfiler(acc, cfg.profile, self.run_dir)
        self.progress = Progress(acc, self.total_steps, cfg.epochs, cfg.progress_every_s, cfg.eval_every,
                                 cfg.eval_every_steps)
        self.meter = Throughput(acc.device)
        self.step_lr, self.epoch_open, self.in_epoch = None, False, False
        self.say(startup_line(acc, cfg, self.steps_per_epoch, self.note))
        sizes = {"train": data.train, "val": data.val, "test": data.test}
        params = sum(p.numel() for p in unwrapped.parameters())
        self.say(f"run dir: {self.run_dir}  model: {self.card['model']} {params:,} params  data: {data.source} "
                 + " ".join(f"{k}={len(v) if v else 0}" for k, v in sizes.items()))
        self.train_start = time.time()
        # "running" first: a start killed outright (OOM, node loss) leaves its own status, not an earlier start's
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
            self.epoch_t0, self.validation.epoch_result = time.time(), None
            yield self.epoch
            if self.epoch_open and self.evaluate is not None:  # the epoch's end: its evaluation, its line, a checkpoint
                self._evaluate_if_due()
                self.end_epoch()
            if self.epoch_open:
                raise RecipeError(f"The recipe's loop did not call run.end_epoch() at the end of epoch {started + 1}: "
                                  "the epoch was neither checkpointed nor counted, and the next one would repeat its "
                                  "data order. Pass run.start(..., evaluate=...) and the run ends each epoch itself, or "
                                  "call run.end_epoch() as the last line of the epoch loop.")
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
            if self.evaluate is not None:  # the loop's body is done: this batch's bookkeeping
                self._after_batch()
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

    def step(self, loss: torch.Tensor) -> None:
        """After ``accelerator.backward(loss)``, before ``optimizer.step()``: the loss added to the step's sums,
        and at an optimizer step (``accelerator.sync_gradients``) the gradients clipped (--max-grad-norm) and the
        guard's one small all-reduce (``guard_step``). No device sync. What follows the optimizer step (scheduler,
        logging, checkpoints, evaluation) the run does when the loop asks for the next batch."""
        self.track_loss(loss)
        self.stepped = True
        if self.accelerator.sync_gradients:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm) \
                if self.cfg.max_grad_norm else None
            self.guard_step(grad_norm)

    def _after_batch(self) -> None:
        """After the loop's body for a batch: the scheduler and ``after_step`` (when the step was taken), logging,
        checkpoints and stopping (``end_step``), and an evaluation when one is due."""
        if not self.stepped:
            raise RecipeError("The recipe's loop did not call run.step(loss) after accelerator.backward(loss): nothing "
                              "would be logged, checkpointed or guarded (a NaN loss or a stop signal would go unseen). "
                              "Call run.step(loss) between accelerator.backward(loss) and optimizer.step().")
        self.stepped = False
        if self.accelerator.sync_gradients:
            if self.step_was_taken():  # False when fp16 loss scaling skipped the step
                self.scheduler.step()
                if self.after_step is not None:
                    self.after_step()
            self.end_step()
        self._evaluate_if_due()  # at --eval-every-steps

    def _evaluate_if_due(self) -> None:
        """Evaluate with the recipe's ``evaluate`` when ``eval_due`` says so (never twice for the same weights)."""
        if self.eval_due():
            self.record_eval(self.evaluate(), self.scored)

    def augment_generator(self) -> torch.Generator:
        """Augmentation draws for this batch, seeded by (seed, epoch, batch, rank): no RNG state to save."""
        return batch_generator(self.cfg.seed, self.epoch, self.batch, self.accelerator.process_index,
                               self.accelerator.device)

    def track_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-step's loss to this optimizer step's sums, on the device (no sync)."""
        self.checks.guard.track(loss)

    def guard_step(self, grad_norm=None) -> None:
        """Once per optimizer step, before it: one small all-reduce, no sync (``common.guard``). A non-finite loss
        on any rank is masked out of this update and stops every rank at the next step; a stop request is honoured
        at a step boundary every rank agrees on. ``grad_norm``: clip_grad_norm_'s result when the recipe clips;
        otherwise the norm is measured at log steps only (two passes over the gradients)."""
        step = self.global_step + 1
        if grad_norm is None and (step % self.cfg.log_every == 0 or step >= self.total_steps):
            grad_norm = unclipped_grad_norm(self.accelerator, self.model)
        if grad_norm is not None:
            self.meter.add_grad_norm(grad_norm)
        self.checks.check(bool(self.stop), step, self.epoch)
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, before the scheduler moves it

    def step_was_taken(self) -> bool:
        """False when fp16 loss scaling skipped this optimizer step (overflow): then the schedule and a
        weight average must not advance. Too many skips in a row stop the run (``common.guard``)."""
        return self.checks.scale_watch.step_taken()

    @property
    def skipped_steps(self) -> int:
        return self.checks.skipped if self.checks is not None else 0  # None until start()

    def end_step(self) -> None:
        """After each optimizer step: log, progress, checkpoint, stop (``eval_due`` says whether to evaluate)."""
        cfg = self.cfg
        self.global_step += 1
        self.profiler.step()
        self.done = self.global_step >= self.total_steps
        log_now = self.global_step % cfg.log_every == 0 or self.done
        checkpoint_now = bool(cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0)
        mid_epoch = self.batch + 1 < len(self.train_loader)
        # An evaluation due at this step goes first (record_eval then writes the checkpoint), so the checkpoint
        # holds its result; at an epoch's last step end_epoch checkpoints after the epoch's evaluation.
        eval_first = self.validation.at_step(self.global_step, checkpoint_now, mid_epoch)
        if log_now or checkpoint_now or self.validation.now or self.checks.stopping:
            self.checks.settle(self.epoch)
        if log_now:
            self._log_window()
        if self.checks.stopping:
            path = self.checkpoint(batches_in_epoch=self.batch + 1)
            raise Preempted(f"stopped by {self.stop.reason or 'a stop request on another process'} at step "
                            f"{self.global_step}: checkpoint written to {path}. Rerun the same command with "
                            f"--output-dir {self.run_dir} --resume-from latest to continue.")
        if checkpoint_now and mid_epoch and not eval_first:
            self.checkpoint(batches_in_epoch=self.batch + 1)

    def _log_window(self) -> None:
        loss_sum, count = self.checks.guard.read(self.checks.guard.window)
        if not count:
            return
        values = {"train/loss": loss_sum / count, "train/lr": self.step_lr, **self.meter.read_and_reset()}
        self.log.log(values, step=self.global_step)
        self.progress.update(self.global_step, self.epoch, values["train/loss"], values["train/samples_per_sec"])

    @property
    def best(self):
        """The best --monitor value so far (kept in best/ and in every checkpoint)."""
        return self.validation.best if self.validation is not None else None

    def checkpoint(self, batches_in_epoch: int, epoch: int | None = None) -> Path:
        """Write a crash-safe checkpoint of everything prepared and the run's position (``common.checkpoint``)."""
        state = {"epoch": self.epoch if epoch is None else epoch, "batches_in_epoch": batches_in_epoch,
                 "global_step": self.global_step, "best": self.best, "skipped_steps": self.skipped_steps,
                 "data_fingerprint": self.data_fingerprint,
                 **ckpt.checkpoint_meta(self.cfg, self.accelerator, self.model)}
        path = ckpt.save_checkpoint(self.accelerator, self.run_dir, state, self.cfg.keep_checkpoints)
        self.saved_step = self.global_step
        return path

    # --- evaluation ------------------------------------------------------------------------------

    def eval_due(self) -> bool:
        """Whether to evaluate now, decided in one place (``common.validation``): inside the batch loop at every
        --eval-every-steps step; after it at every --eval-every epochs, the last epoch and where --max-steps
        stops. Never twice for the same weights."""
        def epoch_end_due():
            self.checks.settle(self.epoch)  # a sync, once per epoch
            return (self.epoch + 1) % self.cfg.eval_every == 0 or self.epoch + 1 == self.cfg.epochs or self.done

        return self.validation.due(self.in_epoch, epoch_end_due)

    def record_eval(self, metrics: dict, model) -> None:
        """Log a validation result (scalars, per-class accuracy, confusion matrix, misclassified images)
        and keep the model in best/ when --monitor improved."""
        self.progress.note_eval(metrics.get("seconds") if metrics else None)
        self.validation.record(metrics, model)

    def end_epoch(self) -> None:
        """Print the epoch line; checkpoint at the epoch end (or where --max-steps stopped)."""
        self.checks.settle(self.epoch)
        self.epoch_open = False
        finished = self.consumed == len(self.train_loader)
        line = f"epoch {self.epoch + 1}/{self.cfg.epochs}:"
        if not finished:  # --max-steps (or a stop) ended it part-way: not an epoch's figures
            line = (f"epoch {self.epoch + 1}/{self.cfg.epochs}, stopped at batch {self.consumed}/"
                    f"{len(self.train_loader)} (--max-steps):")
        loss_sum, count = self.checks.guard.read(self.checks.guard.epoch)
        if count:
            line += f" train loss {loss_sum / count:.4f}"
        self.say(f"{line}{self.validation.epoch_line()} | {time.time() - self.epoch_t0:.1f} s")
        if finished:
            self.epoch += 1
        if self.saved_step != self.global_step:  # an epoch end right after a --checkpoint-every save: same state
            self.checkpoint(batches_in_epoch=0 if finished else self.consumed)

    # --- the end ---------------------------------------------------------------------------------

    def finish(self, metrics: dict | None, *more) -> None:
        """Final evaluation result (test split, else validation), final/ weights, hparams, summary.json,
        curves.png and confusion_matrix.png, and the --target-accuracy check. ``finish(model, metrics)``, the
        call before ``run.start(..., evaluate=)``, still works."""
        model = self.scored
        if more:  # finish(model, metrics)
            model, metrics = metrics, more[0]
        self.stop.interruptible(None)  # final/ and summary.json are written whole
        self.checks.settle(self.epoch)
        self._log_window()  # a partial window (e.g. --max-steps below --log-every) is logged too
        split, final, confusion = self.validation.final(model, metrics)  # logged, and final/ written
        self.log.hparams(sanitize_for_hparams(dataclasses.asdict(self.cfg)),
                         {k: v for k, v in final.items() if not k.endswith("/count")})
        self.log.close()
        summary.finish(self, split, final, confusion)  # status, exit code, PNGs, summary.json, the table

    # --- --eval-only (common.evalonly) -------------------------------------------------------------

    def load_weights(self, model) -> None:
        """--eval-only: load the weights in --checkpoint (a run, best/, final/ or a checkpoint folder)."""
        self.stop.interruptible("evaluating (--eval-only)")  # nothing to save: a stop request ends it at once
        self.weights = evalonly.load_weights(self.cfg, self.accelerator, model)
        evalonly.check_data(self.weights, self.data, self.say, other_data=bool(self.eval_note))

    def report_eval_only(self, data, metrics: dict | None) -> None:
        """Print and write eval-<split>.json beside the weights (a new file if one exists); target check."""
        self.stop.interruptible(None)
        if evalonly.report(self.cfg, self.accelerator, self.say, self.weights, self.eval_note, data, metrics):
            self.exit_code, self.status = EXIT_TARGET_MISSED, "target_missed"
