"""The training hot path makes no host-device synchronisation between log steps.

On a CPU nothing waits, so the calls that would make a GPU wait are counted instead, during a real
recipe run: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` of a tensor, a tensor built on a
device from Python data (``torch.tensor(..., device=)``), a host tensor sent to a device without
``non_blocking`` (``.to(device)``), and a guard that must read its flags before the update (an event wait).
The decoded data is on the device as a GPU run keeps it by default, and the photo recipe averages its weights
(--ema-decay). Step k's count is taken from the guard's all-reduce
before update k to the one before update k + 1 (update k, what the loop does after it, the next batch); the steps
that log (every --log-every, and the last) and an epoch's last step (its evaluation follows) may sync; every other
step must make none. Before this was so, 60 steps of mnist_convnet made 900 such calls: the
guard's ``.tolist()`` before every update and torch's per-parameter AdamW loop (840 ``.item()``)."""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from common.train.guard import StepGuard
from common.train.run import WATCHERS

from helpers import SMALL, check_ok, recipe_env, run_in_process

SYNCING_METHODS = ("item", "tolist", "cpu", "__bool__")


def counting_copy(original, total, by_name):
    """``Tensor.to(device)`` without ``non_blocking=True`` of a tensor made on the host from Python data (marked by
    ``counting_constructor``): on a GPU a copy that waits for the stream (a batch's index tensor made from the
    sampler's list was one, every batch). Host and device are both the CPU here, so the mark tells them apart."""

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if (
            isinstance(target, (str, torch.device))
            and getattr(self, "_from_python", False)
            and not kwargs.get("non_blocking")
        ):
            if len(args) < 3 or not args[2]:  # to(device, dtype, non_blocking)
                total[0] += 1
                caller = sys._getframe(1)
                where = f"{caller.f_code.co_filename.rsplit('/', 2)[-1]}:{caller.f_lineno}"
                by_name[f".to({torch.device(target).type}) without non_blocking at {where}"] += 1
        return original(self, *args, **kwargs)

    return to


LOG_EVERY = 10


ON_DEVICE = ["--data-on-device", "true"]  # the decoded data where a GPU run keeps it by default


@pytest.mark.parametrize(
    "recipe,data,extra",
    [
        ("mnist_convnet", "mnist_like", ON_DEVICE),
        ("fashion_mnist_mlp", "mnist_like", ON_DEVICE),
        ("cifar_cnn", "cifar_like", ON_DEVICE),
        ("cifar_cnn", "cifar_like", ["--data-on-device", "false"]),
        ("finetune_folder", "photos_like", ["--ema-decay", 0.9]),
    ],
)
def test_no_sync_between_log_steps(recipe, data, extra, request, tmp_path, monkeypatch):
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
            made = original(data, *args, **kwargs)
            if kwargs.get("device") is None and not isinstance(data, torch.Tensor):
                made._from_python = True  # on the host: counting_copy watches where it goes
            return made

        return wrapper

    def before_update(run):  # step k's window: from before update k to before update k + 1 (what the loop does
        at_step_end.append((run.step, run.epoch, total[0], dict(by_name)))  # after update k, then batch k + 1)

    monkeypatch.setitem(WATCHERS, "before_update", [before_update])
    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, counting_constructor(name, getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "to", counting_copy(torch.Tensor.to, total, by_name))
    original_check = StepGuard.check

    def check(self, *args, **kwargs):  # a guard that cannot read its flags late waits on an event before the update
        if not self.late:
            total[0] += 1
            by_name["guard waits before the update"] += 1
        return original_check(self, *args, **kwargs)

    monkeypatch.setattr(StepGuard, "check", check)

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
    args += extra
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
    logged = [s for s in per_step if s % LOG_EVERY == 0]
    assert logged and all(per_step[s][0] > 0 for s in logged)


def test_an_optimizer_step_asks_no_package_finder(monkeypatch):
    """Accelerate's optimizer wrapper asked importlib for the package `lomo_optim` twice at every step (an uncached
    find_spec: about 0.4 ms of every step on a 2-core CPU). Once the run's Accelerator is built, a step asks none."""
    import importlib.util
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState, GradientState

    from common.train.accelerator import make_accelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cfg = SimpleNamespace(grad_accum=1, seed=0, report_to="none", timeout_s=60, eval_only=False)
    accelerator, _ = make_accelerator(cfg, ("no", [], False))
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    asked = []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: asked.append(name) or real(name, *a, **k))
    for _ in range(3):
        accelerator.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert asked == []
