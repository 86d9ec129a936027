"""``TrainingRun``: the *how* of a training run's bookkeeping, called by the recipe's loop, which says *when*.

A recipe reads like this (recipes/mnist_convnet.py is a whole one)::

    def main(argv=None):
        cfg = parse_config(Config, argv, __doc__)
        with TrainingRun(cfg, __file__) as run:   # settings completed, then the Accelerator and the run folder
            train(cfg, run)
        return run.exit_code

    def train(cfg, run):
        data = run.load_data()
        ...build loaders, model, optimizer; accelerator.prepare(...); scheduler...
        run.start(model, optimizer, scheduler, train_loader, data, transform)   # fresh, or resumed exactly
        for epoch in range(run.epoch, cfg.epochs):
            for images, labels in run.batches(train_loader, epoch):  # this epoch's shuffle, resumed mid-epoch
                with accelerator.accumulate(model):
                    ...forward, loss...
                    accelerator.backward(loss)
                    run.track(loss)                # counts the update; the guard's all-reduce; no sync
                    optimizer.step(); optimizer.zero_grad()
                if not accelerator.sync_gradients: # a --grad-accum micro-batch
                    continue
                if not accelerator.optimizer_step_was_skipped:  # fp16 loss scaling may skip an update
                    scheduler.step()
                if run.step % cfg.log_every == 0:
                    run.log({...})                 # the loss, LR, throughput and the loop's own scalars
                if run.stop_requested():           # a signal or a lost launcher, on any rank
                    run.preempt()                  # checkpoint, exit 75
                if run.checkpoint_due():           # --checkpoint-every-s seconds (or --checkpoint-every steps)
                    run.checkpoint()
            run.evaluate(validate, val_loader)     # every --eval-every epochs and the last
        run.finish(validate, final_loader)         # a checkpoint, final evaluation, final/, summary.json

Every call is a line the loop may move, repeat, delete or guard with ``accelerator.is_main_process`` (``run.log``;
the others are collective): a deleted evaluation or checkpoint does not happen, and ``break``, ``continue`` and
``return`` are plain Python. Nothing runs after the loop's body, and what the run records is counted where batches
are handed out (``run.batches``) and updates counted (``run.track``, the one call a loop cannot leave out: refused
when missing). The library keeps no cadence of its own: when to log, evaluate, checkpoint or stop at --max-steps are
the loop's lines. The run assembles parts that each own their state: ``common.train.rundir.RunDir`` (the folder, its
lock, what it resumes), ``common.train.checkpointer.Checkpointer`` (the position: epoch, batch, step; checkpoints and
resuming), ``common.train.evaluator.Evaluator`` (an evaluation's record, best/), ``common.train.guard.StepChecks``
(loss sums, the NaN/stop guard), ``common.train.summary.Summary`` (summary.json from values),
``common.train.tracking`` (trackers, metrics.jsonl, progress, throughput). It prints through ``common.console.say``,
the one way anything prints from the main process.

What the calls promise:

- **Exact resume.** ``start`` loads the newest complete checkpoint (or the one named) into everything
  prepared and restores the epoch, batch and step; ``batches`` skips what the resumed epoch trained;
  ``augment_generator`` seeds augmentation from (seed, epoch, batch, rank), so a resumed run draws
  what the uninterrupted one drew. Learning rate, weight decay and momentum given on the resuming
  command line are applied (and printed); a checkpoint of another model, global batch or set of prepared objects
  is refused.
- **Every rank agrees, and the host never waits for the device between log steps.** ``track``
  does one small all-reduce per optimizer step carrying (loss sum, any non-finite loss?, any stop
  request?, any rank past its checkpoint time?) and reads it one step late (``common.train.guard``): a NaN/inf
  loss on any rank is masked out of the update on the device and stops every rank at the next step, before anything
  is written; ``stop_requested`` and ``checkpoint_due`` answer alike on every rank, at the same step.
- **fp16 skipped updates are counted from the loss scale** (a fused optimizer hides them from
  ``optimizer_step_was_skipped``): in summary.json's skipped_steps; too many in a row stop the run.
- **Crash-safe, one writer**: checkpoints through ``common.train.checkpoint``; the run directory is locked
  for the run's life (``common.train.rundir``).
- **How it ended** is written to ``summary.json`` (``status``) for every ending after the start (and for a resume's
  ending before it): completed, target_missed, preempted, nonfinite_loss, bad_input, storage_error, unfinished,
  crashed. Through ``accelerate launch`` every failure exits 1, so scripts should read that field.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import sys
import time
from pathlib import Path

import torch

from common.console import say
from common.data.augment import batch_generator
from common.data.batches import loader_batch, per_process_batch
from common.data.damaged import unpack
from common.data.decoded import load_image_data, place_on_device
from common.errors import EXIT_CODES, OutOfMemory, Preempted, RecipeError, Unfinished, report
from common.optimizers import zero_momentum_before_first_step
from common.schedules import batch_larger_than_split
from common.train import checkpoint as ckpt
from common.train.accelerator import launcher_answers, make_accelerator, startup_line
from common.train.checkpointer import Checkpointer
from common.train.eval_only import EvalOnly
from common.train.evaluator import Evaluator
from common.train.guard import StepChecks
from common.train.profiler import StepProfiler
from common.train.rundir import RunDir, storage_error
from common.train.sharding import describe as describe_sharding
from common.train.stopping import StopFlag
from common.train.summary import Summary
from common.train.tracking import MetricsLog, Progress, Throughput, sanitize_for_hparams

DROP_SHARE = 0.1  # training drops its last incomplete batch (equal batches) unless it holds more of the split


# Callables ``watch(run)`` run at every optimizer step, for tools that watch the loop from outside it (the tests, a
# profiler of your own): "before_update", in run.track before the guard's all-reduce (a stop request set there is
# honoured as a signal's is). Add them with ``watching``.
WATCHERS: dict[str, list] = {"before_update": []}


# At this process's exit, freeze what is alive so that the interpreter's own garbage collections at shutdown skip
# it: with torch, Accelerate, datasets and matplotlib loaded they took about 1 s of every recipe process's exit on a
# 2-core CPU (0.3 s frozen). What must be freed while the interpreter is whole (the process group's work) is freed by
# ``TrainingRun._close``; files and writers are closed by then; the memory goes back to the system with the process.
atexit.register(gc.freeze)


@contextlib.contextmanager
def watching(before_update=None):
    """Watch every run's optimizer steps inside this block (``WATCHERS``)."""
    added = [("before_update", before_update)] if before_update is not None else []
    for key, fn in added:
        WATCHERS[key].append(fn)
    try:
        yield
    finally:
        for key, fn in added:
            WATCHERS[key].remove(fn)


class EpochBatches:
    """One epoch of the training loader, as ``run.batches(loader, epoch)`` hands it to the loop: the loader's shuffle
    for this epoch (``set_epoch``: the same on every rank) and the batches a resumed epoch already trained skipped
    (Accelerate's ``skip_first_batches``). Each batch is counted when it is handed out and the time waited for it
    measured; the epoch is complete when an update has taken its last batch, or the loop asks past it. Nothing runs
    after the loop's body."""

    def __init__(self, run, loader, epoch: int):
        self.run, self.loader, self.epoch, self.it = run, loader, epoch, None
        self.ended = False  # handed out its last batch, or left by the loop

    def __iter__(self):
        run, c = self.run, self.run.ckpt
        if self.it is not None:
            return self
        first = c.enter_epoch(self.epoch)
        self.loader.set_epoch(self.epoch)  # a new shuffle every epoch, the same on every rank
        if hasattr(self.loader.dataset, "set_epoch"):  # Accelerate tells the sampler only
            self.loader.dataset.set_epoch(self.epoch)
        run.progress.begin_epoch()
        total = len(self.loader)
        if run.cfg.max_steps:  # the bar's total and ETA respect --max-steps
            total = min(total, first + max(0, run.cfg.max_steps - c.global_step) * run.cfg.grad_accum)
        self.batches = run.accelerator.skip_first_batches(self.loader, first) if first else self.loader
        self.it = iter(run.progress.wrap(self.batches, self.epoch, first, total))
        return self

    def __next__(self):
        run, c = self.run, self.run.ckpt
        if self.ended:
            raise StopIteration
        run.check_patience()
        t_wait = time.perf_counter()
        try:
            images, labels = unpack(self.loader, next(self.it))  # a photo loader's damaged photos: to its tally
        except StopIteration:
            c.epoch_exhausted()
            self.close()
            raise
        run.meter.add(labels.shape[0] * run.accelerator.num_processes, time.perf_counter() - t_wait)
        run.evaluator.say_pending()  # an evaluation the loop made in the epoch gets its own line
        c.handed_out()
        run.handed += 1
        return images, labels

    def close(self) -> None:
        """No more batches from this epoch: the bar closed, and a loader left part-way taken off Accelerate's list of
        active loaders (gather_for_metrics and --grad-accum read the newest one)."""
        if self.ended:
            return
        self.ended = True
        self.run.progress.close_bar()
        with contextlib.suppress(AttributeError, ValueError):
            getattr(self, "batches", self.loader).end()


def started_first(method):
    """A loop call made before ``run.start(...)`` is refused in one paragraph, naming both."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.ckpt is None:
            raise RecipeError(
                f"run.{method.__name__} was used before run.start(model, optimizer, scheduler, train_loader, data, "
                "transform): the run has no position, model or evaluation record yet. Call run.start(...) after "
                "accelerator.prepare(...) and before the loop, as recipes/mnist_convnet.py does."
            )
        return method(self, *args, **kwargs)

    return call


class TrainingRun:
    """One launch of a recipe: ``with TrainingRun(cfg, __file__) as run:`` in the recipe's ``main``, which then says in
    order what completes the settings and what is built from them (recipes/mnist_convnet.py). Leaving the ``with``
    block turns how the run ended into ``run.exit_code``, a one-paragraph message and summary.json's ``status``."""

    def __init__(self, cfg, recipe_file):
        """The settings completed, then what is built from them: the launcher's answers (``accelerate launch``'s
        --mixed_precision and --gradient_accumulation_steps, which count as given), a resumed run's own settings for
        every flag this command line leaves out (``--resume-from``), the Accelerator, the stop flag (signals, a
        vanished launcher) and the run directory with its lock (or, with --eval-only, the run whose weights are
        scored). Bad input ends here in one paragraph (``SystemExit`` with the run's exit code)."""
        path = Path(recipe_file).resolve()
        # the run folder is runs/<the recipe file's name>-<time>; model.json names the file for predict and export
        self.cfg, self.recipe, self.recipe_file, self.status = cfg, path.stem, str(path), "running"
        self.accelerator, self.stop, self.dir, self.note = None, None, None, ""
        self.summary = Summary(self.recipe, None)  # the clock starts now; the accelerator comes with it below
        self.data = self.model = self.optimizer = None  # checkpoints save the model; the LR is the optimizer's
        # the parts start() assembles; ckpt (the position) is set once a resume (if any) has succeeded: from then
        # on the run has started, and every ending is recorded in summary.json
        self.ckpt = self.evaluator = self.checks = self.log_file = self.progress = self.profiler = self.meter = None
        self.open_batches = None  # the epoch the loop is in (EpochBatches)
        self.finished, self.ended_early, self.last_checkpoint_t = False, "", time.time()
        self.scoring, self.exit_code = None, None
        self.validating = False  # inside the recipe's validate(): an out-of-memory error there is evaluation's
        self.patience_heard = False  # the loop asked run.no_improvement() and heard True
        self.tracked = self.handed = 0  # run.track calls and batches handed out in this launch (check_tracked)
        try:
            launch = launcher_answers(cfg)
            resume, notes = RunDir.adopt_run_settings(cfg)
            self._build(launch, resume, notes)
        except BaseException:
            if self.__exit__(*sys.exc_info()):  # one paragraph, summary.json where a run folder holds one
                raise SystemExit(self.exit_code) from None
            raise

    def __enter__(self):
        return self

    def _build(self, launch, resume, notes) -> None:
        self.accelerator, self.note = make_accelerator(self.cfg, launch)
        self.summary.accelerator = self.accelerator
        self.stop = StopFlag()
        if self.cfg.eval_only:
            if self.note:  # a training run says it in its startup line
                say(f"NOTE: {self.note}")
            self.scoring = EvalOnly(self.cfg)
            return
        self.dir = RunDir.claim(self.cfg, self.recipe, self.accelerator, planned=resume)
        self.summary.path = self.dir.path
        for note in notes:
            say(f"NOTE: {note}")

    def __exit__(self, kind, caught, traceback) -> bool:
        """How the run ended -> ``exit_code``, the one-paragraph message, summary.json. A bug or an interrupt is
        recorded ("crashed") and raised with its traceback; every other ending is handled here."""
        arrived = caught  # what left the with block; what this method meets itself is raised from here
        try:  # the newest checkpoint complete on disk before the run ends, however it ends
            if self.ckpt is not None:
                self.ckpt.wait_written()
        except BaseException as failed:  # a stop's checkpoint that did not complete: the failure is the ending
            caught = failed if caught is None or isinstance(caught, Preempted) else caught
        if caught is None and self.ckpt is not None and not self.finished:
            try:
                self._unfinished()
            except BaseException as unfinished:
                caught = unfinished
        err, handled = None, True
        if isinstance(caught, (RecipeError, Preempted)):
            err, self.status = caught, caught.status
            if isinstance(caught, Preempted):
                say(str(caught))
        elif caught is not None:
            storage = storage_error(caught, self.dir.path if self.dir else None)  # a full or read-only disk
            ending = storage or self._out_of_memory(caught)
            if ending is None:
                err, self.status, handled = caught, "crashed", False
            else:
                err, self.status = ending, ending.status
        self._close(err)
        self.exit_code = EXIT_CODES[self.status]
        if not handled and caught is not arrived:
            raise caught
        return handled

    def _out_of_memory(self, caught) -> OutOfMemory | None:
        """A GPU out-of-memory error (CUDA's, or MPS's RuntimeError) as one paragraph: the batch that did not fit and
        what keeps the run the same in smaller batches (training: --grad-accum, the same global batch in smaller
        micro-batches, in a new run, as a resume keeps its own; evaluation: --eval-batch-size, which a resume may
        change). None for any other error."""
        text = str(caught).strip()
        oom = isinstance(caught, torch.OutOfMemoryError) or (
            isinstance(caught, RuntimeError) and "out of memory" in text.lower() and "MPS" in text
        )
        if not oom or self.accelerator is None:
            return None
        cfg, n = self.cfg, self.accelerator.num_processes
        said = f"({type(caught).__name__}: {text.splitlines()[0] if text else 'out of memory'})"
        if self.validating:
            batch = loader_batch(cfg, n, train=False)
            smaller = max(1, cfg.eval_batch_size // 2)
            how = (
                "run --eval-only again"
                if cfg.eval_only
                else "rerun the same command with --resume-from latest (the last complete checkpoint)"
            )
            return OutOfMemory(
                f"The GPU ran out of memory in evaluation {said}: an evaluation batch of {batch} images per process "
                f"did not fit (--eval-batch-size {cfg.eval_batch_size} over {n} process(es)). The scores do not "
                f"depend on it: {how} with --eval-batch-size {smaller}."
            )
        batch = per_process_batch(cfg, n)
        step = f" at step {self.ckpt.global_step}" if self.ckpt is not None else ""
        fit = (
            f"A training micro-batch of {batch} images per process did not fit (--batch-size {cfg.batch_size} over "
            f"{n} process(es) and --grad-accum {cfg.grad_accum})"
        )
        factor = next((m for m in range(2, batch + 1) if batch % m == 0), None)
        if factor is None:
            return OutOfMemory(
                f"The GPU ran out of memory in training{step} {said}. {fit}: one image does not fit. Train a smaller "
                "model or --image-size, or on a GPU with more memory."
            )
        return OutOfMemory(
            f"The GPU ran out of memory in training{step} {said}. {fit}. The same run in micro-batches of "
            f"{batch // factor}: start it again in a new --output-dir with --grad-accum {cfg.grad_accum * factor} "
            "(the global batch, the learning rate and the schedule stay as they are; a resume keeps the run's own "
            "--grad-accum, as its saved data position counts micro-batches). Or lower --batch-size (the LR follows "
            "the LR rule) or --image-size, which changes the run."
        )

    def _validate(self, validate, loader):
        """``validate(loader)``, the recipe's evaluation; while it runs an out-of-memory error is evaluation's."""
        self.validating = True
        metrics = validate(loader)
        self.validating = False
        return metrics

    def _close(self, err) -> None:
        if err is not None:
            self.summary.write_ending(self.status, err, self._position(), self.ckpt is not None, self.resuming)
        if isinstance(err, RecipeError):  # after summary.json: bad input is said once, and other processes wait
            report(err)  # for the main one to say it (common.errors.report)
        # signal handlers and the launcher watch; a --profile trace
        for part in (self.stop, self.profiler):
            if part is not None:
                part.close()
        if self.progress is not None:
            self.progress.close_bar()
        if self.open_batches is not None:
            self.open_batches.close()
        if self.log_file is not None and err is not None:
            with contextlib.suppress(OSError):  # a full disk: the trackers' files stay as they were
                self.log_file.close()
        if self.dir is not None:
            self.dir.release(started=self.ckpt is not None)  # a folder this start made and left empty goes too
        if self.accelerator is not None and err is None:  # every rank got here: all together (MetricsLog.close: why)
            self.accelerator.wait_for_everyone()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # What holds the process group's work (the DDP wrapper, Accelerate's references to everything
                # prepared) is freed first, while the interpreter is whole: a gloo work object freed during
                # interpreter teardown aborts the process ("terminate called without an active exception"), which
                # the launcher reports as a failure of a run that ended well. One process has no group: its run
                # ends without the two garbage collections (about 0.4 s on a 2-core CPU).
                self.model = self.optimizer = self.evaluator = None
                self.accelerator.free_memory()
                gc.collect()
                self.accelerator.state.destroy_process_group()

    def _position(self) -> dict:
        """summary.json's record of how far the run got (an update the loop applied just before an error counts)."""
        c = self.ckpt
        position = {
            "best": {self.cfg.monitor: self.best},
            "epochs_completed": c.epochs_completed if c else 0,
            "global_step": c.global_step if c else 0,
            "skipped_steps": self.checks.skipped if self.checks else 0,
        }
        if c is None and self.resuming:  # a resume that ended before training: where the run it resumes is
            with contextlib.suppress(Exception):
                state = ckpt.read_state(self.dir.resume_path)
                position.update(
                    best={self.cfg.monitor: state.get("best")},
                    epochs_completed=state["epoch"],
                    global_step=state["global_step"],
                    skipped_steps=state.get("skipped_steps", 0),
                )
        if self.ended_early:
            position["ended_early"] = self.ended_early
        damaged = self.data.damaged if self.data is not None else None
        if damaged is not None:
            position["damaged_photos"] = damaged.listing()
        return position

    def _unfinished(self) -> None:
        """train() returned without run.finish(): the position is checkpointed (a resume continues exactly), then
        the run ends saying so."""
        c = self.ckpt
        where = self.checkpoint()  # the newest one, when it is where the run is
        self.ckpt.wait_written()
        raise Unfinished(
            f"train() returned without calling run.finish(...) at optimizer step {c.global_step} "
            f"(epoch {c.epoch + 1}): no final evaluation and no final/ weights. The position is "
            f"checkpointed ({where}): rerun with --resume-from latest to continue. To end a run early, "
            "`break` out of the epoch loop instead; run.finish(...) then evaluates and saves it."
        )

    # --- the loop's calls: each says how; the recipe's loop says when ------------------------------------------

    @started_first
    def batches(self, loader, epoch: int) -> EpochBatches:
        """Epoch ``epoch``'s batches of ``loader`` (the training loader): its shuffle set (the same on every rank) and
        the batches a resumed epoch already trained skipped. Counts the batches as it hands them out; the epoch is
        complete once an update has taken its last batch (or the loop asks past it). The epoch before gets its line
        here (its loss, the evaluation made after it, its time), whatever the loop did after its batches."""
        self._say_epoch_line()
        self.open_batches = EpochBatches(self, loader, epoch)
        return self.open_batches

    @property
    @started_first
    def batch(self) -> int:
        """The number of the batch in the loop's hands (1-based; batches of this epoch handed out so far, those of a
        resumed epoch trained before the resume included, where enumerate() restarts at 0): ``if run.batch == k:
        break`` at the end of the body ends every epoch after k batches, resumed or not."""
        return self.ckpt.batch

    @started_first
    def track(self, loss: torch.Tensor) -> None:
        """After ``accelerator.backward(loss)``, before ``optimizer.step()``; the one call the loop cannot leave out (a
        loop that goes a whole optimizer step without it is refused: ``check_tracked``). The loss joins the step's sums;
        at an optimizer step (``accelerator.sync_gradients``) the update is counted (``run.step`` moves on, and with it
        the position a checkpoint records) and the guard does its one small all-reduce (``common.train.guard``): a
        non-finite loss on any rank is masked out of this update and stops every rank at the next step; stop and
        checkpoint requests are agreed on. No device sync (fp16: one, the loss scale, for the update before)."""
        self.tracked += 1
        self.checks.track(loss)
        if not self.accelerator.sync_gradients:
            self.ckpt.micro_batch()
            return
        self.checks.read_skip()  # fp16: was the update before skipped by loss scaling? (a sync, fp16 only)
        for watch in WATCHERS["before_update"]:
            watch(self)
        every_s = self.cfg.checkpoint_every_s
        wanted = bool(every_s) and time.time() - self.last_checkpoint_t >= every_s
        self.checks.check(bool(self.stop), self.ckpt.global_step + 1, self.ckpt.epoch, wanted)
        self.meter.lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, before the scheduler moves it
        self.ckpt.update()
        if self.summary.first_step_at is None:  # start-up cost, launch to the first update (summary.json timing)
            self.summary.first_step_at = time.time()
        self.profiler.step()

    def check_tracked(self, call: str) -> None:
        """A loop that reaches its after-update lines once a whole optimizer step's batches went by in this launch
        without a run.track call is refused: it would train without the update being counted. (A line before
        run.track in the first batch's body is not such a loop.)"""
        if self.tracked or self.handed <= self.cfg.grad_accum:
            return
        raise RecipeError(
            f"run.{call}() was reached after {self.handed} batch(es) without a call of run.track(loss) in the loop. "
            "That line, after accelerator.backward(loss) and before optimizer.step(), is the one a loop cannot "
            "leave out: it counts the update (run.step and the position a checkpoint records, so a resume neither "
            "repeats nor skips a batch), keeps a non-finite loss out of the weights, and lets every process agree on "
            "a stop or a checkpoint at the same step. Put `run.track(loss)` back where recipes/mnist_convnet.py has "
            "it (it logs nothing by itself: run.log does)."
        )

    @property
    @started_first
    def step(self) -> int:
        """Optimizer updates taken, counted by run.track at each --grad-accum boundary: after it in the loop's body,
        the update being made (an fp16 update the loss scaler skips is one too, counted in skipped_steps)."""
        return self.ckpt.global_step

    @started_first
    def log(self, values: dict | None = None) -> None:
        """The training loss (mean since the last log), LR and throughput, and ``values``, the loop's own scalars (e.g.
        ``{"train/grad_norm": norm}``, the norm clip_grad_norm_ returned; a tensor is read here, a None left out), at
        ``run.step`` to metrics.jsonl, every tracker, curves.png and the progress line (``accelerator.log(values,
        step=run.step)`` reaches the same places). Reads the step's flags first: nothing is logged after a
        non-finite loss. Waits for no other process: the line may be guarded by ``accelerator.is_main_process``."""
        self.check_tracked("log")
        self._log(values)

    def _log(self, values: dict | None = None) -> None:
        self.checks.settle(self.ckpt.epoch)
        loss_sum, count = self.checks.window_loss()
        own = {k: float(v) for k, v in (values or {}).items() if v is not None}
        if not count and not own:
            return
        row = {"train/lr": self.meter.lr, **self.meter.read_and_reset(), **own}
        row = {k: v for k, v in row.items() if v is not None}  # the LR is known once an update was counted
        loss = None
        if count:
            row["train/loss"] = loss = loss_sum / count
        self.log_file.log(row, step=self.ckpt.global_step)
        self.progress.update(self.ckpt.global_step, self.ckpt.epoch, loss, row["train/samples_per_sec"])

    @started_first
    def evaluate(self, validate, loader, pictures: bool = False) -> None:
        """Evaluate now: ``validate(loader)`` (the recipe's; ``loader`` None when there is no validation split), its
        scalars recorded, and best/ kept when --monitor improved; with ``pictures``, its confusion matrix and
        misclassified images drawn into TensorBoard now (about a second on a 2-core CPU; the final evaluation's are
        always drawn). Weights already evaluated at this step (an --eval-every-steps step that ends an epoch) are not
        evaluated again. Every process calls it (the predictions are gathered)."""
        c = self.ckpt
        if loader is None or self.evaluator.scored_at(c.global_step) is not None:
            return
        self.checks.settle(c.epoch)  # nothing is evaluated or recorded after a non-finite loss
        metrics = self._validate(validate, loader)  # a stop request meanwhile: acted on at the next step (exit 75)
        self.evaluator.record(metrics, c.global_step, c.epoch, pictures)
        self.progress.note_eval(self.evaluator.seconds)

    @started_first
    def no_improvement(self) -> bool:
        """--patience: True once that many evaluations in a row did not improve --monitor (never without --patience).
        The loop's break lines ask it (beside --max-steps'), so the run ends as a ``break`` ends it: run.finish, the
        final evaluation, ``ended_early`` said. The count comes from the gathered metrics, the same on every rank, and
        is kept in checkpoints: a resume continues it."""
        out = bool(self.cfg.patience) and self.evaluator.stale >= self.cfg.patience
        self.patience_heard = self.patience_heard or out
        return out

    def check_patience(self) -> None:
        """A loop that takes another batch after --patience ran out without asking ``run.no_improvement()`` (its break
        lines were edited away) would train on silently: refused, naming the line."""
        cfg = self.cfg
        if cfg.patience and not self.patience_heard and self.evaluator.stale >= cfg.patience:
            raise RecipeError(
                f"--patience {cfg.patience}: {self.evaluator.stale} evaluations in a row without a {cfg.monitor} "
                f"improvement, at step {self.ckpt.global_step}, but the loop took another batch without asking "
                "run.no_improvement(). Its break lines end the run there (`if run.step >= last_step or "
                "run.no_improvement(): break`, docs/loop.md): put them back, or run without --patience. The "
                "checkpoints written so far are intact."
            )

    @started_first
    def stop_requested(self) -> bool:
        """A stop request (a signal, a lost launcher, too many damaged photos) on any rank, agreed by every rank at the
        same step (read with the guard's flags at run.track: no sync of its own, and the same answer on every rank
        whatever else one rank calls)."""
        self.check_tracked("stop_requested")
        return self.checks.stopping

    @started_first
    def preempt(self) -> None:
        """Checkpoint here, then end the run: exit 75, and the same command with --resume-from latest continues."""
        self.checks.settle(self.ckpt.epoch)
        path = self.checkpoint()
        self.ckpt.wait_written()  # complete on disk before exit 75 says so (a failure there ends the run with it)
        self._damaged_past_share()  # a stop for too many damaged photos on some rank: their paragraph
        raise Preempted(
            f"stopped by {self.stop.reason or 'a stop request on another process'} at step "
            f"{self.ckpt.global_step}: checkpoint written to {path}. Rerun the same command with "
            f"--output-dir {self.dir.path} --resume-from latest to continue."
        )

    @started_first
    def checkpoint_due(self) -> bool:
        """Every --checkpoint-every steps, and once --checkpoint-every-s seconds have passed since the last checkpoint
        (on any rank: agreed through the guard at run.track, so every rank answers alike at the same step)."""
        self.check_tracked("checkpoint_due")
        every, step = self.cfg.checkpoint_every, self.ckpt.global_step
        due = bool(every) and step > 0 and step % every == 0  # (step 0: no update to keep)
        return due or self.checks.checkpoint_wanted

    @started_first
    def checkpoint(self) -> Path:
        """A crash-safe checkpoint of everything prepared and the position, written by every rank together
        (``common.train.checkpoint``); the best value with it is that of the evaluations recorded so far. It returns
        once the files are written; the main process makes them durable and marks the folder complete in a thread
        while training goes on (the next checkpoint, the end of the run and a stop wait for it)."""
        self.checks.settle(self.ckpt.epoch)  # nothing is written after a non-finite loss
        self.checks.read_skip()  # the skipped_steps it records count the last update
        self.checks.checkpoint_written()
        if self.ckpt.saved == self.ckpt.position():  # nothing trained since: that one
            return self.ckpt.saved_path
        path = self.ckpt.save(self.model, self.best, self.checks.skipped, self.evaluator.stale)
        self.last_checkpoint_t = time.time()
        return path

    def _damaged_past_share(self) -> None:
        """Every rank's damaged photos gathered (a collective: every rank calls it at the same point); past
        --max-damaged, every rank ends with the same paragraph naming them."""
        error = self.data.damaged.stop_error(self.accelerator) if self.data.damaged is not None else None
        if error is not None:
            raise error

    def _say_epoch_line(self) -> None:
        """The line of the epoch the loop was in (its training loss, the evaluation made after it, its time), said
        when the loop moves to the next epoch or the run ends; a part-way epoch says how far it got."""
        batches, self.open_batches = self.open_batches, None
        if batches is None:
            return
        batches.close()
        c = self.ckpt
        self.checks.settle(c.epoch)
        epoch, trained, _ = c.position()
        line = f"epoch {batches.epoch + 1}/{self.cfg.epochs}"
        if epoch == batches.epoch:  # not complete
            cut = bool(self.cfg.max_steps) and c.global_step >= self.cfg.max_steps
            line += f", {'stopped at --max-steps' if cut else 'ended by the loop'}"
            line += f" after {trained} of {c.batches_per_epoch} batches"
        loss_sum, count = self.checks.epoch_loss()
        line += f": train loss {loss_sum / count:.4f}" if count else ":"
        say(f"{line}{self.evaluator.epoch_line()} | {self.progress.epoch_seconds():.1f} s")

    @started_first
    def augment_generator(self) -> torch.Generator:
        """Augmentation draws for this batch, seeded by (seed, epoch, batch, rank): no RNG state to save."""
        return batch_generator(
            self.cfg.seed, self.ckpt.epoch, self.ckpt.batch - 1, self.accelerator.process_index, self.accelerator.device
        )

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
        if data.damaged is not None:  # past --max-damaged, damaged photos stop the run at a step boundary
            self.stop.watch(data.damaged)
        if data.note:
            say(f"data {data.source}: {data.note}")
        self._add_note(place_on_device(self.cfg, self.accelerator, data))
        self.data = data
        return data

    def normalisation(self, compute) -> tuple[list[float], list[float]]:
        """The per-channel mean and std the model's inputs are normalised with: ``compute()``, the recipe's rule (the
        training split's statistics, or pretrained weights' own); under --eval-only the ones the scored run recorded
        in model.json, so its weights are scored on the pixels they were trained on, whatever data is scored."""
        recorded = self.scoring.normalisation() if self.scoring is not None else None
        return recorded if recorded is not None else compute()

    def _add_note(self, note: str | None) -> None:
        """A NOTE for the startup line, which run.start says (beside the launcher's and the Accelerator's)."""
        self.note = "; ".join(n for n in (self.note, note) if n)

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
                self._add_note(
                    f"the last training batch of each epoch is kept ({left} of {len(split)} images; dropping it "
                    f"would lose {left / len(split):.0%} of every epoch)"
                )
        return self.data.make_loader(self.cfg, self.accelerator, split, train, self.data.on_device, **options)

    # --- resume or fresh start -------------------------------------------------------------------

    def start(self, model, optimizer, scheduler, train_loader, data, transform, *, scored=None) -> None:
        """Fresh, or resumed exactly from the newest complete checkpoint: everything prepared loaded, and the position
        (``run.epoch``, ``run.step``; ``run.batches`` skips what a resumed epoch trained). ``scored``: the module
        evaluated and saved in best/ and final/ when it is not ``model`` (an EMA copy).

        What it does to ``optimizer`` (``common.train.guard``, ``common.optimizers``): a fused one gets a
        ``found_inf`` tensor, GradScaler's, so that a non-finite loss skips the update on the device; under fp16 a
        fused one takes GradScaler's own path instead (``_step_supports_amp_scaling = False``), so that Accelerate
        sees a skipped update; a fused SGD with momentum gets a step pre-hook that runs once, before its first step
        (zeroed momentum buffers). Nothing else hooks or wraps it."""
        cfg, acc = self.cfg, self.accelerator
        self.model, self.optimizer, self.data = model, optimizer, data
        sides = getattr(train_loader.dataset, "sides", None)  # the photo recipe's progressive resizing, said on resume
        position = Checkpointer(cfg, acc, self.dir.path, self.dir.resume_path, len(train_loader), data, sides)
        state = position.start(model, optimizer, scheduler)  # the newest readable checkpoint's, or a fresh start's
        self.ckpt = position  # started: every ending from here on is recorded in summary.json
        unwrapped = acc.unwrap_model(model, keep_torch_compile=False)
        card = ckpt.model_card(self.recipe, self.recipe_file, unwrapped, data, transform, cfg)
        resumed = position.global_step if position.resume_path is not None else None
        self.log_file = MetricsLog(
            acc, self.dir.path, resumed, self.recipe, sanitize_for_hparams(dataclasses.asdict(cfg))
        )
        stale = state.get("stale_evaluations", 0)  # --patience's count (none in a checkpoint written before it)
        evaluated = model if scored is None else scored
        self.evaluator = Evaluator(cfg, acc, evaluated, data, self.log_file, card, self.dir.path, state["best"], stale)
        # the guard (common.train.guard)
        self.checks = StepChecks(acc, optimizer, self.dir.path, state["skipped_steps"])
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
        self.progress.begin(position.global_step)
        self.summary.train_start = self.last_checkpoint_t = time.time()
        # "running" first: a start killed outright (OOM, node loss) leaves its own status, not an earlier start's
        self.summary.write(self.status, self._position())

    @property
    @started_first
    def epoch(self) -> int:
        """The epoch running (0-based)."""
        return self.ckpt.epoch

    @property
    def best(self):
        """The best --monitor value so far (kept in best/ and in every checkpoint)."""
        return self.evaluator.best if self.evaluator is not None else None

    # --- the end ---------------------------------------------------------------------------------

    @started_first
    def finish(self, validate, loader) -> None:
        """The end of the run: a checkpoint of where it is (unless the newest one is), then the final evaluation
        (``validate(loader)``: the test split, else validation), final/ weights, hparams, summary.json, curves.png and
        confusion_matrix.png, and the --target-accuracy check. A stop request by then ends the run after the
        checkpoint (exit 75: the same command evaluates and saves); one during the final evaluation ends it at once
        (the checkpoint holds everything trained). Without a test split the final split is validation: when
        ``run.evaluate`` scored it at this step, that result is the final one and it is not scored again."""
        c = self.ckpt
        self.finished = True
        self._say_epoch_line()  # the epoch the loop was in, complete or not
        self.evaluator.say_pending()
        self._log()  # a partial window (e.g. --max-steps below --log-every) is logged too (its flags read first)
        self.checkpoint()
        self.checks.release()  # every rank is here: flags one rank read early (its own run.log) count now
        if self.checks.stopping:
            self.preempt()
        if not c.last_step() and not (self.cfg.max_steps and c.global_step >= self.cfg.max_steps):
            self.ended_early = (
                f"the loop ended the run at step {c.global_step} of {c.steps_per_epoch * self.cfg.epochs}"
            )
            if self.patience_heard:
                self.ended_early += (
                    f": --patience {self.cfg.patience}, {self.evaluator.stale} evaluations in a row without a "
                    f"{self.cfg.monitor} improvement"
                )
            say(f"NOTE: {self.ended_early} (final evaluation, final/, summary.json).")
        # without a test split the final split is validation: weights it scored at this step are not scored again
        metrics = self.evaluator.scored_at(c.global_step) if self.data.test is None else None
        if metrics is None:
            self.stop.interruptible("running the final evaluation")
            metrics = self._validate(validate, loader)  # while the main process completes the checkpoint (a thread)
        self.stop.interruptible(None)  # final/ and summary.json are written whole
        self.ckpt.wait_written()
        self._damaged_past_share()  # held to --max-damaged as in training: no score of what is left
        split, final, confusion = self.evaluator.final(metrics, c.global_step, c.epochs_completed)
        if self.best is None and not (self.dir.path / "best").is_dir():
            say(
                "NOTE: the loop made no evaluation during the run, so best/ was not written; predict, export and "
                f"--eval-only of {self.dir.path} use final/."
            )
        self.log_file.hparams({k: v for k, v in final.items() if not k.endswith("/count")})
        self.log_file.close()
        curves = self.log_file.curves()
        self.status = self.summary.finish(self.cfg, self._position(), split, final, confusion, curves)

    # --- --eval-only (common.train.eval_only) -------------------------------------------------------------

    def eval_only(self, model, validate, loader) -> None:
        """--eval-only: the weights in --checkpoint (a run, best/, final/ or a checkpoint folder) loaded into ``model``,
        scored with ``validate(loader)``, printed and written to eval-<split>.json beside them (a new file if one
        exists); below --target-accuracy the run ends ``target_missed``. A stop request ends it at once (nothing to
        save)."""
        self.stop.interruptible("evaluating (--eval-only)")
        self.scoring.load(self.accelerator, model, self.data)
        metrics = self._validate(validate, loader)
        self.stop.interruptible(None)
        self._damaged_past_share()  # held to --max-damaged: no score of what is left
        if self.scoring.report(self.accelerator, self.data, metrics):
            self.status = "target_missed"
