"""Every photo of a folder decoded whole once per state of its files, so that a damaged one (a header that reads,
data cut short) is named with all the others in one message, instead of being met by a loader worker mid-epoch.

The check runs in forked processes, once per node (its local main process), and leaves a marker in the cache folder
named by the split's fingerprint (every file's path, size and times): a later launch on the same files skips it.

- A folder of at most ``checked_first()`` photos (20,000; the environment variable
  ``ACCELERATE_RECIPES_CHECK_FIRST`` sets another count) is checked before training starts, on every core.
- A larger one is checked while training runs, by one process at low priority: a first launch on a million photos
  starts training in seconds instead of waiting minutes for the decode. A damaged photo found then stops the run at
  the next optimizer step every rank agrees on (``common.train.stopping.StopFlag.fail``), with every damaged file named.

A checker is the run's helper, never part of how it ends (``Forked``): it ignores the stop signals the run acts on
(torchrun's TERM at the end, a Ctrl-C, SLURM's USR1), so a signal is never read as a damaged photo; it dies with the
process that started it (a SIGKILLed rank included); and the run stops it instead of awaiting it (``stop_all``, from
``common.train.run``), so a run ends within moments of its summary or its preemption checkpoint. What a stopped check
had got through is kept beside the marker (``progress-photos-checked-...``: the rows found whole, by the same
fingerprint), and the next launch checks only the rest.

A cache folder may be shared (a team's ``--cache-dir``), and anyone who can write it can write a file there: the
marker and the progress record are shortcuts, never an authority. Each is a record (``{"of": marker name, "rows":
n, "done": [[lo, hi], ...]}``; the marker's covers every row) that counts only when it is a regular file owned by
this user that no one else may write (its group and other write bits clear; this module writes them so, whatever the
umask), and names the marker it stands for and the split's row count: another user's record, one others may change,
or this user's record of another folder renamed to this one's name counts for nothing (``read_record``). A record
that does not count is ignored, said in one line, and its photos are checked again; it is never an error. It is
opened without following a symbolic link and without waiting (a FIFO planted in its place cannot hold the launch).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import multiprocessing
import multiprocessing.util
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

from common.console import say
from common.data.pixels import open_rgb, unreadable_error, unreadable_reason
from common.errors import DataError
from common.files import create_exclusive, temp_name

CHECKED_FIRST = 20_000
ENV = "ACCELERATE_RECIPES_CHECK_FIRST"
# the signals a run stops on (common.train.stopping.STOP_SIGNALS): a checker ignores them, its run decides
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
PARENT_POLL_S = 0.5  # how often a checker looks for its parent where the kernel does not end it (no prctl)
SAVE_EVERY_S = 30.0  # how often a check running beside training records how far it got (a SIGKILL loses no more)
PR_SET_PDEATHSIG = 1
RECORD_LIMIT = 1 << 22  # the most bytes of a record read (a longer one does not count)


def checked_first() -> int:
    """How many photos a folder may hold and still be checked before training starts."""
    text = os.environ.get(ENV, "")
    try:
        return int(text) if text else CHECKED_FIRST
    except ValueError:
        raise DataError(
            f"{ENV}={text!r} is not a whole number. Set it to the largest photo count to check before "
            f"training starts (default {CHECKED_FIRST}), or unset it."
        ) from None


_RUNNING: set = set()  # this process's running checks and checkers, for stop_all() (held: an exception may drop
# the last other reference to a check while its checkers run)
_FINALIZER: list = []


class Forked:
    """``target(*args)`` in a forked process (it inherits what it reads: nothing is pickled) at ``nice`` priority;
    its return value read without a thread, by ``poll()``. The checks that run beside training (this module's,
    ``common.data.scan_cache.Verify``) are made of these.

    The child ignores the run's stop signals (the run acts on them; the child is stopped by ``stop()``, a SIGKILL)
    and ends with the process that started it: the kernel kills it when that process dies (Linux), and it looks for
    a changed parent every ``PARENT_POLL_S`` (elsewhere)."""

    def __init__(self, target, args: tuple, nice: int = 0, name: str = ""):
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        # the kernel's death signal follows the thread that forks: asked for only when that thread is the main one
        main = threading.current_thread() is threading.main_thread()
        self._proc = context.Process(
            target=_answer, args=(os.getpid(), main, nice, target, args, send), daemon=True, name=name
        )
        # stop signals held back across the fork: the child ignores them before any can reach it
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if main else None
        try:
            self._proc.start()
        finally:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        send.close()
        self.done, self.answer = False, None
        _running(self)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def poll(self, block: bool = False) -> bool:
        """True once it has ended; ``answer`` is then what it returned (None when it was killed first)."""
        if not self.done and (block or self._receive.poll()):
            try:
                self.answer = self._receive.recv()
            except (EOFError, OSError):  # killed: no answer
                self.answer = None
            self._receive.close()
            self._proc.join()
            self.done = True
            _RUNNING.discard(self)
        return self.done

    def stop(self) -> None:
        """Ended now, not awaited: an answer already sent is kept, else it is killed (``answer`` None)."""
        if self.done or self.poll():
            return
        self._proc.kill()
        self._proc.join(5)
        self._receive.close()
        self.done = True
        _RUNNING.discard(self)


def _answer(parent: int, main: bool, nice: int, target, args: tuple, conn) -> None:
    _detach(parent, main)
    if nice:
        os.nice(nice)
    conn.send(target(*args))
    conn.close()


def _detach(parent: int, main: bool) -> None:
    """In the child, first: the parent's signal handlers dropped (its stop signals ignored: a TERM for the run is
    not a failure of the decode in hand), and the child tied to its parent's life."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if main and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above: nobody to answer
        os._exit(0)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def _running(thing) -> None:
    """Remember a check or checker for ``stop_all``; the first one also has it run at this process's exit, before
    multiprocessing joins its children (a checker that ignores TERM would hold the exit there)."""
    _RUNNING.add(thing)
    if not _FINALIZER:
        _FINALIZER.append(multiprocessing.util.Finalize(None, stop_all, exitpriority=100))


def stop_all() -> str:
    """Stop every check and checker this process started, without waiting for them: what the photo checks got
    through is recorded for the next launch. Returns a line for the run's output ('' when nothing was cut short)."""
    things = list(_RUNNING)
    notes = [thing.stop() for thing in things if isinstance(thing, PhotoCheck)]
    for thing in things:
        if isinstance(thing, Forked):
            thing.stop()
    _RUNNING.clear()
    return "; ".join(n for n in notes if n)


# --- rows as spans: [(lo, hi), ...], sorted, apart -------------------------------------------------------------


def _merged(spans) -> list:
    out: list = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif lo < hi:
            out.append((lo, hi))
    return out


def _count(spans) -> int:
    return sum(hi - lo for lo, hi in spans)


def _complement(spans, rows: int) -> list:
    out, at = [], 0
    for lo, hi in spans:
        if lo > at:
            out.append((at, lo))
        at = hi
    return out + [(at, rows)] if at < rows else out


def _first(spans, n: int) -> list:
    """The first ``n`` rows of ``spans``."""
    out = []
    for lo, hi in spans:
        if n <= 0:
            break
        out.append((lo, min(hi, lo + n)))
        n -= hi - lo
    return out


def _parts(spans, processes: int) -> list:
    """``spans`` cut into ``processes`` runs of about equal row counts (fewer when there are fewer rows)."""
    size = -(-_count(spans) // processes)
    parts, part, room = [], [], size
    for lo, hi in spans:
        while lo < hi:
            take = min(room, hi - lo)
            part.append((lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                parts.append(part)
                part, room = [], size
    return parts + [part] if part else parts


def progress_path(marker: Path) -> Path:
    """Where the rows of a split found whole so far are kept, beside its marker (same fingerprint)."""
    marker = Path(marker)
    return marker.with_name(f"progress-{marker.name}")


def read_record(path: Path, marker: Path, rows: int) -> tuple[list, str]:
    """The rows of a split that the record at ``path`` (its marker, or its progress record) says were found whole
    ([(lo, hi), ...]), and '' -- when it counts: a regular file owned by this user, that neither its group nor others
    may write, naming ``marker`` and ``rows``. Else ([], why it does not count); ([], '') when there is none."""
    try:  # no symbolic link followed; a FIFO opens without waiting for a writer (and is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return [], ""
    except OSError as err:
        return [], "a symbolic link" if err.errno in (errno.ELOOP, errno.EMLINK) else f"unreadable: {err.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [], "not a regular file"
        if st.st_uid != os.getuid():
            return [], f"owned by user {st.st_uid}, not by this user ({os.getuid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return [], "others than its owner may write it"
        chunks, left = [], RECORD_LIMIT + 1
        while left and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        text = b"".join(chunks)
    except OSError as err:
        return [], f"unreadable: {err.strerror}"
    finally:
        os.close(fd)
    try:
        record = json.loads(text)
        spans = record["done"]
        assert len(text) <= RECORD_LIMIT and record["of"] == Path(marker).name and record["rows"] == rows
        assert isinstance(spans, list) and all(isinstance(s, list) and len(s) == 2 for s in spans)
        assert all(type(lo) is int and type(hi) is int and 0 <= lo < hi <= rows for lo, hi in spans)
    except (ValueError, TypeError, KeyError, AssertionError):
        return [], "not a record of these photos' check (an earlier version's, or another folder's)"
    return _merged(spans), ""


def read_progress(marker: Path, rows: int) -> list:
    """The rows an earlier launch found whole ([(lo, hi), ...]); [] when no record that counts (``read_record``)
    is kept: it is a shortcut, and anything odd in it costs a check, never skips one it should not."""
    return read_record(progress_path(marker), marker, rows)[0]


def _write_record(path: Path, marker: Path, rows: int, spans: list) -> None:
    """The record of ``spans`` at ``path``, replaced whole: a new file (never through a planted link) that neither
    its group nor others may write, whatever the umask. A failure costs the next launch a longer check, nothing
    else."""
    tmp = path.with_name(f".{temp_name(path).name}")  # hidden: no glob of records matches it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(create_exclusive(tmp), "w") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
            f.write(json.dumps({"of": Path(marker).name, "rows": rows, "done": [list(s) for s in spans]}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _write_progress(marker: Path, rows: int, spans: list) -> None:
    """Record ``spans`` (with what another launch on the same files recorded meanwhile)."""
    spans = _merged([*read_progress(marker, rows), *spans])
    _write_record(progress_path(marker), marker, rows, spans)


def _say_ignored(ignored: list) -> None:
    """One line for the records of this launch that do not count ([(path, why), ...]), none when there are none."""
    if ignored:
        (path, why), more = ignored[0], f"; and {len(ignored) - 1} more" if len(ignored) > 1 else ""
        say(
            f"NOTE: the photo check's record {path} is ignored ({why}{more}): only a record this user wrote, that "
            "no one else may change, marks photos checked. Its photos are checked again."
        )


def _check_rows(split, spans, side: int, clean) -> list:
    """In a forked process: decode the photos at the rows of ``spans`` as training reads them; [(source, reason),
    ...]. ``clean`` (shared with the parent) counts the rows checked whole before the first damaged one: what a
    check stopped midway keeps."""
    import torch

    torch.set_num_threads(1)
    bad = []
    for lo, hi in spans:
        for i in range(lo, hi):
            try:
                with open_rgb(split.source_at(i), side):
                    pass
            except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, it is one bad file, named
                bad.append((split.file_at(i), unreadable_reason(err)))
            if not bad:
                clean.value += 1
    return bad


class PhotoCheck:
    """The check of some splits: ``items`` is [(split, marker path, what), ...], the splits without a marker; the
    rows an earlier launch found whole (``read_progress``) are not checked again. Read by the process that started
    it, without a thread: ``poll()`` (non-blocking, once per optimizer step through ``StopFlag``) or ``wait()``;
    ended early by ``stop()``, which records how far it got."""

    def __init__(self, items: list, side: int):
        self.items, self.side = items, side
        read = [read_record(progress_path(marker), marker, len(split)) for split, marker, _ in items]
        self.done_before = [spans for spans, _ in read]
        # the progress records that do not count (``read_record``): [(path, why), ...]
        self.ignored = [(progress_path(item[1]), why) for item, (_, why) in zip(items, read) if why]
        self.already = sum(_count(spans) for spans in self.done_before)  # checked by earlier launches
        self.total = sum(len(split) for split, _, _ in items) - self.already  # left to check
        self.error: DataError | None = None
        self.done = False
        self._jobs = []
        self._saved_at = time.monotonic()

    def start(self, processes: int, nice: int = 0) -> PhotoCheck:
        """Fork up to ``processes`` checkers per split, each decoding a share of the rows left to check."""
        context = multiprocessing.get_context("fork")
        for (split, marker, what), before in zip(self.items, self.done_before):
            parts = []
            for spans in _parts(_complement(before, len(split)), processes):
                clean = context.RawValue("q", 0)
                parts.append((spans, clean, Forked(_check_rows, (split, spans, self.side, clean), nice, "photo-check")))
            self._jobs.append((split, marker, what, before, parts))
        _running(self)
        return self

    def poll(self, block: bool = False) -> DataError | None:
        """The error naming the damaged photos once the check has found them; None meanwhile, and when none is."""
        if not self.done:
            if all(proc.poll(block) for *_, parts in self._jobs for _, _, proc in parts):
                self._finish()
            elif time.monotonic() - self._saved_at > SAVE_EVERY_S:  # a SIGKILLed run keeps most of its check
                self._save()
        return self.error

    def _found(self, before, parts) -> list:
        """The rows of one split found whole: before this launch, and by its checkers so far."""
        return _merged([*before, *(s for spans, clean, _ in parts for s in _first(spans, clean.value))])

    def _save(self, complete=()) -> None:
        self._saved_at = time.monotonic()
        for split, marker, _, before, parts in self._jobs:
            found = self._found(before, parts)
            if marker in complete:  # its marker says it all
                continue
            if _count(found) > _count(before):
                _write_progress(marker, len(split), found)

    def _finish(self) -> None:
        errors, complete = [], set()
        for split, marker, what, before, parts in self._jobs:
            bad = sorted(b for _, _, proc in parts if proc.answer for b in proc.answer)
            if bad:
                errors.append(unreadable_error(bad, len(split), what))
            if not bad and all(proc.answer is not None for _, _, proc in parts):  # every row read whole
                complete.add(marker)
                _write_record(Path(marker), marker, len(split), _merged([(0, len(split))]))  # failed: checked again
                with contextlib.suppress(OSError):
                    progress_path(marker).unlink(missing_ok=True)
        self._save(complete)  # a checker killed first (no verdict, no marker), or a damaged photo: what was whole
        if errors:
            self.error = errors[0] if len(errors) == 1 else DataError(" ".join(str(e) for e in errors))
        self.done = True
        _RUNNING.discard(self)

    def stop(self) -> str:
        """End the check now, without waiting for it: a verdict already in is kept (its marker written), else the
        checkers are killed and the rows they found whole are recorded for the next launch. Returns a line for the
        run's output: how far it got when it was cut short, the damaged photos of a verdict that came in only now,
        else ''."""
        if self.done:
            return ""
        error = self.poll()  # a verdict that came in since the last look: kept, and said when it names a photo
        if self.done:
            return str(error) if error is not None else ""
        for *_, parts in self._jobs:
            for _, _, proc in parts:
                proc.stop()
        self._save()
        self.done = True
        _RUNNING.discard(self)
        left = self.total + self.already - sum(_count(self._found(b, parts)) for *_, b, parts in self._jobs)
        return (
            f"the photo check was stopped with the run, {left:,} of {self.total + self.already:,} photos left "
            "unchecked: the next launch checks those"
        )

    def wait(self) -> None:
        """Until every photo is checked; raises the error naming the damaged ones."""
        if self.poll(block=True) is not None:
            raise self.error


def check_splits(items: list, side: int) -> PhotoCheck | None:
    """Check the splits of ``items`` ([(split, marker, what), ...]; those with a marker that counts are skipped, and
    the rows an earlier launch found whole, by a record that counts: ``read_record``): before returning when at most
    ``checked_first()`` photos are left (on every core), else in the background (one process, low priority),
    returned running. None when there is nothing to check. One line says which records did not count, if any."""
    left, ignored = [], []
    for split, marker, what in items:
        spans, why = read_record(Path(marker), marker, len(split))
        if why:
            ignored.append((Path(marker), why))
        if _count(spans) < len(split):
            left.append((split, marker, what))
    if not left:
        _say_ignored(ignored)
        return None
    check = PhotoCheck(left, side)
    _say_ignored(ignored + check.ignored)
    if check.total <= checked_first():
        check.start(max(1, min(len(os.sched_getaffinity(0)), check.total // 256 + 1))).wait()
        return None
    return check.start(1, nice=10)
