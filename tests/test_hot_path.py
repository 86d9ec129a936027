"""The training hot path makes no host-device synchronisation between log steps.

On a CPU nothing waits, so the reads that would make a GPU wait are counted instead (``HostReads``), during a real
recipe run: every read of a device tensor's values by the host, whatever Python spelling led there (``.item()``,
``float()``, ``int()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``torch.equal``, ``print``, an f-string, an index
into a list, a boolean mask: seen at the ATen operation they end in, or as the torch function they are where a CPU
tensor reaches none), ``.cpu()``, a tensor built on a device from Python data (``torch.tensor(..., device=)``), a
host tensor sent to a device without ``non_blocking`` (``.to(device)``), and a guard that must read its flags before
the update (an event wait). The tensors a GPU run keeps in host memory (the guard's copy of its flags, a sampler's
order) are told apart and not counted. (Patching Python methods, as this test once did, never saw ``float()``,
``int()``, ``.numpy()`` or ``torch.equal``: a ``float(loss)`` in ``run.track`` passed.)
The decoded data is on the device as a GPU run keeps it by default, and the photo recipe averages its weights
(--ema-decay). Step k's count is taken from the guard's all-reduce
before update k to the one before update k + 1 (update k, what the loop does after it, the next batch); the steps
that log (every --log-every, and the last) and an epoch's last step (its evaluation follows) may sync; every other
step must make none. Before this was so, 60 steps of mnist_convnet made 900 such calls: the
guard's ``.tolist()`` before every update and torch's per-parameter AdamW loop (840 ``.item()``)."""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from common.train.guard import StepGuard
from common.train.run import WATCHERS

from helpers import SMALL, check_ok, recipe_env, run_in_process

aten = torch.ops.aten

# ATen operations that hand a device tensor's values to the host: on a GPU each waits for the stream. Reached by
# .item(), float(), int(), bool(), complex(), operator.index(), an f-string of one value, `x in t`
# (_local_scalar_dense); torch.equal and torch.allclose (each answers a Python bool); and the operations whose
# output's size depends on the values (the count is read back: torch.nonzero, masked_select, unique,
# repeat_interleave without output_size, a boolean mask).
READS = {aten._local_scalar_dense, aten.equal, aten.allclose, aten.nonzero, aten.masked_select, aten.repeat_interleave}
READS |= {getattr(aten, op) for op in ("_unique", "_unique2", "unique_dim", "unique_consecutive")}
COPIES = {aten._to_copy, aten.copy_, aten._copy_from}  # to the host, from a tensor elsewhere (a GPU run's .cpu())
INDEXING = {aten.index, aten.index_put, aten.index_put_}  # a boolean index is a nonzero() inside the kernel

# Reads that reach no ATen operation when the tensor is already on the host, as every tensor is on a CPU: the
# values are handed to Python, NumPy or a string in place (on a GPU each is a copy to the host, a _to_copy). Seen
# one level up, as the torch function they are (every Tensor method and dunder, Python or C, passes there).
HOST_ONLY = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__array__,  # np.asarray(t), np.array(t)
    torch.Tensor.__repr__,  # print(t), str(t), repr(t): torch's printing turns the modes off inside, so seen here
    torch.Tensor.__format__,  # f"{t}"
    torch.Tensor.cpu,
}
HOST = "_host_in_a_gpu_run"  # the mark of a tensor that a GPU run would keep in host memory
THIS_FILE = os.path.abspath(__file__)
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def tensors_in(args, kwargs=None):
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):  # torch.stack, torch.cat, the _foreach_ ops, index's indices
            yield from (v for v in value if isinstance(v, torch.Tensor))


def on_host(tensors) -> bool:
    tensors = list(tensors)
    return bool(tensors) and all(getattr(t, HOST, False) for t in tensors)


class HostReads:
    """Counts the host reads of device values made in this thread while it is entered: ``total``, and ``by_name``
    (what, and the first line outside torch that asked).

    Two hooks, so that no spelling escapes. A ``TorchDispatchMode`` sees the ATen operations every spelling ends in
    (``READS``: what a GPU waits on, ``float(t)`` and ``t.item()`` alike, also when torch's own Python code or a C++
    composite asks). A ``TorchFunctionMode`` sees the reads that reach no ATen operation on a CPU tensor
    (``HOST_ONLY``: ``.tolist()`` and ``.numpy()`` read a CPU tensor's memory in place, and torch's printing turns the
    modes off inside), and a host tensor's ``.to(device)``. A read is counted once: a ``HOST_ONLY`` call counts only if
    no ATen read was counted inside it (``f"{t}"`` of one value reaches ``_local_scalar_dense``).

    Which tensors are the device's. On a CPU the host and the device are one, so the counter tracks which tensors a
    GPU run would keep in host memory and counts the reads of every other one: a tensor is on the host (marked) when
    a torch function made it from no tensor and with no ``device=`` (``torch.zeros(5)``, ``torch.randperm(n)``,
    ``torch.tensor(list)``, ``torch.from_numpy``: the guard's flags copy, a sampler's order), or when an operation
    made it from host tensors only (a view, a sum, the batch a loader stacks); ``.to(device)`` makes it the device's.
    Everything else counts as the device's: the model, the loss, the batches on the device, and, conservatively,
    what is made with ``device=`` (``device="cpu"`` and ``device=accelerator.device`` are one here) or where the
    counter cannot see (inside a C++ kernel, a loader's worker process). A copy to the host cannot be told from
    ``.to(accelerator.device)`` here (both are ``.to(cpu)``): ``.cpu()`` is counted as the read, ``.to("cpu")`` is
    not counted (on a GPU the dispatch hook sees its ``_to_copy``, ``COPIES``). A tensor built on the host from Python
    data is marked as such, and its ``.to(device)`` without ``non_blocking`` counted; ``torch.tensor(data, device=)``
    from Python data is counted at once.

    The modes are thread-local: the training loop's thread is watched, not a background thread of its own (a
    checkpoint's completion) nor a data loader worker process."""

    def __init__(self):
        self.total, self.by_name = 0, collections.Counter()
        self._modes = contextlib.ExitStack()

    def __enter__(self) -> HostReads:
        self._modes.enter_context(_SeenAsFunctions(self))
        self._modes.enter_context(_SeenAsOperations(self))
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()

    def count(self, what: str) -> None:
        site = sys._getframe(1)
        while site is not None and (
            site.f_code.co_filename.startswith(TORCH_DIR) or site.f_code.co_filename == THIS_FILE
        ):
            site = site.f_back
        self.total += 1
        self.by_name[f"{what} at {site.f_code.co_filename.rsplit('/', 2)[-1]}:{site.f_lineno}" if site else what] += 1


class _SeenAsOperations(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        host = on_host(tensors_in(args, kwargs))  # a read of host tensors only waits for nothing
        if not host:
            self.count_read(packet, args, kwargs)
        out = func(*args, **kwargs)
        if host:  # made from host tensors only: on the host (what a GPU run keeps there)
            for t in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
                if t.device.type == "cpu":
                    setattr(t, HOST, True)
        return out

    def count_read(self, packet, args, kwargs) -> None:
        if packet in READS:
            if packet is not aten.repeat_interleave or kwargs.get("output_size") is None:
                self.reads.count(str(packet))
        elif packet in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.reads.count(f"{packet} with a boolean mask")
        elif packet in COPIES:
            if packet is aten._to_copy:
                source, target = args[0], kwargs.get("device")
            else:  # copy_(dst, src), _copy_from(src, dst)
                source, dst = (args[1], args[0]) if packet is aten.copy_ else (args[0], args[1])
                target = dst.device
            if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu":
                self.reads.count(f"{packet} to the host")


class _SeenAsFunctions(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given, target = list(tensors_in(args, kwargs)), None
        if func is torch.Tensor.to:  # to(device, dtype, non_blocking): from Python data, a copy that waits
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if (
                isinstance(target, (str, torch.device))
                and getattr(args[0], "_from_python", False)
                and not kwargs.get("non_blocking")
                and (len(args) < 4 or not args[3])
            ):
                self.reads.count(f".to({torch.device(target).type}) without non_blocking")
        elif func in (torch.tensor, torch.as_tensor) and not given and kwargs.get("device") is not None:
            self.reads.count(f"torch.{func.__name__}(device=)")
        before = self.reads.total
        made = func(*args, **kwargs)
        if func in HOST_ONLY and self.reads.total == before and not on_host(given[:1]):
            self.reads.count(f"Tensor.{func.__name__}")
        if isinstance(made, torch.Tensor):
            if not given and kwargs.get("device") is None:  # made from Python data or from nothing, on the host
                setattr(made, HOST, True)
                if func in (torch.tensor, torch.as_tensor):
                    made._from_python = True  # its .to(device) is watched
            elif func is torch.Tensor.to and isinstance(target, (str, torch.device)):
                setattr(made, HOST, False)  # the device's (on a CPU the same tensor: the host copy counts as moved)
        return made


def a_loss() -> torch.Tensor:
    """A value the GPU would own: a model's loss."""
    model = torch.nn.Linear(4, 1)
    return torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)).detach()


@pytest.mark.parametrize(
    "read",
    [
        lambda t: float(t),
        lambda t: int(t),
        lambda t: bool(t),
        lambda t: t.item(),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: np.asarray(t),
        lambda t: torch.equal(t, t),
        lambda t: print(t),
        lambda t: f"{t:.3f}",
        lambda t: f"{t.expand(2)}",
        lambda t: torch.allclose(t, t),
        lambda t: [0, 1][(t > 0).long()],
        lambda t: t.cpu(),
        lambda t: t.expand(3)[t.expand(3) > 0],
        lambda t: torch.nonzero(t.expand(3)),
        lambda t: torch.tensor([1.0], device=t.device),
        lambda t: torch.tensor([1.0]).to(t.device),
    ],
    ids=[
        "float",
        "int",
        "bool",
        "item",
        "tolist",
        "numpy",
        "np.asarray",
        "torch.equal",
        "print",
        "f-string of one value",
        "f-string of a tensor",
        "torch.allclose",
        "index a list",
        "cpu",
        "boolean mask",
        "nonzero",
        "torch.tensor(device=)",
        "to(device) from Python data",
    ],
)
def test_the_counter_sees_every_spelling_of_a_host_read(read, capsys):
    """A host read is counted once whichever way it is spelled, also those that pass through C (float(), int(),
    .numpy(), torch.equal, print), which patching Python methods never saw: a float(loss) in the run's per-step
    call passed the old count."""
    loss = a_loss()
    with HostReads() as reads:
        read(loss)
    assert reads.total == 1, reads.by_name


def test_the_counter_counts_no_device_math():
    """What a training step does on the device without reading it is not counted: forward, backward, a fused
    update, clipping, checks that stay tensors, copies to the device that do not wait."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    batch, labels = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with HostReads() as reads:
        for _ in range(3):
            x, y = batch.to("cpu", non_blocking=True), labels.to(torch.device("cpu"))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            finite = torch.isfinite(loss) & torch.isfinite(norm)
            window = torch.where(finite, loss.detach(), torch.zeros_like(loss)).float()
            torch.stack([window, norm]).sum(0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model(x)[torch.arange(4)].argmax(1).to(torch.float16)
    assert reads.total == 0, reads.by_name
    assert float(window) >= 0  # and the counter is off once left


def test_the_counter_leaves_host_tensors_alone():
    """What a GPU run keeps in host memory is read without a wait, and not counted: a tensor made with no device
    (the guard's copy of its flags), what is made from it alone (a view), a sampler's order. Once sent to the device
    with ``.to(device)``, it is the device's."""
    loss = a_loss()
    with HostReads() as reads:
        flags = torch.zeros(5)
        flags.copy_(torch.stack([loss, loss, loss, loss, loss]))  # on a GPU a non_blocking copy into pinned memory
        flags.numpy().tolist()
        float(flags[0])
        torch.randperm(10).tolist()
        int(torch.empty((), dtype=torch.int64).random_())
        assert reads.total == 0, reads.by_name
        moved = flags.to(loss.device)  # the device's now
        moved.sum().item()
        assert reads.total == 1, reads.by_name


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
    reads, at_step_end = HostReads(), []

    def before_update(run):  # step k's window: from before update k to before update k + 1 (what the loop does
        at_step_end.append((run.step, run.epoch, reads.total, dict(reads.by_name)))  # after update k, then batch k + 1)

    monkeypatch.setitem(WATCHERS, "before_update", [before_update])
    original_check = StepGuard.check

    def check(self, *args, **kwargs):  # a guard that cannot read its flags late waits on an event before the update
        if not self.late:
            reads.total += 1
            reads.by_name["guard waits before the update"] += 1
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
    with reads:
        result = run_in_process(recipe, args, recipe_env(tmp_path))
    check_ok(result)

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
