"""The loop calls of ``TrainingRun`` (``run.epochs()``, ``run.batches()``, ``run.step()``, ``run.step_taken()``)
and what follows each batch and each epoch.

The loop holds the training math, with every line that changes the weights or the LR in sight; when to evaluate,
checkpoint-after-evaluation, best/ and the epoch end are the run's, so none can be forgotten or misordered. The
edits users make read as they do: ``break`` from the batch loop ends that epoch after the batches trained (counted,
evaluated when due, checkpointed, said so on its line); ``break`` from the epoch loop ends the run (run.finish still
evaluates and saves); ``continue`` before run.step skips a batch (no step, nothing logged); ``return`` without
run.finish and an error in the loop are recorded in summary.json. Whatever the loop leaves open, the next call into
the run finishes: nothing that must follow a batch or an epoch lives only after a ``yield``. Calling
``optimizer.step()`` without ``run.step(loss)`` stops the run before the update, and so does leaving a batch between
the two (its loss counted, no update); a second pass over run.batches() in one epoch is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from common.console import say
from common.data.augment import batch_generator
from common.errors import Preempted, RecipeError
from common.train.evaluator import evaluation_due
from common.train.guard import unclipped_grad_norm


@dataclasses.dataclass
class LoopState:
    """Where the recipe's loop is, so that leaving it any way (``break``, ``continue``, ``return``, an error) is
    noticed by the next call into the run instead of being skipped with the code after a ``yield``."""

    phase: str | None = None  # None; "epochs" (between epochs); "epoch" (in an epoch's body); "batches"
    pass_id: int = 0  # which batch loop is current (one left behind and resumed later is refused)
    batches_begun: bool = False  # run.batches() was called in this epoch
    first: int = 0  # the batch it started at (a resumed epoch starts past 0)
    pending: bool = False  # a batch was handed to the loop's body and is not closed yet
    loader: object = None  # the loader the batch loop iterates
    left_at: int | None = None  # the loop left run.batches() (break) after this many batches of the epoch
    skipped: int = 0  # batches of this epoch the loop went past without run.step (continue)
    ended_early: str = ""  # the loop left run.epochs() before --epochs (break): said in summary.json
    finished: bool = False  # run.finish() ran

    def begin_epoch(self) -> None:
        self.phase, self.batches_begun, self.left_at, self.skipped, self.pending = "epoch", False, None, 0, False

    def begin_batches(self, first: int, loader) -> int:
        self.phase, self.batches_begun, self.first, self.loader = "batches", True, first, loader
        self.pass_id += 1
        return self.pass_id

    def end_batches(self, left_at: int | None = None) -> None:
        self.phase, self.left_at, self.pending, self.loader = "epoch", left_at, False, None
        self.pass_id += 1  # the generator, if resumed later, refuses

    def end_epoch(self) -> None:
        self.phase, self.batches_begun = "epochs", False


class TrainingLoop:
    """The loop half of ``common.train.run.TrainingRun`` (its base class): it reads the parts the run assembles
    (``ckpt``, ``checks``, ``evaluator``, ``progress``, ``meter``, ``log``, ``stop``). Where the loop is lives in
    self.loop (LoopState). Work that must follow a batch or an epoch never lives only after a generator's `yield`: a
    loop left early (`break`, `return`, an error) skips that code, so the next call into the run (the epoch loop's next
    round, run.finish, or train() returning) finishes whatever was left open, as the loop reads: a `break` from the
    batch loop ends that epoch, a `break` from the epoch loop ends the run."""

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
        at an optimizer step (``accelerator.sync_gradients``), the guard's one small all-reduce (``guard_step``).
        No device sync. A batch whose body never calls it is a skipped batch: no step, nothing logged."""
        if self.loop.phase != "batches":
            raise RecipeError(
                "run.step(loss) was called outside `for ... in run.batches(train_loader):`: the run "
                "counts, logs and checkpoints the batches that loop hands out. Iterate over "
                "run.batches(train_loader) inside `for epoch in run.epochs():`."
            )
        self.checks.track(loss)
        if self.accelerator.sync_gradients:
            self.guard_step()

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

    def guard_step(self, grad_norm=None) -> None:
        """Once per optimizer step, before it: one small all-reduce, no sync (``common.train.guard``). A non-finite loss
        on any rank is masked out of this update and stops every rank at the next step; a stop request is honoured
        at a step boundary every rank agrees on. The gradient norm (before any clipping the loop does after
        ``run.step``) is measured at log steps only (two passes over the gradients)."""
        step = self.ckpt.global_step + 1
        if grad_norm is None and (step % self.cfg.log_every == 0 or step >= self.ckpt.total_steps):
            grad_norm = unclipped_grad_norm(self.accelerator, self.model)
        if grad_norm is not None:
            self.meter.add_grad_norm(grad_norm)
        self.checks.check(bool(self.stop), step, self.ckpt.epoch)
        self.meter.lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, before the scheduler moves it

    def _close_batch(self) -> None:
        """The loop is past the batch it was given: its step counted, logged, checkpointed and evaluated when due
        (``end_step``), or, when the body never called run.step (``continue``), counted as skipped."""
        self.loop.pending = False
        if self.checks.batch_tracked():
            if self.accelerator.sync_gradients:
                self.checks.step_taken(True)  # the fp16 skip check, once per step (the loop may not have asked)
                self.checks.refuse_left_before_update(self.recipe_file)
                self.end_step()
            self._evaluate_if_due()  # at --eval-every-steps
        else:
            self.loop.skipped += 1
        self.checks.next_batch()
        self.ckpt.batch_done()

    def end_step(self) -> None:
        """After each optimizer step: log, progress, checkpoint, stop (the evaluator says whether to evaluate)."""
        c, cfg = self.ckpt, self.cfg
        c.step_done()
        if self.summary.first_step_at is None:  # start-up cost, launch to the first update (summary.json timing)
            self.summary.first_step_at = time.time()
        self.profiler.step()
        log_now = c.global_step % cfg.log_every == 0 or c.done
        checkpoint_now = c.due()
        # An evaluation due at this step goes first (its checkpoint is written after the result), so the checkpoint
        # holds its result; at an epoch's last step the epoch's end checkpoints after the epoch's evaluation.
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
