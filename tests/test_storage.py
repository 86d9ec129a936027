"""A run directory on a filesystem that is read-only or fills up during training: one paragraph naming the
problem, what is intact and the command that continues, never a traceback; summary.json says storage_error;
after space is freed the same command resumes. Real filesystems: tmpfs mounts (root only)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import check_ok, run_in_process

MLP = ["--hidden", "32"]


@contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


COMPLETION_THREAD = "checkpoint-completion_0"  # the name of the thread common.train.checkpoint completes checkpoints on


def fsync_failing_in_the_completion_thread(monkeypatch, code: int, folder: str = ".tmp-step-"):
    """os.fsync as a disk that is full (``code``: ENOSPC, EDQUOT) answers it, for the files of a checkpoint folder
    whose name starts with ``folder``, and only when called from the thread that completes checkpoints in the
    background (elsewhere, and for other files, the real fsync). Returns the record of every fsync of a checkpoint's
    file: (the calling thread's name, the folder, whether it failed)."""
    real, calls = os.fsync, []

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        where = next((part for part in path.parts if part.startswith((".tmp-step-", "step-"))), None)
        if where is None:
            return real(fd)
        thread = threading.current_thread().name
        fail = thread == COMPLETION_THREAD and where.startswith(folder) and path.is_file()
        calls.append((thread, where, fail))
        if fail:
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_a_read_only_output_dir_is_one_paragraph(tmp_path, env, mnist_like):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        proc = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, "--output-dir", ro / "run"], env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "Cannot create the run directory" in proc.stderr and "Read-only file system" in proc.stderr


def test_a_disk_that_fills_up_during_training_keeps_the_last_checkpoint_and_resumes(
    tmp_path, env, mnist_like, monkeypatch
):
    """The disk fills up (another writer, here a watcher of the loop) once a checkpoint is complete on disk, while the
    checkpoints go their own way (completed in their thread, waited for by the run): the run ends with the full-disk
    paragraph naming the last complete checkpoint as intact, and resumes from it once space is freed."""
    import common.train.checkpoint as ckpt
    from common.train.run import WATCHERS

    filled = []  # the newest complete checkpoint when the disk filled up

    def fill_once_a_checkpoint_is_complete(training):  # looks, never waits: the completion is the run's business
        complete = ckpt.complete_checkpoints(run)
        if filled or not complete:
            return
        filled.append(complete[-1].name)
        with open(disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 2**16)
                    f.flush()
            except OSError:
                pass

    with tmpfs(tmp_path / "disk", "20m") as disk:
        run = disk / "run"
        args = [
            "--dataset",
            mnist_like,
            "--epochs",
            2,
            "--batch-size",
            32,
            *MLP,
            "--checkpoint-every",
            3,
            "--output-dir",
            run,
            "--resume-from",
            "latest",
        ]
        with monkeypatch.context() as mp:
            mp.setitem(WATCHERS, "before_update", [fill_once_a_checkpoint_is_complete])
            proc = run_in_process("fashion_mnist_mlp", args, env)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        # the newest complete checkpoint: the one seen when the disk filled, or one whose completion (a rename and a
        # marker of a few bytes, its files written before) was in flight then and finished on the full disk
        [filled_at] = filled  # the newest complete checkpoint when the disk filled
        complete = [p.name for p in ckpt.complete_checkpoints(run)]
        after = [name for name in complete if name > filled_at]
        assert filled_at in complete and len(after) <= 1, complete  # one write in flight at the most
        intact = complete[-1]
        [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert f"The filesystem of the run directory {run} is full" in paragraph
        assert f"{intact}, is intact" in paragraph and "--resume-from latest" in paragraph, paragraph
        assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"  # written on a full disk
        assert not [p.name for p in run.iterdir() if ".tmp" in p.name]  # no temp file left beside it
        os.remove(disk / "filler")  # space freed: the same command continues from that checkpoint
        again = check_ok(run_in_process("fashion_mnist_mlp", args, env))
        assert "resumed from" in again.stdout and f"step {ckpt.step_of(run / 'checkpoints' / intact)}" in again.stdout
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_checkpoint_whose_completion_fails_in_its_thread_ends_the_run_as_a_full_disk(
    tmp_path, env, mnist_like, monkeypatch
):
    """The fsync, rename and COMPLETE of a checkpoint run in a thread while training goes on; when that thread meets
    a full disk (ENOSPC from fsync, raised only in that thread, for the second checkpoint's files), the run ends at
    the next point that waits for it (the next checkpoint, here) with the full-disk paragraph, exit 1, summary.json's
    storage_error, and the checkpoint before it complete and resumable."""
    import common.train.checkpoint as ckpt

    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--checkpoint-every", 3]
    args += ["--output-dir", run, "--resume-from", "latest"]
    with monkeypatch.context() as mp:
        calls = fsync_failing_in_the_completion_thread(mp, errno.ENOSPC, ".tmp-step-00000006")
        proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"The filesystem of the run directory {run} is full" in paragraph and "No space left" in paragraph
    assert "step-00000003, is intact" in paragraph, paragraph
    # every checkpoint file was made durable by the completion thread, and the disk said full there, once
    assert {thread for thread, _, _ in calls} == {COMPLETION_THREAD}, calls
    assert [(where, fail) for _, where, fail in calls if fail] == [(".tmp-step-00000006", True)], calls
    # the run ended at the third checkpoint, waiting for the second's thread: no third was written
    assert {where.removeprefix(".tmp-") for _, where, _ in calls} == {"step-00000003", "step-00000006"}, calls
    assert not (run / "checkpoints" / ".tmp-step-00000009").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-00000003"]
    again = check_ok(run_in_process("fashion_mnist_mlp", args, env))
    assert "resumed from" in again.stdout and "step 3" in again.stdout


def test_a_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    """A full disk during write_atomic (summary.json, config.json, markers): the old file is kept whole and no 0-byte
    temp file is left beside it (there was one)."""
    import errno
    import os

    from common import files

    target = tmp_path / "summary.json"
    target.write_text("old\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError):
        files.write_atomic(target, "new\n")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["summary.json"]


def test_a_stop_whose_checkpoint_cannot_complete_ends_as_a_full_disk_not_preempted(
    tmp_path, env, mnist_like, monkeypatch
):
    """A stop request checkpoints, waits for the checkpoint to be complete on disk, then exits 75 saying where it is.
    When that completion fails in its thread (quota or space reported at fsync, as NFS and Lustre do), the run does not
    say "checkpoint written" of a folder that is only .tmp-step-N: it ends with the full-disk paragraph, exit 1 and
    summary.json's storage_error, so a requeue loop learns the disk is full."""
    import common.train.checkpoint as ckpt
    from common.train.run import WATCHERS

    def stop_at_5(run):  # a stop request, as a signal makes it, at step 5
        if run.step + 1 == 5:
            run.stop.reason = "a test's stop request"

    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--output-dir", run]
    calls = fsync_failing_in_the_completion_thread(monkeypatch, errno.EDQUOT)
    monkeypatch.setitem(WATCHERS, "before_update", [stop_at_5])
    proc = run_in_process("fashion_mnist_mlp", args, env)
    # the stop's checkpoint (the only one), made durable in its completion thread, which met the full quota
    assert {thread for thread, _, _ in calls} == {COMPLETION_THREAD} and [fail for *_, fail in calls] == [True], calls
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checkpoint written to" not in proc.stdout + proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"The filesystem of the run directory {run} is full" in paragraph and "Disk quota exceeded" in paragraph
    assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"
    assert not ckpt.complete_checkpoints(run)
