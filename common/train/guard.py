"""The per-step checks that keep every rank in agreement, without making the host wait for the device.

``StepGuard``: each micro-step's loss is added on the device. Once per optimizer step, before
``optimizer.step()``, one all-reduce of five numbers (loss sum, loss count, non-finite count, stop
requests, checkpoint requests) tells every rank whether any rank saw a non-finite loss, has a stop request or has
reached its checkpoint time (--checkpoint-every-s: ranks' clocks differ, so the ranks agree through this sum).
Nothing reads that result at once:

- **the update is masked on the device**: a fused optimizer (SGD/AdamW ``fused=True``, on a GPU and on a
  CPU) takes a ``found_inf`` flag, as GradScaler uses it, and skips the step when it is 1. The guard sets
  it from the all-reduced loss sum (a non-finite loss on any rank makes the sum non-finite), so a NaN
  never reaches the weights, on every rank, without the host looking;
- **the host reads the flags one step late**: they are copied to host memory asynchronously (pinned,
  ``non_blocking``, an event) and read at the next optimizer step, by which time the device has long
  finished them. A non-finite loss then stops every rank (weights as before the bad step), and a stop
  or checkpoint request is seen by every rank at the same step. At steps that write or log anything (log,
  checkpoint, evaluation, the end) the flags of that very step are read first, so nothing is ever
  written after a non-finite loss.

With an optimizer that takes no ``found_inf`` (not fused), the flags are read at once, before the
update: correct, with one sync per step. With fp16 a non-finite loss is the loss scaler's business (it
skips the step, so the flags are read late there too); it is left out of the logged mean, never logged as 0.

The logged loss sums stay on the device too, read only at log steps and epoch ends.

``LossScaleWatch``: with fp16 the GradScaler halves its scale on every step it skips. Reading the
scale is the reliable test: with a fused optimizer GradScaler always calls ``step()``, so
``accelerator.optimizer_step_was_skipped`` is always False. Too many skips in a row stop the run.
NOTE: this reads the scale every step (a sync, fp16 only): the schedule must not advance on a skipped step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.errors import NonFiniteLoss
from common.train.checkpoint import complete_checkpoints, step_of

MAX_CONSECUTIVE_SKIPS = 25  # 25 halvings take the loss scale from 65536 below 0.002


@dataclass
class Flags:
    step: int  # the optimizer step they belong to
    nonfinite: bool  # a non-finite loss on some rank
    stop: bool  # a stop request on some rank
    checkpoint: bool = False  # some rank reached its --checkpoint-every-s time


class StepGuard:
    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        device = accelerator.device
        self.fp16 = accelerator.mixed_precision == "fp16"
        # loss sum, loss count, non-finite count, stop and checkpoint requests; the step's all-reduced copy; the loss
        # sums and counts of the window since the last log step and of the epoch. Views of them are made once: an
        # in-place op on a view is one op dispatched, where `sums[0] += x` is four (a select, the add, a select and
        # the copy back), and on a GPU each op is a launch the host pays for at every step.
        self.sums, self.reduced = torch.zeros(5, device=device), torch.zeros(5, device=device)
        self.loss_slot, self.count_slot, self.stop_slot, self.checkpoint_slot = (self.sums[i] for i in (0, 1, 3, 4))
        self.reduced_loss, self.reduced_pair = self.reduced[0], self.reduced[:2]
        self.totals = torch.zeros(2, 2, device=device)
        self.window, self.epoch = self.totals[0], self.totals[1]
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside Accelerate's wrapper
        self.masks = bool(inner.defaults.get("fused")) and not self.fp16  # fp16: GradScaler sets found_inf
        # The flags may be read a step late when a non-finite loss cannot reach the weights without the host: masked
        # on the device, or (fp16) skipped by the loss scaler. Otherwise they are read before the update (a wait).
        self.late = self.masks or self.fp16
        if self.masks:
            self.found_inf = torch.zeros((), device=device)  # 0-dim, as GradScaler makes it
            inner.found_inf = self.found_inf  # read by the fused kernel at every step() (torch's GradScaler API)
        if self.fp16 and getattr(inner, "_step_supports_amp_scaling", False):
            # A fused optimizer takes GradScaler's skip inside its kernel, where Accelerate cannot see it (its
            # optimizer_step_was_skipped stays False, and its scheduler would move). GradScaler's own path instead:
            # unscale, then step only when the gradients are finite (one sync a step, fp16 only, as for any other
            # optimizer); a skipped update is then one Accelerate sees.
            inner._step_supports_amp_scaling = False
        cuda = device.type == "cuda"
        self.host = torch.zeros(5, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending: int | None = None  # the step whose flags are on their way to self.host

    def track(self, loss: torch.Tensor) -> None:
        with torch.no_grad():  # no graph: the sums are bookkeeping, not part of the model's computation
            if self.fp16:
                finite = torch.isfinite(loss)
                self.sums[:3] += torch.stack(
                    [torch.where(finite, loss.float(), 0.0), finite.float(), (~finite).float()]
                )
            else:  # a non-finite loss makes the sum non-finite: found at check time, one kernel here
                self.loss_slot.add_(loss)
                self.count_slot.add_(1)

    def check(self, stop_requested: bool, step: int, checkpoint_wanted: bool = False) -> Flags | None:
        """Before ``optimizer.step()`` of ``step``: one all-reduce, the device-side mask, and the flags of
        the step before (read now, late) or, without masking, of this one (read now, a sync)."""
        earlier = self.collect()
        if stop_requested:  # the slots are 0 otherwise (zeroed after every check): filled, not copied from the host
            self.stop_slot.fill_(1.0)
        if checkpoint_wanted:
            self.checkpoint_slot.fill_(1.0)
        if self.accelerator.num_processes > 1:
            self.reduced.copy_(self.accelerator.reduce(self.sums, "sum"))
        else:
            self.reduced.copy_(self.sums)
        self.sums.zero_()
        if self.masks:
            spread = self.reduced_loss - self.reduced_loss  # 0 for a finite sum, NaN for an infinite or NaN one
            torch.ne(spread, spread, out=self.found_inf)  # 1 where NaN: two ops, where ~isfinite() is five
        self.totals.add_(self.reduced_pair)  # the window's and the epoch's sums, in one op
        self.host.copy_(self.reduced, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
        self.pending = step
        if self.late:
            return earlier
        now = self.collect()  # nothing can skip this update on the device: decide before it
        if earlier is None:
            return now
        return Flags(
            step, earlier.nonfinite or now.nonfinite, earlier.stop or now.stop, earlier.checkpoint or now.checkpoint
        )

    def collect(self) -> Flags | None:
        """The flags in flight, if any, read from host memory."""
        if self.pending is None:
            return None
        if self.event is not None:
            self.event.synchronize()  # recorded a step ago: long done
        loss_sum, _, nonfinite, stops, checkpoints = self.host.numpy().tolist()  # host memory, not the device
        step, self.pending = self.pending, None
        bad = nonfinite > 0 if self.fp16 else not math.isfinite(loss_sum)
        return Flags(step, bad, stops > 0, checkpoints > 0)

    @staticmethod
    def read(sums: torch.Tensor) -> tuple[float, float]:
        """(loss sum, count) of a window or epoch, then zeroed: a sync, at log steps and epoch ends only."""
        loss_sum, count = sums.tolist()
        sums.zero_()
        return loss_sum, count


class LossScaleWatch:
    def __init__(self, scaler):
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scale = self.scaler.get_scale() if self.scaler is not None else None
        self.skipped, self.in_a_row = 0, 0

    def step_taken(self) -> bool:
        """After ``optimizer.step()``: False when the scaler skipped it. A device sync, fp16 only."""
        if self.scaler is None:
            return True
        scale = self.scaler.get_scale()
        skipped, self.scale = scale < self.scale, scale
        self.skipped += int(skipped)
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteLoss(
                f"fp16 loss scaling skipped the last {self.in_a_row} optimizer steps in a row (loss scale now "
                f"{scale:g}): the gradients overflow at every step, so the model no longer trains. Lower --lr, set "
                "--max-grad-norm, or train in bf16 (accelerate_configs/multi_gpu_bf16.yaml), then rerun with "
                "--resume-from latest."
            )
        return not skipped


class StepChecks:
    """The run's side of the guard: the flags acted on when they arrive (a non-finite loss ends the run naming
    the checkpoint to resume; a stop or checkpoint request is kept for the loop to ask about), and fp16 skips
    counted.

    A stop or checkpoint request becomes the loop's answer (``stopping``, ``checkpoint_wanted``) only at ``check``,
    which every rank makes at every optimizer step: flags one rank read earlier (its ``settle`` at a log step the
    loop runs on the main process only) are held until then, so every rank answers alike at the same step whatever
    else one rank calls."""

    def __init__(self, accelerator, optimizer, run_dir, skipped_before: int = 0):
        self.guard, self.scale_watch = StepGuard(accelerator, optimizer), LossScaleWatch(accelerator.scaler)
        self.fp16, self.run_dir = accelerator.mixed_precision == "fp16", run_dir
        self.skipped_before, self.stopping, self.checkpoint_wanted = skipped_before, False, False
        self.held_stop = self.held_checkpoint = False  # read by settle, not yet released
        self.unread = False  # fp16: an update counted whose loss-scale verdict is not read yet (``read_skip``)

    def track(self, loss: torch.Tensor) -> None:
        """A micro-step's loss into the step's sums, on the device (no sync)."""
        self.guard.track(loss)

    def update_taken(self) -> bool:
        """After an optimizer step: False when fp16 loss scaling skipped its update (reads the scale: a sync, fp16
        only; counts the skip)."""
        return self.scale_watch.step_taken()

    def read_skip(self) -> None:
        """fp16: whether the update ``check`` last counted was skipped by loss scaling, read once, after its
        ``optimizer.step()`` (at the next ``check``, or before a checkpoint records ``skipped``). A sync, fp16 only."""
        if self.unread:
            self.unread = False
            self.update_taken()

    def window_loss(self) -> tuple[float, float]:
        """(loss sum, count) since the last log step, then zeroed (a sync)."""
        return self.guard.read(self.guard.window)

    def epoch_loss(self) -> tuple[float, float]:
        """(loss sum, count) of the epoch, then zeroed (a sync)."""
        return self.guard.read(self.guard.epoch)

    def check(self, stop_requested: bool, step: int, epoch: int, checkpoint_wanted: bool = False) -> None:
        """Before ``optimizer.step()``: the all-reduce, no sync; acts on the previous step's flags and releases what
        was held."""
        self.act_on(self.guard.check(stop_requested, step, checkpoint_wanted), epoch)
        self.release()
        self.unread = self.fp16  # the update follows: its verdict is read after its optimizer.step()

    def settle(self, epoch: int) -> None:
        """Read this step's flags now (a sync): before anything is logged, evaluated or written. A non-finite loss
        raises at once; stop and checkpoint requests wait for the next ``check`` (or ``release``)."""
        self.act_on(self.guard.collect(), epoch)

    def release(self) -> None:
        """Held requests become the loop's answers: at ``check``, and where every rank is at once (the run's end)."""
        self.stopping = self.stopping or self.held_stop
        self.checkpoint_wanted = self.checkpoint_wanted or self.held_checkpoint
        self.held_stop = self.held_checkpoint = False

    def checkpoint_written(self) -> None:
        """A checkpoint is being written at this step (by every rank, after ``settle``): the requests so far are met."""
        self.checkpoint_wanted = self.held_checkpoint = False

    def act_on(self, flags: Flags | None, epoch: int) -> None:
        if flags is None:
            return
        if flags.nonfinite and not self.fp16:  # with fp16 the loss scaler skips the step instead
            raise NonFiniteLoss(nonfinite_advice(self.run_dir, flags.step, epoch))
        self.held_stop = self.held_stop or flags.stop
        self.held_checkpoint = self.held_checkpoint or flags.checkpoint

    @property
    def skipped(self) -> int:
        return self.skipped_before + self.scale_watch.skipped


def nonfinite_advice(run_dir, step: int, epoch: int) -> str:
    """Name a checkpoint worth resuming: one older than the last update, which produced these weights."""
    usable = [p for p in complete_checkpoints(run_dir) if step_of(p) < step - 1]
    where = (
        f"Last good checkpoint (from before the update that led here): {usable[-1]}. Rerun the same command "
        f"with a lower --lr (or --max-grad-norm) and --resume-from {usable[-1]}; the new values apply on resume."
        if usable
        else "No checkpoint predates the update that led here: start a new run with a lower --lr (or --max-grad-norm)."
    )
    return (
        f"the training loss became non-finite at optimizer step {step} (epoch {epoch + 1}) on at least one "
        f"process; that update was skipped on every process, every process stopped and nothing was written "
        f"after it. {where} If the loss is non-finite from the first step, check the data."
    )
