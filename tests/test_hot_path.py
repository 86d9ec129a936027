"""The training hot path makes no host-device synchronisation between log steps.

On a CPU nothing waits, so the calls that would make a GPU wait are counted instead, during a real
recipe run: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` of a tensor, and a tensor built on a
device from Python data (``torch.tensor(..., device=)``). Each optimizer step's count is taken between
the end of the step before and the end of this one; the steps that log (every --log-every, and the
last), the first step and the first step of an epoch (after the epoch-end evaluation and checkpoint) may sync; every
other step must make none. Before this was so, 60 steps of mnist_convnet made 900 such calls: the
guard's ``.tolist()`` before every update and torch's per-parameter AdamW loop (840 ``.item()``)."""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from common.train.run import TrainingRun

from helpers import SMALL, check_ok, recipe_env, run_in_process

SYNCING_METHODS = ("item", "tolist", "cpu", "__bool__")
LOG_EVERY = 10


@pytest.mark.parametrize(
    "recipe,data",
    [
        ("mnist_convnet", "mnist_like"),
        ("fashion_mnist_mlp", "mnist_like"),
        ("cifar_cnn", "cifar_like"),
        ("finetune_folder", "photos_like"),
    ],
)
def test_no_sync_between_log_steps(recipe, data, request, tmp_path, monkeypatch):
    dataset = request.getfixturevalue(data)
    total, by_name, at_step_end = [0], collections.Counter(), []

    def counting(name, original):
        def wrapper(*args, **kwargs):
            # torch's samplers draw each epoch's order on the host (a CPU generator) even on a GPU machine
            if sys._getframe(1).f_globals.get("__name__") != "torch.utils.data.sampler":
                total[0] += 1
                by_name[name] += 1
            return original(*args, **kwargs)

        return wrapper

    def counting_constructor(name, original):
        def wrapper(data, *args, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                total[0] += 1
                by_name[f"torch.{name}(device=)"] += 1
            return original(data, *args, **kwargs)

        return wrapper

    original_end_step = TrainingRun.end_step

    def end_step(self):
        original_end_step(self)
        at_step_end.append((self.global_step, self.epoch, total[0], dict(by_name)))

    monkeypatch.setattr(TrainingRun, "end_step", end_step)
    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, counting_constructor(name, getattr(torch, name)))

    args = [
        "--dataset",
        dataset,
        *SMALL[recipe],
        "--epochs",
        2,
        "--batch-size",
        8,
        "--log-every",
        LOG_EVERY,
        "--output-dir",
        tmp_path / "run",
    ]
    if recipe == "finetune_folder":  # photos decoded in a worker process, as on a GPU machine (CPU tensors there)
        args += ["--workers", 1]
    check_ok(run_in_process(recipe, args, recipe_env(tmp_path)))

    per_step, checked, last = {}, [], at_step_end[-1][0]
    for (step, epoch, count, names), (_, prev_epoch, prev_count, prev_names) in zip(at_step_end[1:], at_step_end):
        per_step[step] = (
            count - prev_count,
            {k: v - prev_names.get(k, 0) for k, v in names.items() if v != prev_names.get(k, 0)},
        )
        if step % LOG_EVERY and step != last and epoch == prev_epoch:  # the last step logs too
            checked.append(step)
    assert len(checked) >= 30, checked  # most steps of both epochs
    assert {s: per_step[s] for s in checked if per_step[s][0]} == {}
    # the counting sees the syncs that do happen: a log step reads the loss window and the gradient norm
    logged = [s for s in per_step if s % LOG_EVERY == 0 or s == last]
    assert logged and all(per_step[s][0] > 0 for s in logged)
