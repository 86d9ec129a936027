"""A run directory on a filesystem that is read-only or fills up during training: one paragraph naming the
problem, what is intact and the command that continues, never a traceback; summary.json says storage_error;
after space is freed the same command resumes. Real filesystems: tmpfs mounts (root only)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from contextlib import contextmanager

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


def test_a_read_only_output_dir_is_one_paragraph(tmp_path, env, mnist_like):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        proc = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, "--output-dir", ro / "run"], env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "Cannot create the run directory" in proc.stderr and "Read-only file system" in proc.stderr


def test_a_disk_that_fills_up_during_training_keeps_the_last_checkpoint_and_resumes(
    tmp_path, env, mnist_like, monkeypatch
):
    import common.train.checkpoint as ckpt
    import common.train.run

    real_save, filler = ckpt.save_checkpoint, None

    def save_then_fill(*args, **kwargs):  # after the first complete checkpoint, the disk fills up
        nonlocal filler
        path, completion = real_save(*args, **kwargs)
        if completion is not None:
            completion.wait()
        if filler is None:
            filler = path.parents[2] / "filler"
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 2**16)
                        f.flush()
                except OSError:
                    pass
        return path, None

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
        monkeypatch.setattr(common.train.run.ckpt, "save_checkpoint", save_then_fill)
        proc = run_in_process("fashion_mnist_mlp", args, env)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert f"The filesystem of the run directory {run} is full" in paragraph
        assert "step-00000003, is intact" in paragraph and "--resume-from latest" in paragraph
        assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"  # written on a full disk
        assert not [p.name for p in run.iterdir() if ".tmp" in p.name]  # no temp file left beside it
        monkeypatch.setattr(common.train.run.ckpt, "save_checkpoint", real_save)
        os.remove(filler)  # space freed: the same command continues from step 3
        again = check_ok(run_in_process("fashion_mnist_mlp", args, env))
        assert "resumed from" in again.stdout and "step 3" in again.stdout
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_checkpoint_whose_completion_fails_in_its_thread_ends_the_run_as_a_full_disk(
    tmp_path, env, mnist_like, monkeypatch
):
    """The fsync, rename and COMPLETE of a checkpoint run in a thread while training goes on; when that thread meets
    a full disk, the run ends at the next point that waits for it (the next checkpoint, here) with the full-disk
    paragraph, exit 1, summary.json's storage_error, and the checkpoint before it complete and resumable."""
    import common.train.checkpoint as ckpt

    real_complete, calls = ckpt._complete, []

    def complete_then_full(*args):
        calls.append(args[-2].name)  # the final folder's name
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_complete(*args)

    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--checkpoint-every", 3]
    args += ["--output-dir", run, "--resume-from", "latest"]
    monkeypatch.setattr(ckpt, "_complete", complete_then_full)
    proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"The filesystem of the run directory {run} is full" in paragraph
    assert "step-00000003, is intact" in paragraph, paragraph
    assert calls == ["step-00000003", "step-00000006"]  # the run ended at the third checkpoint, waiting for the second
    assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step-00000003"]
    monkeypatch.setattr(ckpt, "_complete", real_complete)
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
    When that completion fails (quota or space reported at fsync or rename, as NFS and Lustre do), the run does not
    say "checkpoint written" of a folder that is only .tmp-step-N: it ends with the full-disk paragraph, exit 1 and
    summary.json's storage_error, so a requeue loop learns the disk is full."""
    import common.train.checkpoint as ckpt
    from common.train.run import WATCHERS

    def stop_at_5(run):  # a stop request, as a signal makes it, at step 5
        if run.step + 1 == 5:
            run.stop.reason = "a test's stop request"

    def full(*args):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--output-dir", run]
    monkeypatch.setattr(ckpt, "_complete", full)
    monkeypatch.setitem(WATCHERS, "before_update", [stop_at_5])
    proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checkpoint written to" not in proc.stdout + proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"The filesystem of the run directory {run} is full" in paragraph and "Disk quota exceeded" in paragraph
    assert json.loads((run / "summary.json").read_text())["status"] == "storage_error"
    assert not ckpt.complete_checkpoints(run)
