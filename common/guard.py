"""The per-step checks that keep every rank in agreement, at the cost of one small collective per
optimizer step.

``StepGuard``: each micro-step's loss is added on the device (no sync); once per optimizer step, before
``optimizer.step()``, one all-reduce of four numbers tells every rank whether any rank saw a
non-finite loss or has a stop request, and gives the summed loss for logging. With fp16 a non-finite
loss is the loss scaler's business (it skips the step); it is left out of the logged mean, never
logged as 0.

``LossScaleWatch``: with fp16 the GradScaler halves its scale on every step it skips. Reading the
scale is the reliable test: with a fused optimizer GradScaler always calls ``step()``, so
``accelerator.optimizer_step_was_skipped`` is always False. Too many skips in a row stop the run.
"""

from __future__ import annotations

import torch

from common.errors import NonFiniteLoss

MAX_CONSECUTIVE_SKIPS = 25  # 25 halvings take the loss scale from 65536 below 0.002


class StepGuard:
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.sums = torch.zeros(3, device=accelerator.device)  # non-finite count, finite loss sum, finite count

    def track(self, loss: torch.Tensor) -> None:
        d = loss.detach().float()
        finite = torch.isfinite(d)
        self.sums += torch.stack([(~finite).float(), torch.where(finite, d, 0.0), finite.float()])

    def check(self, stop_requested: bool) -> tuple[bool, bool, float, float]:
        """One all-reduce (a CPU-GPU sync point): (any non-finite loss, any stop request, loss sum, count)."""
        flag = torch.tensor([1.0 if stop_requested else 0.0], device=self.sums.device)
        nonfinite, loss_sum, count, stops = self.accelerator.reduce(torch.cat([self.sums, flag]), "sum").tolist()
        self.sums.zero_()
        return nonfinite > 0, stops > 0, loss_sum, count


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
                "--resume-from latest.")
        return not skipped
