"""--ema-decay: evaluate and save an exponential moving average (EMA) of the weights.

After every optimizer step ``avg <- d * avg + (1 - d) * weights`` for every parameter and floating-point
buffer (BatchNorm running statistics included), with a warm-up ``d = min(decay, (1 + n) / (10 + n))``
after n updates, so the random initial weights fade out within the first few dozen steps instead of
dominating a short run. The decay is computed on the host from a step counter: no device sync per step.

Under DDP the parameters are equal on every rank but each rank's BatchNorm running statistics are its
own, so each rank's average differs in those buffers. Before the average is evaluated (``for_eval``) or
saved (``state_dict``, called on every rank by ``save_state``) the ranks average those buffers (one
small all-reduce): every rank then holds the same model, equal to what best/, final/ and checkpoints
hold. Averaging is linear, so this equals the EMA of the rank-averaged statistics.

The average is registered with Accelerate's checkpointing, so --resume-from restores it exactly. With
--ema-decay 0 nothing is copied and the trained weights are used as is.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightEMA:
    def __init__(self, accelerator, model: nn.Module, decay: float):
        self.accelerator, self.decay, self.updates, self.module = accelerator, decay, 0, None
        if not decay:
            return
        self.module = copy.deepcopy(accelerator.unwrap_model(model)).eval().requires_grad_(False)
        accelerator.register_for_checkpointing(self)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @staticmethod
    def _tensors(model: nn.Module):
        floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
        others = [t for t in model.buffers() if not t.is_floating_point()]  # e.g. BatchNorm's batch counter
        return floats, others

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Call after each optimizer step that was taken."""
        if self.module is None:
            return
        self.updates += 1
        avg_f, avg_o = self._tensors(self.module)
        cur_f, cur_o = self._tensors(self.accelerator.unwrap_model(model))
        torch._foreach_lerp_(avg_f, [t.to(a.dtype) for a, t in zip(avg_f, cur_f)], 1.0 - self.current_decay())
        for a, t in zip(avg_o, cur_o):
            a.copy_(t)

    @torch.no_grad()
    def sync(self) -> None:
        """Average the floating-point buffers over ranks (every rank must call this)."""
        if self.module is None or self.accelerator.num_processes == 1:
            return
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        if not buffers:
            return
        flat = self.accelerator.reduce(torch.cat([b.flatten() for b in buffers]), reduction="mean")
        pieces = torch.split(flat, [b.numel() for b in buffers])
        torch._foreach_copy_(buffers, [p.view_as(b) for p, b in zip(pieces, buffers)])

    def for_eval(self, model: nn.Module) -> nn.Module:
        """The model to evaluate and save: the average (the same on every rank) when enabled, else the
        trained model. Every rank must call this."""
        if self.module is None:
            return model
        self.sync()
        return self.module

    def state_dict(self) -> dict:
        self.sync()
        return {"updates": self.updates, "decay": self.decay, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        self.module.load_state_dict(state["module"])
