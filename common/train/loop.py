"""Where the recipe's loop is (``LoopState``), read by ``TrainingRun``'s loop calls (``run.epochs()``,
``run.batches()``, ``run.step()``, ``run.step_taken()``) to finish what the loop left open.

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

import dataclasses


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
