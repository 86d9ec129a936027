"""How the global --batch-size becomes each process's DataLoader batch (and --eval-batch-size its evaluation batch)."""

from __future__ import annotations

from common.errors import RecipeError


def per_process_batch(cfg, num_processes: int) -> int:
    """--batch-size is the global batch per optimizer step: split over processes x accumulation steps."""
    div = num_processes * cfg.grad_accum
    if cfg.batch_size % div:
        raise RecipeError(
            f"--batch-size {cfg.batch_size} is the global batch and must split evenly over {num_processes} "
            f"process(es) x {cfg.grad_accum} accumulation step(s) (= {div}); it leaves "
            f"{cfg.batch_size / div:g} per process. Pass a multiple of {div}, e.g. --batch-size "
            f"{max(div, cfg.batch_size // div * div)}."
        )
    return cfg.batch_size // div


def loader_batch(cfg, num_processes: int, train: bool) -> int:
    """A DataLoader's batch on each process: training, the global --batch-size split over processes and
    accumulation steps; evaluation, --eval-batch-size split over processes."""
    return per_process_batch(cfg, num_processes) if train else max(1, cfg.eval_batch_size // num_processes)
