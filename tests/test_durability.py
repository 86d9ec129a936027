"""A checkpoint is durable before it is marked complete, as observed on the system calls of a real save.

``common.train.checkpoint`` promises the order: every rank's files written into ``.tmp-step-N`` -> fsync of each of
them (and of the folder, so that their names survive too) -> rename to ``step-N`` -> fsync of ``checkpoints/`` (the
rename survives) -> COMPLETE written and fsynced -> fsync of ``step-N`` (COMPLETE's name survives). No other test
fails when an fsync is left out: a crash is needed to see it. So the save is watched instead (``DiskOrder``), every
thread of it, the completion thread included, and the order is asserted for every checkpoint a real run writes and
for a direct save, in the foreground and in the background, with a file of a second rank in the folder (one process
writes it as rank 1 would: the main process's fsync loop covers every file in the folder, whoever wrote it).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers import SMALL, check_ok, run_in_process

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd by /proc/self/fd")

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_RECORDING: list[DiskOrder] = []  # the recorders the audit hook feeds (none between tests)
_HOOKED = []


def _audit(event, args):
    if not _RECORDING:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE_FLAGS):
            _RECORDING[-1].add("write", os.path.realpath(os.fsdecode(path)))
    elif event == "os.rename":  # os.rename and os.replace alike
        src, dst = (os.path.realpath(os.fsdecode(p)) for p in args[:2])
        files = sorted(
            os.path.relpath(os.path.join(top, name), src) for top, dirs, names in os.walk(src) for name in names + dirs
        )
        _RECORDING[-1].add("rename", src, dst, files)


class DiskOrder:
    """The order of what a save does to the disk, from every thread: ``write`` (a file opened for writing, by any
    Python spelling: the audit hook's ``open`` event), ``fsync`` (``os.fsync`` or ``os.fdatasync``, with the path its
    fd refers to, read from /proc/self/fd), ``rename`` (``os.rename`` or ``os.replace``, with every entry under the
    source at that moment). Each event: (kind, thread name, path[, destination, entries]); paths are real paths, as
    /proc/self/fd gives them. Files written by C code (safetensors, torch.save) raise no audit event: they are seen
    as entries of the folder when it is renamed."""

    def __init__(self, monkeypatch):
        self.events, self.lock = [], threading.Lock()
        if not _HOOKED:  # an audit hook stays for the process's life: it does nothing while _RECORDING is empty
            sys.addaudithook(_audit)
            _HOOKED.append(True)
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._syncing(getattr(os, name)))

    def add(self, kind, path, *more):
        with self.lock:
            self.events.append((kind, threading.current_thread().name, path, *more))

    def _syncing(self, real):
        def sync(fd):
            fd_ = fd if isinstance(fd, int) else fd.fileno()
            self.add("fsync", os.readlink(f"/proc/self/fd/{fd_}"))
            return real(fd)

        return sync

    def __enter__(self):
        _RECORDING.append(self)
        return self

    def __exit__(self, *exc):
        _RECORDING.remove(self)

    def first(self, kind, path, after=-1) -> int | None:
        return next((i for i, e in enumerate(self.events) if i > after and e[0] == kind and e[2] == path), None)

    def synced(self, path, after=-1, before=None) -> bool:
        i = self.first("fsync", str(path), after)
        return i is not None and (before is None or i < before)


STEP_DIR = re.compile(r"^step-\d{8}$")


def assert_durable_saves(order: DiskOrder) -> list[str]:
    """Every ``.tmp-step-N`` -> ``step-N`` rename: the promised order around it. Returns the threads that renamed."""
    saves = [
        (i, e)
        for i, e in enumerate(order.events)
        if e[0] == "rename" and STEP_DIR.match(Path(e[3]).name) and Path(e[2]).name == f".tmp-{Path(e[3]).name}"
    ]
    assert saves, order.events
    for r, (_, thread, tmp, final, entries) in saves:
        tmp, final = Path(tmp), Path(final)
        assert "trainer_state.json" in entries, entries
        assert "COMPLETE" not in entries, f"{final.name}: COMPLETE was in the folder before its rename"
        for entry in entries:  # every rank's files, and FSDP's folders, on disk before the rename
            assert order.synced(tmp / entry, before=r), f"{final.name}: {entry} was not fsynced before the rename"
        complete = order.first("write", str(final / "COMPLETE"), after=r)
        assert complete is not None, f"{final.name}: COMPLETE was not written after the rename"
        assert order.first("write", str(tmp / "COMPLETE")) is None, f"{final.name}: COMPLETE written before the rename"
        # the folder's own entries (its files' names) on disk before COMPLETE can be: fsynced as .tmp or as step-N
        assert order.synced(tmp, before=r) or order.synced(final, after=r, before=complete), (
            f"{final.name}: the folder was not fsynced before COMPLETE was written"
        )
        assert order.synced(final.parent, after=r, before=complete), (
            f"{final.name}: checkpoints/ was not fsynced between the rename and COMPLETE"
        )
        marker = order.first("fsync", str(final / "COMPLETE"), after=complete)
        assert marker is not None, f"{final.name}: COMPLETE was not fsynced"
        assert order.synced(final, after=marker), f"{final.name}: the folder was not fsynced after COMPLETE"
    return [thread for _, (_, thread, *_) in saves]


def test_every_checkpoint_of_a_run_is_durable_before_it_is_complete(tmp_path, env, mnist_like, monkeypatch):
    """A real run's checkpoints (every 3 steps, at a stop, at the end), completed in their thread as a run does."""
    args = ["--dataset", mnist_like, *SMALL["fashion_mnist_mlp"], "--epochs", 2, "--batch-size", 32]
    args += ["--checkpoint-every", 3, "--keep-checkpoints", 2, "--output-dir", tmp_path / "run"]
    with DiskOrder(monkeypatch) as order:
        check_ok(run_in_process("fashion_mnist_mlp", args, env))
    threads = assert_durable_saves(order)
    assert len(threads) >= 3 and set(threads) == {"checkpoint-completion_0"}, threads


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_save_makes_every_ranks_files_durable_before_it_is_complete(background, tmp_path, monkeypatch):
    """``save_checkpoint`` called directly; a second rank's file (written as rank 1 writes its random states) is
    made durable by the main process too."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from common.train.checkpoint import is_complete, save_checkpoint

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        real_save_state = accelerator.save_state

        def save_state(folder, **kwargs):  # and the second rank's own file, as it writes it
            real_save_state(folder, **kwargs)
            torch.save({"rank": 1}, Path(folder) / "random_states_1.pkl")

        monkeypatch.setattr(accelerator, "save_state", save_state)
        state = {"epoch": 0, "batches_in_epoch": 3, "global_step": 3}
        with DiskOrder(monkeypatch) as order:
            final, completion = save_checkpoint(accelerator, tmp_path, state, keep=2, background=background)
            if completion is not None:
                completion.result()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert is_complete(final) and (final / "random_states_1.pkl").is_file()
    [renamed_in] = assert_durable_saves(order)
    assert (renamed_in == "checkpoint-completion_0") == background and (completion is not None) == background
