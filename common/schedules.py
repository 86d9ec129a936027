"""LR schedules as multipliers of the peak LR, a function of the optimizer step."""

from __future__ import annotations

import math

import torch

from common.errors import RecipeError


def lr_multiplier(step: int, total: int, warmup: int, kind: str, start: float = 0.0, end: float = 0.0) -> float:
    """Warm-up from ``start`` to 1 over ``warmup`` steps, then ``kind`` down to ``end`` at ``total``."""
    if warmup and step < warmup:
        return start + (1.0 - start) * (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return end + (1.0 - end) * max(0.0, 1.0 - progress)
    raise ValueError(f"unknown schedule {kind!r}")


def build_scheduler(optimizer, cfg, steps_per_epoch: int):
    """LambdaLR over the whole run. ``steps_per_epoch`` must be counted from the *prepared* loader
    (optimizer steps per process), so the LR trace is the same on 1 and N processes."""
    if steps_per_epoch < 1:
        rule = getattr(cfg, "lr_rule", None)
        follows = f" ({rule.kind}, from lr {type(cfg).lr:g} at batch {rule.batch})" if rule else ""  # the default
        raise RecipeError(f"--batch-size {cfg.batch_size} (global) is larger than the training split, so not one "
                          "full batch fits in an epoch (incomplete training batches are dropped) and there is "
                          "nothing to train on. Pass a smaller --batch-size; the LR follows a smaller --batch-size "
                          f"by the recipe's rule{follows} unless --lr is given.")
    total = steps_per_epoch * cfg.epochs  # --max-steps stops early but does not reshape the schedule
    warmup = int(round(cfg.warmup_fraction * total))

    def for_group(group):
        stop = group["train_epochs"] * steps_per_epoch if group.get("train_epochs") else math.inf
        return lambda step: lr_multiplier(step, total, warmup, cfg.schedule, cfg.warmup_start, cfg.final_lr) \
            if step < stop else 0.0  # a group trained for its first epochs only is then held still

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [for_group(g) for g in optimizer.param_groups])
