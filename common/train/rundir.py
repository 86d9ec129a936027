"""The run directory: where a run writes, whether it resumes, and who may write there.

- ``--output-dir`` names it; by default ``runs/<recipe>-<timestamp>`` (a new name, never an existing one).
- ``--resume-from latest`` resumes the newest complete checkpoint in it, or starts fresh (and says so).
- A folder that holds something other than a run (a dataset, say) is refused, with nothing written.
- One writer per run directory: the main process holds an exclusive lock on ``<run>/.lock`` for the
  whole run. The operating system drops the lock when the process dies, however it dies, so a crash
  never leaves a stale lock; a second launch on a held directory is refused at once, naming the holder.
- Every process of the job must see the same directory: a run whose processes sit on nodes without a
  shared filesystem is refused at startup (checkpoints are written by one process and read by all).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import time
from datetime import datetime
from pathlib import Path

from common.errors import RecipeError, StorageError
from common.train.accelerator import on_main
from common.train.checkpoint import find_latest, is_complete
from common.train.checkpointer import adopt_resume_settings

RUN_MARKERS = ("config.json", "checkpoints", "metrics.jsonl", "summary.json")
LOCK_FILE = ".lock"
SHARED_WAIT_S = 5.0  # how long a rank retries reading the main process's lock token


def holds_run(path: Path) -> bool:
    return any((path / m).exists() for m in RUN_MARKERS)


def is_empty(path: Path) -> bool:
    """True for a missing folder or one holding nothing but a released lock file."""
    return not path.exists() or all(p.name == LOCK_FILE for p in path.iterdir())


class RunDirLock:
    """An exclusive ``flock`` on ``<run>/.lock``, held until ``release`` or the process's death. The
    file says who holds it (PID, host, start time) and carries a token other ranks use to check that
    they see the same folder."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        try:
            self.file = open(self.path, "a+")
        except OSError as err:
            raise RecipeError(
                f"Cannot write in the run directory {run_dir} ({err.strerror or err}): it is read-only, "
                "full or not this user's. Pass --output-dir a folder this user can write."
            ) from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # EWOULDBLOCK: another process holds it
            self.file.seek(0)
            holder = self.file.read().split()
            self.file.close()
            who = f"PID {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
            raise RecipeError(
                f"The run directory {run_dir} is in use by another run ({who}); two runs writing one folder would "
                "mix their checkpoints and logs. Wait for that run to end (or stop it), or pass another "
                "--output-dir."
            ) from None
        except OSError as err:  # the filesystem cannot lock (an NFS mount without a lock service, say)
            self.file.close()
            raise RecipeError(
                f"The filesystem of the run directory {run_dir} refused a file lock ({err.strerror or err}), which "
                "keeps two runs from writing one folder. On NFS, run the lock service (rpc.statd / nfslock) or "
                "mount with local_lock=all on a single node; on Lustre, mount with -o flock. Or pass --output-dir "
                "on a filesystem that supports flock."
            ) from None
        self.token = secrets.token_hex(8)
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()} {socket.gethostname()} {int(time.time())} {self.token}\n")
        self.file.flush()
        os.fsync(self.file.fileno())  # other nodes read the token (check_shared): on the server before they look

    def release(self) -> None:
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def resolve(cfg, recipe: str) -> tuple[Path, Path | None, bool]:
    """Decide the run directory, the checkpoint to resume (or None) and whether the folder was made
    for this run. Main process only; create the folder and take its lock before anything is written."""
    resume = None
    if cfg.resume_from and cfg.resume_from != "latest":
        resume = Path(cfg.resume_from).expanduser()
        if not is_complete(resume):
            raise RecipeError(
                f"--resume-from {cfg.resume_from} is not a complete checkpoint (no such folder, or it lacks the "
                "completion marker because its write was interrupted). Pass --resume-from latest to pick the "
                "newest complete one, or another checkpoint folder under <run>/checkpoints/."
            )
        source_run = resume.resolve().parent.parent
        if not cfg.output_dir:
            if resume.resolve().parent.name != "checkpoints" or not holds_run(source_run):
                raise RecipeError(
                    f"--resume-from {cfg.resume_from} is a checkpoint outside a run directory (it is not in a run's "
                    "checkpoints/ folder), so there is no run to continue in place. Pass --output-dir a new or "
                    "empty folder for the continued run, or put the checkpoint back under <run>/checkpoints/."
                )
            return source_run, resume, False
    elif not cfg.output_dir:
        if cfg.resume_from == "latest":
            raise RecipeError(
                "--resume-from latest needs --output-dir <run directory> to know which run to "
                "continue. Pass the same --output-dir as the run you want to resume."
            )
        return new_default_dir(recipe), None, True
    run_dir = Path(cfg.output_dir).expanduser()
    check_output_dir(run_dir)
    made = not run_dir.exists()
    if resume is not None:
        if holds_run(run_dir) and run_dir.resolve() != source_run:
            raise RecipeError(
                f"--output-dir {run_dir} already holds another run than the one {cfg.resume_from} belongs to "
                f"({source_run}). Nothing was overwritten. Pass a new or empty --output-dir for the continued run."
            )
    elif cfg.resume_from == "latest":
        resume = find_latest(run_dir)
    elif holds_run(run_dir):
        raise RecipeError(
            f"The output directory {run_dir} already holds a run. Nothing was overwritten. Pass "
            "--resume-from latest to continue that run, or choose a new --output-dir."
        )
    return run_dir, resume, made


def check_output_dir(run_dir: Path) -> None:
    """A folder path (new, empty or a run's): never a file, never a folder of other things."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RecipeError(f"--output-dir {run_dir} is a file, not a folder. Pass a folder path for the run.")
    if not is_empty(run_dir) and not holds_run(run_dir):
        raise RecipeError(
            f"--output-dir {run_dir} already holds files that are not a run (e.g. "
            f"{sorted(p.name for p in run_dir.iterdir())[0]}); writing a run into it would mix the two. Nothing "
            "was written. Pass a new or empty folder."
        )


def new_default_dir(recipe: str) -> Path:
    """runs/<recipe>-<timestamp>, created here; a folder made by someone else in the same second gets a
    suffix (mkdir is atomic, so two launches never share a name)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    Path("runs").mkdir(exist_ok=True)
    for i in range(1, 1000):
        path = Path("runs") / (f"{recipe}-{stamp}" if i == 1 else f"{recipe}-{stamp}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RecipeError(f"Could not create a new run folder under runs/ for {recipe}. Pass --output-dir.")


def check_shared(accelerator, run_dir: Path, token: str | None) -> None:
    """Every rank must read the lock token the main process wrote: else the folder is not shared."""
    if accelerator.num_processes == 1:
        return
    import torch
    from accelerate.utils import broadcast_object_list

    box = [token]
    broadcast_object_list(box, from_process=0)
    seen, deadline = False, time.time() + SHARED_WAIT_S
    while not seen and time.time() < deadline:  # a network filesystem's attribute cache can lag a moment
        try:
            seen = (run_dir / LOCK_FILE).read_text().split()[-1] == box[0]
        except (OSError, IndexError):
            seen = False
        if not seen:
            time.sleep(0.2)
    missing = accelerator.reduce(torch.tensor([0.0 if seen else 1.0], device=accelerator.device), "sum")
    if missing.item():
        raise RecipeError(
            f"The run directory {run_dir} is not one folder shared by every process: {int(missing.item())} "
            f"process(es) (e.g. on {socket.gethostname() if not seen else 'another node'}) cannot see the files the "
            "main process writes there. Checkpoints are written by one process and read by all, so a multi-node "
            "run needs --output-dir on a filesystem every node mounts (NFS, Lustre, ...)."
        )


class RunDir:
    """Where a run writes: ``path``, the checkpoint it resumes (``resume_path``, or None), whether this start
    made the folder (``made``), and the lock held on it for the run's life."""

    def __init__(self, path: Path, resume_path: Path | None, made: bool, lock: RunDirLock | None):
        self.path, self.resume_path, self.made, self.lock = path, resume_path, made, lock

    @staticmethod
    def adopt_run_settings(cfg) -> tuple[Path | None, list[str]]:
        """A resume's checkpoint and the run's own settings taken from it into ``cfg``
        (``common.train.checkpointer.adopt_resume_settings``): called on every process before the Accelerator is built,
        since its data seed and accumulation come from them, as do the data, the model and the schedule. Reads only
        (the run directory is claimed later, by ``claim``). Returns the checkpoint (None for a fresh start) and the
        notes to print."""
        if not cfg.resume_from:
            return None, []
        _, resume, _ = resolve(cfg, "")  # with --resume-from nothing is created here
        return resume, [] if resume is None else adopt_resume_settings(resume, cfg)

    @classmethod
    def claim(cls, cfg, recipe: str, accelerator, planned: Path | None = None) -> RunDir:
        """The main process resolves the directory, takes the lock and checks that the checkpoint to resume is still
        ``planned``, the one whose settings the run took before the Accelerator was built (``adopt_run_settings``);
        every rank then learns the directory and checks that it sees the same folder."""
        lock = None

        def claim_on_main():
            nonlocal lock
            run_dir, resume, made = resolve(cfg, recipe)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise RecipeError(
                    f"Cannot create the run directory {run_dir} ({err.strerror or err}): its filesystem "
                    "is read-only, full or not this user's. Pass --output-dir a folder this user can "
                    "write."
                ) from None
            lock = RunDirLock(run_dir)
            if cfg.resume_from == "latest":  # again, under the lock: no other run writes there now
                resume = find_latest(run_dir)
            return run_dir, resume, made, lock.token

        path, resume, made, token = on_main(accelerator, claim_on_main)
        claimed = cls(path, resume, made, lock)
        try:
            accelerator.project_configuration.set_directories(str(path))
            accelerator.project_configuration.logging_dir = str(path)
            check_shared(accelerator, path, token)
            if resume != planned:
                raise RecipeError(
                    f"The run directory {path} changed while this launch started: the checkpoint to resume is now "
                    f"{resume or 'none'}, where it was {planned or 'none'} a moment before (another run wrote there "
                    "and has ended). Nothing was written. Rerun the same command to continue from the newest one."
                )
        except BaseException:
            claimed.release(started=False)
            raise
        return claimed

    def release(self, started: bool) -> None:
        """Release the lock; a folder this start created and nothing was written into is removed (an error before
        training leaves no trace)."""
        if self.lock is None:
            return
        self.lock.release()
        if not started and self.made and is_empty(self.path):
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            self.path.rmdir()


def storage_error(err: BaseException, run_dir) -> StorageError | None:
    """``err`` as a StorageError when the run directory's filesystem is what failed: full (under 16 MiB free),
    read-only, or an OSError that says so (ENOSPC, EDQUOT, EROFS). The libraries that write checkpoints
    (torch.save, safetensors) lose the errno, so the filesystem itself is asked. None for anything else."""
    import errno

    if run_dir is None or not isinstance(err, Exception):
        return None
    try:
        fs = os.statvfs(run_dir)
        full, read_only = fs.f_bavail * fs.f_frsize < 16 * 2**20, bool(fs.f_flag & os.ST_RDONLY)
    except OSError:
        full = read_only = False
    said = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    if not (full or read_only or said):
        return None

    latest = find_latest(run_dir)
    what = "is read-only" if read_only or getattr(err, "errno", None) == errno.EROFS else "is full"
    return StorageError(
        f"The filesystem of the run directory {run_dir} {what}: a write failed ({type(err).__name__}: "
        f"{str(err).strip().splitlines()[-1] if str(err).strip() else err!r}). "
        + (
            f"The last complete checkpoint, {latest}, is intact (an interrupted write is never loaded). Free some "
            f"space (or make it writable), then rerun the same command with --output-dir {run_dir} --resume-from "
            "latest to continue."
            if latest is not None
            else "No checkpoint was complete yet. Free some space (or make it writable), or pass --output-dir a folder "
            "on another filesystem, then start the run again."
        )
    )
