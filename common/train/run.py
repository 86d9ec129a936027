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
``common.train.loop.TrainingLoop``'s, this class's base. The run assembles parts that each own their state:
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

import contextlib
import dataclasses
import gc
import inspect
import time
from pathlib import Path

from common.console import say
from common.data import photo_check
from common.data.batches import loader_batch
from common.data.decoded import load_image_data, place_on_device
from common.errors import EXIT_CODES, Preempted, RecipeError, Unfinished, UnreadablePhoto, report
from common.optimizers import zero_momentum_before_first_step
from common.schedules import batch_larger_than_split
from common.train import checkpoint as ckpt
from common.train.accelerator import make_accelerator, sharding, startup_line
from common.train.checkpointer import Checkpointer
from common.train.eval_only import EvalOnly
from common.train.evaluator import Evaluator
from common.train.guard import StepChecks
from common.train.loop import LoopState, TrainingLoop
from common.train.profiler import StepProfiler
from common.train.rundir import RunDir, storage_error
from common.train.stopping import StopFlag
from common.train.summary import Summary
from common.train.tracking import MetricsLog, Progress, Throughput, sanitize_for_hparams

DROP_SHARE = 0.1  # training drops its last incomplete batch (equal batches) unless it holds more of the split


class TrainingRun(TrainingLoop):
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
            self.accelerator, self.note = make_accelerator(self.cfg)
            self.summary.accelerator = self.accelerator
            self.stop = StopFlag()
            if self.cfg.eval_only:
                self.eval_only = EvalOnly(self.cfg)
            else:
                self.dir = RunDir.claim(self.cfg, self.recipe, self.accelerator)
                self.summary.path = self.dir.path
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
        say(startup_line(acc, cfg, position.steps_per_epoch, self.note, sharding(acc, model)))
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
        self.status = self.summary.finish(self.cfg, self._position(), split, final, confusion)

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
