"""LR schedules as multipliers of the peak LR, a function of the optimizer step; and ``LRRule``, how a recipe's
default peak LR follows its batch size."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from common.errors import RecipeError


@dataclass(frozen=True)
class LRRule:
    """How a recipe's default --lr follows --batch-size, declared once in its Config next to the lr knob
    (a plain class attribute, not a field: not a flag, not saved), e.g. ``lr_rule = LRRule("linear", 1024)``.

    ``batch``: the global batch the default --lr was tuned at. ``kind``: ``"linear"`` (lr x B/batch) for SGD
    (Goyal et al. 2017, "k times the batch, k times the LR"); ``"sqrt"`` (lr x sqrt(B/batch)) for Adam-family
    optimizers (Malladi et al. 2022, the square-root scaling rule). Either is a first guess for a batch the recipe
    was not tuned at, not a tuned value (the linear rule is known to break down at very large batches); an --lr
    the user gives (command line or --config file) is taken as given. ``build_parser``
    appends the rule to the --lr help; ``parse_config`` applies it and records what it did in ``cfg.lr_note``."""

    kind: str
    batch: int

    def __post_init__(self):
        assert self.kind in ("linear", "sqrt") and self.batch >= 1, self

    def factor(self, batch_size: int) -> float:
        ratio = batch_size / self.batch
        return ratio if self.kind == "linear" else ratio**0.5

    def formula(self, lr: float, batch_size: int) -> str:
        """e.g. '1.5 x 32/1024' or '0.01 x sqrt(32/256)'."""
        ratio = f"{batch_size}/{self.batch}"
        return f"{lr:g} x {ratio if self.kind == 'linear' else f'sqrt({ratio})'}"

    def help(self) -> str:
        """What the --lr help adds, after the recipe's own words."""
        how = "linearly (lr x B/{0})" if self.kind == "linear" else "by its square root (lr x sqrt(B/{0}))"
        return (
            f" at --batch-size {self.batch}; follows the batch {how.format(self.batch)} when --batch-size is "
            "changed and --lr is not given"
        )

    def follow(self, cfg) -> str:
        """Set ``cfg.lr`` by this rule when --batch-size differs from the batch the default --lr was tuned at (--lr
        not given); return what was done, for ``cfg.lr_note`` and the startup line. Idempotent: it scales the
        field's default, never ``cfg.lr``, so a second call cannot scale twice."""
        if cfg.batch_size == self.batch:
            return f"the default, tuned at batch {self.batch}"
        default = next(f.default for f in dataclasses.fields(cfg) if f.name == "lr")
        cfg.lr = default * self.factor(cfg.batch_size)
        return f"{self.formula(default, cfg.batch_size)}, {self.kind} rule"


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


def batch_larger_than_split(cfg, images: int | None = None) -> RecipeError:
    """The error for a global --batch-size larger than the training split (the same on any number of processes)."""
    rule = getattr(cfg, "lr_rule", None)
    follows = f" ({rule.kind}, from lr {type(cfg).lr:g} at batch {rule.batch})" if rule else ""  # the default
    split = "the training split" + (f" ({images} images)" if images is not None else "")
    return RecipeError(
        f"--batch-size {cfg.batch_size} (global) is larger than {split}, so not one full batch fits in an "
        "epoch (incomplete training batches are dropped) and there is nothing to train on. Pass a smaller "
        f"--batch-size; the LR follows a smaller --batch-size by the recipe's rule{follows} unless --lr is given."
    )


def build_scheduler(optimizer, cfg, steps_per_epoch: int):
    """LambdaLR over the whole run. ``steps_per_epoch`` must be counted from the *prepared* loader
    (optimizer steps per process), so the LR trace is the same on 1 and N processes."""
    if steps_per_epoch < 1:
        raise batch_larger_than_split(cfg)
    total = steps_per_epoch * cfg.epochs  # --max-steps stops early but does not reshape the schedule
    warmup = int(round(cfg.warmup_fraction * total))

    def for_group(group):
        stop = group["train_epochs"] * steps_per_epoch if group.get("train_epochs") else math.inf
        # a group trained for its first epochs only (train_epochs) is then held still
        return lambda step: (
            lr_multiplier(step, total, warmup, cfg.schedule, cfg.warmup_start, cfg.final_lr) if step < stop else 0.0
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [for_group(g) for g in optimizer.param_groups])
