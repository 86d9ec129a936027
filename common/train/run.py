"""``TrainingRun``: the bookkeeping of a training run, so that a recipe's loop holds only the training math.

A recipe reads like this (recipes/mnist_convnet.py is a whole one)::

    def train(cfg, run):                          # called by TrainingRun(cfg, RECIPE).execute(train)
        data = run.load_data()
        ...build loaders, model, optimizer; accelerator.prepare(...); scheduler...
        run.start(model, optimizer, scheduler, train_loader, data, transform,   # fresh or resumed
                  evaluate=lambda: validate(val_loader))                          # called when due
        for epoch in run.epochs():                 # each epoch's end: evaluation, epoch line, checkpoint
            for images, labels in run.batches(train_loader):   # after each batch: log, checkpoint, stop,
                with accelerator.accumulate(model):            # --eval-every-steps evaluation
                    ...forward, loss...
                    accelerator.backward(loss)
                    run.step(loss)                 # loss sums, the guard's all-reduce; no sync
                    ...clipping...
                    optimizer.step(); optimizer.zero_grad()
                if run.step_taken():               # an update, not a micro-batch or an fp16 skip
                    scheduler.step()               # ...and weight averages (EMA, Lookahead)
        run.finish(validate(final_loader))         # final/ weights, summary.json, target check

The loop's calls, and what follows each batch and each epoch (``break``, ``continue`` and ``return`` included), are
this class's too; where the loop is lives in ``common.train.loop.LoopState``. The run assembles parts that each own
their state:
``common.train.rundir.RunDir`` (the folder, its lock, what it resumes), ``common.train.checkpointer.Checkpointer`` (the
position: epoch, batch, step; checkpoints and resuming), ``common.train.evaluator.Evaluator`` (when to evaluate, best/),
``common.train.guard.StepChecks`` (loss sums, the NaN/stop guard), ``common.train.summary.Summary`` (summary.json from
values), ``common.train.tracking`` (trackers, progress, throughput). It prints through ``common.console.say``, the one
way anything prints from the main process.

What each call promises:

- **Exact resume.** ``start`` loads the newest complete checkpoint (or the one named) into everything
  prepared, restores the epoch and batch position, and ``batches`` skips what was already consumed;
  ``augment_generator`` seeds augmentation from (seed, epoch, batch, rank), so a resumed run draws
  what the uninterrupted one drew. Learning rate, weight decay and momentum given on the resuming
  command line are applied (and printed); a checkpoint of another model or global batch is refused.
- **Every rank agrees, and the host never waits for the device between log steps.** ``step``
  does one small all-reduce per optimizer step carrying (loss sum, any non-finite loss?, any stop
  request?) and reads it one step late (``common.train.guard``): a NaN/inf loss on any rank is masked out of
  the update on the device and stops every rank at the next step, before anything is written; a signal
  or a lost launcher on any rank makes every rank checkpoint at the same step and exit 75.
- **fp16 skipped steps are detected from the loss scale** (a fused optimizer hides them from
  ``optimizer_step_was_skipped``); they don't advance the schedule; too many in a row stop the run.
- **Crash-safe, one writer**: checkpoints through ``common.train.checkpoint``; the run directory is locked
  for the run's life (``common.train.rundir``).
- **How it ended** is written to ``summary.json`` (``status``) for every ending after the start:
  completed, target_missed, preempted, nonfinite_loss, bad_input, storage_error, unfinished, crashed. Through
  ``accelerate launch`` every failure exits 1, so scripts should read that field.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import inspect
import time
from pathlib import Path

import torch

from common.console import say
from common.data import photo_check
from common.data.augment import batch_generator
from common.data.batches import loader_batch
from common.data.decoded import load_image_data, place_on_device
from common.errors import EXIT_CODES, Preempted, RecipeError, Unfinished, UnreadablePhoto, report
from common.optimizers import zero_momentum_before_first_step
from common.schedules import batch_larger_than_split
from common.train import checkpoint as ckpt
from common.train.accelerator import launcher_answers, make_accelerator, startup_line
from common.train.checkpointer import Checkpointer
from common.train.eval_only import EvalOnly
from common.train.evaluator import Evaluator, evaluation_due
from common.train.guard import StepChecks, unclipped_grad_norm
from common.train.loop import LoopState
from common.train.profiler import StepProfiler
from common.train.rundir import RunDir, storage_error
from common.train.sharding import describe as describe_sharding
from common.train.stopping import StopFlag
from common.train.summary import Summary
from common.train.tracking import MetricsLog, Progress, Throughput, sanitize_for_hparams

DROP_SHARE = 0.1  # training drops its last incomplete batch (equal batches) unless it holds more of the split


# Callables ``watch(run)`` run at two points of every optimizer step, for tools that watch the loop from outside it (the
# tests, a profiler of your own): "before_update" before the guard's all-reduce (a stop request set there is honoured at
# this step), "after_step" after the step's logging, checkpoint and stop. Add them with ``watching``.
WATCHERS: dict[str, list] = {"before_update": [], "after_step": []}


# At this process's exit, freeze what is alive so that the interpreter's own garbage collections at shutdown skip
# it: with torch, Accelerate, datasets and matplotlib loaded they took about 1 s of every recipe process's exit on a
# 2-core CPU (0.3 s frozen). What must be freed while the interpreter is whole (the process group's work) is freed by
# ``TrainingRun._close``; files and writers are closed by then; the memory goes back to the system with the process.
atexit.register(gc.freeze)


@contextlib.contextmanager
def watching(before_update=None, after_step=None):
    """Watch every run's optimizer steps inside this block (``WATCHERS``)."""
    added = [(k, f) for k, f in (("before_update", before_update), ("after_step", after_step)) if f is not None]
    for key, fn in added:
        WATCHERS[key].append(fn)
    try:
        yield
    finally:
        for key, fn in added:
            WATCHERS[key].remove(fn)


class TrainingRun:
    def __init__(self, cfg, recipe: str):
        self.cfg, self.recipe, self.recipe_file, self.status = cfg, recipe, None, "running"
        self.accelerator, self.stop, self.dir, self.note = None, None, None, ""
        self.summary = Summary(recipe, None)  # the clock starts now; the accelerator comes with execute()
        self.data = self.model = self.optimizer = self.scheduler = self.train_loader = None
        # the parts start() assembles; ckpt (the position) is set once a resume (if any) has succeeded: from then
        # on the run has started, and every ending is recorded in summary.json
        self.ckpt = self.evaluator = self.checks = self.log = self.progress = self.profiler = self.meter = None
        self.loop = LoopState()  # where the recipe's loop is
        self.eval_only = None

    # --- start and end ---------------------------------------------------------------------------

    def execute(self, train) -> int:
        """Set up (Accelerator, signals, the run directory and its lock), call ``train(cfg, run)``, and
        turn how it ended into an exit code, a one-paragraph message and summary.json's ``status``."""
        err = None
        self.recipe_file = str(Path(inspect.getfile(train)).resolve())  # model.json names it for the tools
        try:
            # In this order: what the launcher asks (its accumulation counts as given on the command line), then a
            # resume's settings (the run's own), then everything built from them, the Accelerator first.
            launch = launcher_answers(self.cfg)
            resume, notes = RunDir.adopt_run_settings(self.cfg)
            self.accelerator, self.note = make_accelerator(self.cfg, launch)
            self.summary.accelerator = self.accelerator
            self.stop = StopFlag()
            if self.cfg.eval_only:
                self.eval_only = EvalOnly(self.cfg)
            else:
                self.dir = RunDir.claim(self.cfg, self.recipe, self.accelerator, planned=resume)
                self.summary.path = self.dir.path
                for note in notes:
                    say(f"NOTE: {note}")
            train(self.cfg, self)
            if self.ckpt is not None and not self.loop.finished:
                self._unfinished()
        except (RecipeError, Preempted) as caught:
            err, self.status = self._checked(caught), caught.status
            if isinstance(caught, Preempted):
                say(str(caught))
        except BaseException as caught:
            storage = storage_error(caught, self.dir.path if self.dir else None)  # a full or read-only disk
            if storage is None:  # a bug or an interrupt: recorded, then raised with its traceback
                err, self.status = caught, "crashed"
                raise
            err, self.status = storage, storage.status
        finally:
            self._close(err)
        return EXIT_CODES[self.status]

    def _checked(self, err):
        """A damaged photo met before the photo check running beside training got to it: the check's own error,
        naming every damaged photo of the folder, once it has finished."""
        check = self.data.check if self.data is not None else None
        if not isinstance(err, UnreadablePhoto) or check is None or check.done and check.error is None:
            return err
        if not check.done:
            say(f"waiting for the photo check to name every damaged photo of the folder ({check.total:,} photos) ...")
        return check.poll(block=True) or err

    def _close(self, err) -> None:
        # the photo checks beside training are stopped, not awaited: the run ends now, and the next launch checks
        # only what they had not got to (common.data.photo_check.stop_all)
        left = photo_check.stop_all()
        if left:
            say(f"note: {left}")
        if err is not None:
            self.summary.write_ending(self.status, err, self._position(), started=self.ckpt is not None)
        if isinstance(err, RecipeError):  # after summary.json: bad input is said once, and other processes wait
            report(err)  # for the main one to say it (common.errors.report)
        # signal handlers and the launcher watch; a --profile trace; the hook on the optimizer
        for part in (self.stop, self.profiler, self.checks):
            if part is not None:
                part.close()
        if self.progress is not None:
            self.progress.close_bar()
        if self.log is not None and err is not None:
            with contextlib.suppress(OSError):  # a full disk: the trackers' files stay as they were
                self.log.close()
        if self.dir is not None:
            self.dir.release(started=self.ckpt is not None)  # a folder this start made and left empty goes too
        if self.accelerator is not None and err is None:  # every rank got here: all together (MetricsLog.close: why)
            self.accelerator.wait_for_everyone()
            # What holds the process group's work (the DDP wrapper, Accelerate's references to everything prepared)
            # is freed first, while the interpreter is whole: a gloo work object freed during interpreter teardown
            # aborts the process ("terminate called without an active exception"), which the launcher reports as a
            # failure of a run that ended well.
            self.model = self.optimizer = self.scheduler = self.train_loader = self.evaluator = None
            self.accelerator.free_memory()
            gc.collect()
            self.accelerator.state.destroy_process_group()

    def _position(self) -> dict:
        """summary.json's record of how far the run got (an update the loop applied just before an error counts)."""
        c = self.ckpt
        applied = int(self.loop.pending and self.checks is not None and self.checks.stepped)
        position = {
            "best": {self.cfg.monitor: self.best},
            "epochs_completed": c.epoch if c else 0,
            "global_step": c.global_step + applied if c else 0,
            "skipped_steps": self.checks.skipped if self.checks else 0,
        }
        if self.loop.ended_early:
            position["ended_early"] = self.loop.ended_early
        return position

    def _unfinished(self) -> None:
        """train() returned without run.finish(): the batch it was in is closed and the position checkpointed (as a
        stop would leave it, so a resume continues exactly), then the run ends saying so."""
        c, loop = self.ckpt, self.loop
        if loop.phase == "batches" and loop.pending and self.checks.tracked:
            self._close_batch()
        self.checks.settle(c.epoch)
        where = f"{self.dir.path / 'checkpoints'}"
        if c.saved_step != c.global_step:
            where = str(self._save(batches_in_epoch=c.batch))
        loop.phase = None
        raise Unfinished(
            f"train() returned without calling run.finish(...) at optimizer step {c.global_step} "
            f"(epoch {c.epoch + 1}): no final evaluation and no final/ weights. The position is "
            f"checkpointed ({where}): rerun with --resume-from latest to continue. To end a run early, "
            "`break` out of `for epoch in run.epochs():` instead; run.finish(...) then evaluates and "
            "saves it."
        )

    # --- the loop's calls, and what follows each batch and each epoch ---------------------------------------

    def epochs(self):
        """Epoch numbers from the resumed one to --epochs; stops early at --max-steps. After each epoch's body: its
        evaluation when due, its line and a checkpoint (also when the body left its batch loop early)."""
        c = self.ckpt
        self._close_open_epoch()  # an earlier epoch loop left by `break`
        self.progress.begin(c.global_step)
        # A run stopped on an epoch's last step resumes into that epoch with no batches left: its evaluation
        # and epoch end still run (also when that was the run's last step).
        while c.epoch < self.cfg.epochs and (not c.done or c.start_batch == c.batches_per_epoch):
            self.loop.begin_epoch()
            c.begin_epoch()
            self.train_loader.set_epoch(c.epoch)  # a new shuffle every epoch, the same on every rank
            if hasattr(self.train_loader.dataset, "set_epoch"):  # Accelerate tells the sampler only
                self.train_loader.dataset.set_epoch(c.epoch)
            self.progress.begin_epoch()
            yield c.epoch
            self._end_epoch()
        self._leave_epochs()

    def batches(self, loader):
        """This epoch's batches, resuming mid-epoch where the checkpoint left off. After each batch's body: logging,
        checkpoints, stopping and an --eval-every-steps evaluation when due. Leaving it early (``break``) ends the
        epoch after the batches trained; a batch the body skips (``continue`` before ``run.step``) is no step."""
        loop = self.loop
        if loop.phase not in ("epoch", "batches"):
            raise RecipeError(
                "run.batches() was called outside `for epoch in run.epochs():`: run.epochs() sets each "
                "epoch's shuffle and resume position, so every epoch would repeat the first one's data "
                "order. Loop over run.epochs() and call run.batches() inside it."
            )
        if loop.batches_begun:
            raise RecipeError(
                "run.batches() was called a second time in one epoch: an epoch is one pass over the "
                "training data (the position, the shuffle and a resume count its batches once). Loop "
                "over run.batches(train_loader) once per epoch; to train longer, raise --epochs."
            )
        c, cfg = self.ckpt, self.cfg
        first = c.begin_batches()
        total = len(loader)
        if cfg.max_steps:  # the bar's total and ETA respect --max-steps
            total = min(total, first + (cfg.max_steps - c.global_step) * cfg.grad_accum)
        batches = self.accelerator.skip_first_batches(loader, first) if first else loader
        this_pass = loop.begin_batches(first, batches)
        t_wait = time.perf_counter()
        for images, labels in self.progress.wrap(batches, c.epoch, first, total):
            self.meter.add(labels.shape[0] * self.accelerator.num_processes, time.perf_counter() - t_wait)
            loop.pending = True
            yield images, labels
            if loop.pass_id != this_pass:
                raise RecipeError(
                    "A batch loop that was left (its epoch has ended since) was resumed: keep no "
                    "reference to run.batches(...) past its loop; call it once per epoch inside "
                    "`for epoch in run.epochs():`."
                )
            self._close_batch()
            if c.done:
                break
            t_wait = time.perf_counter()
        loop.end_batches()
        self.progress.close_bar()

    @property
    def batch(self) -> int:
        """The batch of the epoch the loop is in (0-based; a resumed epoch continues its count, where enumerate()
        restarts at 0): ``if run.batch == k: break`` ends every epoch after k batches, resumed or not."""
        return self.ckpt.batch

    def step(self, loss: torch.Tensor) -> None:
        """After ``accelerator.backward(loss)``, before ``optimizer.step()``: the loss added to the step's sums and,
        at an optimizer step (``accelerator.sync_gradients``), the guard's one small all-reduce (``_guard_step``).
        No device sync. A batch whose body never calls it is a skipped batch: no step, nothing logged."""
        if self.loop.phase != "batches":
            raise RecipeError(
                "run.step(loss) was called outside `for ... in run.batches(train_loader):`: the run "
                "counts, logs and checkpoints the batches that loop hands out. Iterate over "
                "run.batches(train_loader) inside `for epoch in run.epochs():`."
            )
        self.checks.track(loss)
        if self.accelerator.sync_gradients:
            self._guard_step()

    def step_taken(self) -> bool:
        """After ``optimizer.step()``: True when it updated the weights; False on a --grad-accum micro-batch, a
        batch the loop skipped, and a step fp16 loss scaling skipped. The loop steps the scheduler and the weight
        averages under it, so a skipped update moves neither."""
        return self.checks.step_taken(self.accelerator.sync_gradients)

    def augment_generator(self) -> torch.Generator:
        """Augmentation draws for this batch, seeded by (seed, epoch, batch, rank): no RNG state to save."""
        return batch_generator(
            self.cfg.seed, self.ckpt.epoch, self.ckpt.batch, self.accelerator.process_index, self.accelerator.device
        )

    def _guard_step(self, grad_norm=None) -> None:
        """Once per optimizer step, before it: one small all-reduce, no sync (``common.train.guard``). A non-finite loss
        on any rank is masked out of this update and stops every rank at the next step; a stop request is honoured
        at a step boundary every rank agrees on. The gradient norm (before any clipping the loop does after
        ``run.step``) is measured at log steps only (two passes over the gradients)."""
        for watch in WATCHERS["before_update"]:
            watch(self)
        step = self.ckpt.global_step + 1
        if grad_norm is None and (step % self.cfg.log_every == 0 or step >= self.ckpt.total_steps):
            grad_norm = unclipped_grad_norm(self.accelerator, self.model)
        if grad_norm is not None:
            self.meter.add_grad_norm(grad_norm)
        self.checks.check(bool(self.stop), step, self.ckpt.epoch)
        self.meter.lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, before the scheduler moves it

    def _close_batch(self) -> None:
        """The loop is past the batch it was given: its step counted, logged, checkpointed and evaluated when due
        (``_end_step``), or, when the body never called run.step (``continue``), counted as skipped."""
        self.loop.pending = False
        if self.checks.batch_tracked():
            if self.accelerator.sync_gradients:
                # the fp16 skip check, once per step (the loop may not have asked)
                updated = self.checks.step_taken(True)
                self.checks.refuse_left_before_update(self.recipe_file)
                self._end_step(updated)
            self._evaluate_if_due()  # at --eval-every-steps
        else:
            self.loop.skipped += 1
        self.checks.next_batch()
        self.ckpt.batch_done()

    def _end_step(self, updated: bool = True) -> None:
        """After each optimizer step: log, progress, checkpoint, stop (the evaluator says whether to evaluate). An
        update fp16 loss scaling skipped (``updated`` False) is no step: the step count, --max-steps, logging,
        checkpoints and evaluations count updates (summary.json's skipped_steps counts the others); only a stop
        request is honoured."""
        c, cfg = self.ckpt, self.cfg
        log_now = checkpoint_now = eval_first = False
        if updated:
            c.step_done()
            if self.summary.first_step_at is None:  # start-up cost, launch to the first update (summary.json timing)
                self.summary.first_step_at = time.time()
            self.profiler.step()
            log_now = c.global_step % cfg.log_every == 0 or c.done
            checkpoint_now = c.due()
            # An evaluation due at this step goes first (its checkpoint is written after the result), so the
            # checkpoint holds its result; at an epoch's last step the epoch's end checkpoints after its evaluation.
            eval_first = self.evaluator.at_step(c.global_step, checkpoint_now, c.mid_epoch())
        if log_now or checkpoint_now or self.evaluator.now or self.checks.stopping:
            self.checks.settle(c.epoch)
        if log_now:
            self._log_window()
        if self.checks.stopping:
            path = self._save()
            if self.stop.error is not None:  # this process's data check failed (other ranks stop as preempted)
                raise self.stop.error
            raise Preempted(
                f"stopped by {self.stop.reason or 'a stop request on another process'} at step "
                f"{c.global_step}: checkpoint written to {path}. Rerun the same command with "
                f"--output-dir {self.dir.path} --resume-from latest to continue."
            )
        if checkpoint_now and c.mid_epoch() and not eval_first:
            self._save()
        if not updated:
            return
        for watch in WATCHERS["after_step"]:
            watch(self)

    def _save(self, **position) -> Path:
        return self.ckpt.save(self.model, self.best, self.checks.skipped, **position)

    def _log_window(self) -> None:
        loss_sum, count = self.checks.window_loss()
        if not count:
            return
        values = {"train/loss": loss_sum / count, "train/lr": self.meter.lr, **self.meter.read_and_reset()}
        self.log.log(values, step=self.ckpt.global_step)
        self.progress.update(
            self.ckpt.global_step, self.ckpt.epoch, values["train/loss"], values["train/samples_per_sec"]
        )

    def _evaluate_if_due(self) -> None:
        """Evaluate when ``common.train.evaluator.evaluation_due`` says so: inside the batch loop at every
        --eval-every-steps step; after it at every --eval-every epochs, the last epoch and where --max-steps stops.
        Never twice for the same weights. A checkpoint that waited for the result is written after it."""
        c = self.ckpt

        def epoch_end_due():
            self.checks.settle(c.epoch)  # a sync, once per epoch
            return evaluation_due(self.cfg, epochs_done=c.epoch + 1, last=c.done)

        if self.evaluator.due(c.global_step, self.loop.phase == "batches", epoch_end_due):
            if self.evaluator.run(c.global_step, c.epoch, c.mid_epoch()):
                self._save()
            self.progress.note_eval(self.evaluator.seconds)

    def _leave_batches(self) -> None:
        """The loop left run.batches() before its end (``break``): the batch it was in is finished if its body got
        as far as run.step (a ``break`` after the step), and the epoch ends after the batches the loop went past."""
        loop = self.loop
        if loop.pending:
            if self.checks.tracked:
                self._close_batch()
            else:  # left at the top of its body: not trained on, not counted
                loop.pending = False
                self.checks.next_batch()
        # A prepared loader left mid-iteration never reaches its own end(), which takes it off Accelerate's list of
        # active loaders (gather_for_metrics and --grad-accum read the newest one): take it off now.
        with contextlib.suppress(AttributeError, ValueError):
            loop.loader.end()
        loop.end_batches(left_at=self.ckpt.batch)
        self.progress.close_bar()

    def _end_epoch(self) -> None:
        """Its evaluation when due, its line, and a checkpoint at its end (or where --max-steps stopped it)."""
        c, loop = self.ckpt, self.loop
        if loop.phase == "batches":
            self._leave_batches()
        if not loop.batches_begun:
            raise RecipeError(
                f"Epoch {c.epoch + 1}'s body ended without looping over run.batches(train_loader): the "
                "run counts, logs and checkpoints the batches that loop hands out. Inside `for epoch in "
                "run.epochs():`, iterate `for images, labels in run.batches(train_loader):`."
            )
        self.checks.settle(c.epoch)
        if loop.skipped and loop.skipped == c.batch - loop.first:
            raise RecipeError(
                f"The loop went past all {loop.skipped} batches of epoch {c.epoch + 1} without "
                "calling run.step(loss) (every batch skipped): nothing trained. Call run.step(loss) "
                "after accelerator.backward(loss) for each batch that trains."
            )
        self._evaluate_if_due()
        full = c.batch == c.batches_per_epoch
        ended_by_loop = not full and loop.left_at is not None
        line = f"epoch {c.epoch + 1}/{self.cfg.epochs}"
        if ended_by_loop:
            line += f", ended by the loop after {c.batch} of {c.batches_per_epoch} batches"
        elif not full:  # --max-steps (or a stop) ended it part-way: not an epoch's figures
            line += f", stopped at batch {c.batch}/{c.batches_per_epoch} (--max-steps)"
        if loop.skipped:
            line += f" ({loop.skipped} skipped by the loop)"
        loss_sum, count = self.checks.epoch_loss()
        if count:
            line += f": train loss {loss_sum / count:.4f}"
        else:
            line += ":"
        say(f"{line}{self.evaluator.epoch_line()} | {self.progress.epoch_seconds():.1f} s")
        c.end_epoch(counted=full or ended_by_loop)
        loop.end_epoch()
        if c.saved_step != c.global_step:  # an epoch end right after a --checkpoint-every save: same state
            self._save(batches_in_epoch=c.batch)

    def _close_open_epoch(self) -> None:
        """An epoch the loop left open (a ``break`` out of run.epochs()) ends as if its body had run to its end;
        one left before its batch loop began trained nothing and is dropped."""
        loop = self.loop
        if loop.phase == "batches" or (loop.phase == "epoch" and loop.batches_begun):
            self._end_epoch()
        loop.phase = "epochs" if loop.phase is not None else None

    def _leave_epochs(self) -> None:
        """The epoch loop is over (done, or left by a ``break``): the final evaluation follows; the last checkpoint
        holds everything trained, so a stop request ends it at once."""
        c, loop = self.ckpt, self.loop
        if loop.phase is None:
            return
        self._close_open_epoch()
        loop.phase = None
        if c.epoch < self.cfg.epochs and not c.done:
            loop.ended_early = f"the loop left run.epochs() after epoch {c.epoch} of {self.cfg.epochs}"
            say(f"NOTE: {loop.ended_early}; the run ends there (final evaluation, final/, summary.json).")
        self.stop.interruptible("running the final evaluation")

    # --- data ------------------------------------------------------------------------------------

    def load_data(self, reader=None):
        """Decode (once per node, cached) or read the cache; hold out validation from train if needed. A stop
        request ends this phase at once (nothing to checkpoint yet). ``reader``: another way to read the data, called
        as ``reader(cfg, default_dataset)`` (``common.data.photo_sources.load_photos``: file lists, decoded per
        batch)."""
        self.stop.interruptible("reading the data")
        if reader is None:
            data = load_image_data(self.cfg, self.cfg.dataset, self.accelerator.is_main_process)
        else:
            data = reader(self.cfg, self.cfg.dataset)
        self.stop.interruptible(None)
        for check in (data.check, data.verify):  # checks beside training: a failed one stops it at a step boundary
            if check is not None:
                self.stop.watch(check)
        if data.note:
            say(f"data {data.source}: {data.note}")
        placed = place_on_device(self.cfg, self.accelerator, data)
        self.note = "; ".join(n for n in (self.note, placed) if n)
        self.data = data
        return data

    def normalisation(self, compute) -> tuple[list[float], list[float]]:
        """The per-channel mean and std the model's inputs are normalised with: ``compute()``, the recipe's rule (the
        training split's statistics, or pretrained weights' own); under --eval-only the ones the scored run recorded
        in model.json, so its weights are scored on the pixels they were trained on, whatever data is scored."""
        recorded = self.eval_only.normalisation() if self.eval_only is not None else None
        return recorded if recorded is not None else compute()

    @property
    def resuming(self) -> bool:
        """This start continues a checkpoint (its weights come from there, not from --weights)."""
        return self.dir is not None and self.dir.resume_path is not None

    def loader(self, split, train: bool = False, **options):
        """A DataLoader over a split of the data run.load_data read (None for none), made the way its reader says
        (``common.data.decoded.split_loader`` for decoded images, ``common.data.photos.photo_loader`` for photos): the
        global --batch-size split over processes and accumulation steps for training, --eval-batch-size over processes
        for evaluation. ``options``: the loader's own (``alternating_flip=``, a photo recipe's ``train_view=``)."""
        if train and split is not None:
            if len(split) < self.cfg.batch_size:  # the global batch: the same rule on 1 or N processes (N would pad)
                raise batch_larger_than_split(self.cfg, len(split))
            batch = loader_batch(self.cfg, self.accelerator.num_processes, True)
            left = len(split) % batch
            # a small split: dropping the last batch would lose much of each epoch (a batch larger than the whole
            # split stays an error: build_scheduler says so, with the LR rule)
            if len(split) >= batch and left > DROP_SHARE * len(split):
                options.setdefault("drop_last", False)
                self.note = "; ".join(
                    n
                    for n in (
                        self.note,
                        f"the last training batch of each epoch is kept ({left} "
                        f"of {len(split)} images; dropping it would lose "
                        f"{left / len(split):.0%} of every epoch)",
                    )
                    if n
                )
        return self.data.make_loader(self.cfg, self.accelerator, split, train, self.data.on_device, **options)

    # --- resume or fresh start -------------------------------------------------------------------

    def start(self, model, optimizer, scheduler, train_loader, data, transform, *, evaluate, scored=None) -> None:
        """Fresh, or resumed exactly from the newest complete checkpoint. ``evaluate``: a function returning the
        validation metrics (``common.train.metrics.evaluate``), called by the run when an evaluation is due (at
        --eval-every-steps, at the epoch ends --eval-every chooses, at the last); ``scored``: the module evaluated and
        saved in best/ and final/ when it is not ``model`` (an EMA copy)."""
        cfg, acc = self.cfg, self.accelerator
        self.model, self.optimizer, self.scheduler, self.train_loader = model, optimizer, scheduler, train_loader
        self.data = data
        sides = getattr(train_loader.dataset, "sides", None)  # the photo recipe's progressive resizing, said on resume
        position = Checkpointer(cfg, acc, self.dir.path, self.dir.resume_path, len(train_loader), data, sides)
        state = position.start(model, optimizer, scheduler)  # the newest readable checkpoint's, or a fresh start's
        self.ckpt = position  # started: every ending from here on is recorded in summary.json
        unwrapped = acc.unwrap_model(model, keep_torch_compile=False)
        card = ckpt.model_card(self.recipe, self.recipe_file, unwrapped, data, transform, cfg)
        resumed = position.global_step if position.resume_path is not None else None
        self.log = MetricsLog(acc, self.dir.path, resumed, self.recipe, sanitize_for_hparams(dataclasses.asdict(cfg)))
        self.evaluator = Evaluator(
            cfg, acc, evaluate, model if scored is None else scored, data, self.log, card, self.dir.path, state["best"]
        )
        # the guard (common.train.guard)
        self.checks = StepChecks(acc, optimizer, self.dir.path, state["skipped_steps"])
        self.checks.watch_updates(optimizer)  # optimizer.step() without run.step(loss) stops at once
        zero_momentum_before_first_step(optimizer)  # a fused SGD's skipped first step keeps no garbage momentum
        self.profiler = StepProfiler(acc, cfg.profile, self.dir.path)
        self.progress = Progress(acc, cfg, position.total_steps)
        self.meter = Throughput(acc.device)
        say(startup_line(acc, cfg, position.steps_per_epoch, self.note, describe_sharding(acc, model)))
        sizes = {"train": data.train, "val": data.val, "test": data.test}
        params = sum(p.numel() for p in unwrapped.parameters())
        say(
            f"run dir: {self.dir.path}  model: {card['model']} {params:,} params  data: {data.source} "
            + " ".join(f"{k}={len(v) if v else 0}" for k, v in sizes.items())
        )
        self.summary.train_start = time.time()
        # "running" first: a start killed outright (OOM, node loss) leaves its own status, not an earlier start's
        self.summary.write(self.status, self._position())

    @property
    def epoch(self) -> int:
        """The epoch running (0-based)."""
        return self.ckpt.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.ckpt.global_step

    @property
    def best(self):
        """The best --monitor value so far (kept in best/ and in every checkpoint)."""
        return self.evaluator.best if self.evaluator is not None else None

    # --- the end ---------------------------------------------------------------------------------

    def finish(self, metrics: dict | None) -> None:
        """Final evaluation result (test split, else validation), final/ weights, hparams, summary.json,
        curves.png and confusion_matrix.png, and the --target-accuracy check."""
        self._leave_epochs()  # a `break` out of run.epochs(): its last epoch ends first
        self.loop.finished = True
        self.stop.interruptible(None)  # final/ and summary.json are written whole
        self.checks.settle(self.ckpt.epoch)
        self._log_window()  # a partial window (e.g. --max-steps below --log-every) is logged too
        split, final, confusion = self.evaluator.final(metrics, self.ckpt.global_step, self.ckpt.epoch)
        self.log.hparams(
            sanitize_for_hparams(dataclasses.asdict(self.cfg)),
            {k: v for k, v in final.items() if not k.endswith("/count")},
        )
        self.log.close()
        curves = self.log.curves()
        self.status = self.summary.finish(self.cfg, self._position(), split, final, confusion, curves)

    # --- --eval-only (common.train.eval_only) -------------------------------------------------------------

    def load_weights(self, model) -> None:
        """--eval-only: load the weights in --checkpoint (a run, best/, final/ or a checkpoint folder)."""
        self.stop.interruptible("evaluating (--eval-only)")  # nothing to save: a stop request ends it at once
        self.eval_only.load(self.accelerator, model, self.data)

    def report_eval_only(self, data, metrics: dict | None) -> None:
        """Print and write eval-<split>.json beside the weights (a new file if one exists); target check."""
        self.stop.interruptible(None)
        if self.eval_only.report(self.accelerator, data, metrics):
            self.status = "target_missed"
