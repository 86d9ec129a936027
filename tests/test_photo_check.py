"""The photo check beside training (common.data.photo_check) is the run's helper, never part of how it ends: a stop
signal that reaches a checker is not a damaged photo, a run ends within seconds of its summary (the check stopped,
what it got through kept, so the next launch checks only the rest), and a SIGKILLed run or launcher leaves no
checker decoding on its own. Its records in the cache folder count only when this user wrote them and no one else
may change them: one that another could have written marks no photo checked."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
import torch
from launching import launch_command

from common.data import photo_check
from common.data.photos import PhotoSplit
from common.train.stopping import StopFlag

from helpers import REPO, check_ok, run_in_process, write_photo_folder

ARGS = ["--image-size", 32, "--batch-size", 8, "--workers", 0, "--model", "shufflenet_v2_x0_5", "--report-to", "none"]
# the photo recipe with its checker slowed (``slowed``), for a run in a process of its own
WRAPPER = """
import os, runpy, sys
sys.path[:0] = [{tests!r}, {benchmarks!r}]
from common.data import photo_check
from test_photo_check import slowed
env = os.environ
photo_check.open_rgb = slowed(env["CHECK_LOG"], int(env["CHECK_FAST"]), float(env["CHECK_DELAY_S"]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def slowed(log, fast: int, delay: float):
    """``open_rgb`` for a checker: the first ``fast`` photos at once, then ``delay`` s each; each photo read whole
    logged as "<checker pid> <path>"."""
    real, seen = photo_check.open_rgb, []

    @contextlib.contextmanager
    def open_rgb(source, side):
        seen.append(source)
        if len(seen) > fast:
            time.sleep(delay)
        with real(source, side) as img:
            yield img
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {source}\n")

    return open_rgb


def logged(log) -> list[tuple[int, str]]:
    text = log.read_text() if log.exists() else ""
    return [(int(pid), path) for pid, path in (line.split(" ", 1) for line in text.splitlines())]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def slowed_run(tmp_path, env, root, nproc=0, fast=10, delay=2.0):
    """The photo recipe on ``root`` (checked beside training) in a process of its own under a slowed checker,
    started, not awaited (``nproc=1``: under `accelerate launch`); the checker's log."""
    wrapper = tmp_path / "slowed.py"
    wrapper.write_text(WRAPPER.format(tests=str(REPO / "tests"), benchmarks=str(REPO / "benchmarks")))
    log = tmp_path / "checked.log"
    env = {**env, "ACCELERATE_RECIPES_CHECK_FIRST": "5", "CHECK_LOG": str(log)}
    env.update(CHECK_FAST=str(fast), CHECK_DELAY_S=str(delay))
    args = [REPO / "recipes" / "finetune_folder.py", "--dataset", root, "--cache-dir", tmp_path / "cache", *ARGS]
    args += ["--epochs", 1, "--max-steps", 2, "--output-dir", tmp_path / "run"]
    cmd = launch_command(wrapper, args, nproc=nproc)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=err, text=True)
    proc.lines = []  # (when, line): read by a thread (a checker that outlives the run holds the pipe open)
    threading.Thread(target=lambda: proc.lines.extend((time.monotonic(), line) for line in proc.stdout)).start()
    return proc, log


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_stop_signal_that_reaches_the_photo_checker_is_not_named_damage(tmp_path, monkeypatch, foreground_signals):
    """torchrun's TERM at the end of a run (or a Ctrl-C, a HUP, SLURM's USR1) reaches the checker too. Before, the
    forked checker kept the run's handlers, which raise while the data is read (where it is forked): each signal was
    caught as the decode failure of the photo in hand, and healthy photos were named damaged. Now the checker ignores
    them: it reads every photo whole and leaves its marker."""
    root = write_photo_folder(tmp_path / "d", 4)
    files = sorted(str(p) for p in root.rglob("*") if p.is_file())
    split = PhotoSplit(files, torch.zeros(len(files), dtype=torch.int64), 32)
    log, marker = tmp_path / "checked.log", tmp_path / "cache" / "photos-checked-test"
    monkeypatch.setattr(photo_check, "open_rgb", slowed(log, 0, 0.1))
    sent = []
    stop = StopFlag()  # the run's handlers, in the phase the checker is forked in (run.load_data)
    try:
        stop.interruptible("reading the data")
        others = {c.pid for c in psutil.Process().children()}
        check = photo_check.PhotoCheck([(split, marker, "the test split")], 32).start(1)
        [pid] = [c.pid for c in psutil.Process().children() if c.pid not in others]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
            deadline = time.monotonic() + 10  # one at a time, each while a photo is being read
            while len(logged(log)) <= len(sent) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pid, sig)
            sent.append(len(logged(log)))
        stop.interruptible(None)
        error = check.poll(block=True)
    finally:
        stop.close()
    assert sent[-1] < len(files), sent  # all delivered while it was decoding
    assert error is None, str(error)
    assert marker.exists() and len(logged(log)) == len(files)


def test_a_run_ends_within_seconds_of_its_summary_and_the_next_launch_checks_only_the_rest(tmp_path, env, monkeypatch):
    """A run whose photos are checked beside training could not exit until its checker had read the whole folder
    (43 s after the summary in the report; minutes at a million photos), and then wrote no marker: the next launch
    read every photo again. Now the run stops its checker, ends within seconds of its summary and records the rows
    found whole; the next launch reads only the others."""
    root = write_photo_folder(tmp_path / "d", 20)  # 60 photos: 10 read at once, then one every 2 s
    proc, log = slowed_run(tmp_path, env, root)
    wait_for(lambda: proc.poll() is not None or any(line.startswith("summary:") for _, line in proc.lines), 120)
    [summary_at] = [when for when, line in proc.lines if line.startswith("summary:")] or [None]
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    ended = time.monotonic()
    assert summary_at is not None, (tmp_path / "stderr.txt").read_text()[-3000:]
    assert ended - summary_at < 12, f"it was still running {ended - summary_at:.1f} s after its summary"
    assert proc.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    lines = [line for _, line in proc.lines]
    first = [path for _, path in logged(log)]
    [progress] = (tmp_path / "cache").glob("progress-photos-checked-*")
    record = json.loads(progress.read_text())
    [[lo, done]] = record["done"]
    assert record["rows"] == 60 and lo == 0 and 1 <= done <= len(first) <= done + 1, (record, len(first))
    assert f"{60 - done} of 60 photos left unchecked: the next launch checks those" in "".join(lines)
    assert not list((tmp_path / "cache").glob("photos-checked-*"))  # unfinished: no marker

    # the next launch (few are left: checked before training) reads only the photos the first did not get to
    log.unlink()
    monkeypatch.setattr(photo_check, "open_rgb", slowed(log, 1000, 0))
    env = {**env, "ACCELERATE_RECIPES_CHECK_FIRST": "100"}
    args = ["--dataset", root, "--cache-dir", tmp_path / "cache", *ARGS, "--max-steps", 1]
    check_ok(run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "r2"], env))
    second = [path for _, path in logged(log)]
    assert len(second) == 60 - done and not set(second) & set(first[:done]), (done, len(second))
    assert list((tmp_path / "cache").glob("photos-checked-*"))  # the folder is now checked whole
    assert not list((tmp_path / "cache").glob("progress-*"))


@pytest.mark.parametrize("killed", ["rank", "launcher"])
def test_a_sigkilled_run_leaves_no_photo_checker_running(tmp_path, env, killed):
    """Before, a SIGKILLed rank's checker decoded on, orphaned (it looked for its parent once per 4,096 photos), and
    a rank whose launcher was SIGKILLed could not exit while its checker ran. Now the kernel ends a checker with its
    rank, and a rank that loses its launcher stops its checker as it stops."""
    root = write_photo_folder(tmp_path / "d", 20)
    proc, log = slowed_run(tmp_path, env, root, nproc=1 if killed == "launcher" else 0, fast=3, delay=3.0)
    checker, rank = None, []
    try:
        wait_for(lambda: logged(log) or proc.poll() is not None, 90)
        assert logged(log), (tmp_path / "stderr.txt").read_text()[-3000:]
        checker = logged(log)[0][0]
        rank = [p.pid for p in psutil.Process(proc.pid).children()]  # under the launcher: the rank
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in [checker, *rank]), 20)  # a rank: to its next step
        assert not alive(checker), f"the checker (PID {checker}) is still decoding after its {killed} was killed"
        assert not any(alive(pid) for pid in rank), "the rank did not end"
    finally:
        for pid in (proc.pid, checker, *rank):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("forged", ["progress", "marker", "renamed"])
def test_a_record_in_the_cache_folder_that_another_could_have_written_marks_no_photo_checked(tmp_path, env, forged):
    """Anyone who can write the cache folder (a team's shared --cache-dir) could write the check's record for a
    folder, claiming every photo checked: a damaged one then went unchecked. Now a record counts only when this user
    wrote it, no one else may change it, and it names the check it stands for: ``progress`` and ``marker``, a record
    claiming every row, written by another user (owned by UID 65534; when the tests do not run as root, writable by
    others instead); ``renamed``, this user's own marker of another folder of as many photos, renamed to this one's.
    The photos are checked again, the damaged one is named before training starts (exit 2), and one line says why."""
    from common.data import folders

    root = write_photo_folder(tmp_path / "d", 8)
    victim = sorted((root / "bee").glob("*.jpg"))[-1]
    victim.write_bytes(victim.read_bytes()[:200])  # its header reads, its data is cut short
    cache = tmp_path / "cache"
    cache.mkdir()
    name = f"photos-checked-{folders.scan(root, str(root)).splits['train'].fingerprint}"
    args = ["--cache-dir", cache, *ARGS, "--max-steps", 1]
    if forged == "renamed":
        other = write_photo_folder(tmp_path / "other", 8, seed=1)
        check_ok(run_in_process("finetune_folder", ["--dataset", other, *args, "--output-dir", tmp_path / "r0"], env))
        [mine] = cache.glob("photos-checked-*")
        mine.rename(cache / name)
    else:
        record = cache / (f"progress-{name}" if forged == "progress" else name)
        record.write_text(json.dumps({"of": name, "rows": 24, "done": [[0, 24]]}))
        if os.getuid() == 0:
            os.chown(record, 65534, 65534)
        else:
            record.chmod(0o666)
    proc = run_in_process("finetune_folder", ["--dataset", root, *args, "--output-dir", tmp_path / "run"], env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "1 of the 24 images in the train split" in paragraph and victim.name in paragraph, paragraph
    [said] = [line for line in proc.stdout.splitlines() if "record" in line and "ignored" in line]
    assert ("owned by user" in said or "may write it" in said) if forged != "renamed" else "not a record" in said
