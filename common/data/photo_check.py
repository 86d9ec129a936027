"""Every photo of a folder decoded whole once per state of its files, so that a damaged one (a header that reads,
data cut short) is named with all the others in one message, instead of being met by a loader worker mid-epoch.

The check runs in forked processes, once per node (its local main process), and leaves a marker in the cache folder
named by the split's fingerprint (every file's path, size and times): a later launch on the same files skips it.

- A folder of at most ``checked_first()`` photos (20,000; the environment variable
  ``ACCELERATE_RECIPES_CHECK_FIRST`` sets another count) is checked before training starts, on every core.
- A larger one is checked while training runs, by one process at low priority: a first launch on a million photos
  starts training in seconds instead of waiting minutes for the decode. A damaged photo found then stops the run at
  the next optimizer step every rank agrees on (``common.train.stopping.StopFlag.fail``), with every damaged file named.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from pathlib import Path

from common.data.pixels import open_rgb, unreadable_error, unreadable_reason
from common.errors import DataError
from common.files import write_atomic

CHECKED_FIRST = 20_000
ENV = "ACCELERATE_RECIPES_CHECK_FIRST"


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


class Forked:
    """``target(*args)`` in a forked process (it inherits what it reads: nothing is pickled) at ``nice`` priority,
    ended with this process; its return value read without a thread, by ``poll()``. The checks that run beside
    training (this module's, ``common.data.scan_cache.Verify``) are made of these."""

    def __init__(self, target, args: tuple, nice: int = 0, name: str = ""):
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._proc = context.Process(target=_answer, args=(nice, target, args, send), daemon=True, name=name)
        self._proc.start()
        send.close()
        self.done, self.answer = False, None

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
        return self.done


def _answer(nice: int, target, args: tuple, conn) -> None:
    if nice:
        os.nice(nice)
    conn.send(target(*args))
    conn.close()


def _check_rows(split, rows, side: int) -> list:
    """In a forked process: decode the photos at ``rows`` as training reads them; [(source, reason), ...]."""
    import torch

    torch.set_num_threads(1)
    parent, bad = os.getppid(), []
    for k, i in enumerate(rows):
        if k % 4096 == 0 and os.getppid() != parent:  # the run is gone: stop, leave no marker
            os._exit(0)
        try:
            with open_rgb(split.source_at(i), side):
                pass
        except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, it is one bad file, named
            bad.append((split.file_at(i), unreadable_reason(err)))
    return bad


class PhotoCheck:
    """The check of some splits: ``items`` is [(split, marker path, what), ...], the splits without a marker. Read
    by the process that started it, without a thread: ``poll()`` (non-blocking, once per optimizer step through
    ``StopFlag``) or ``wait()``."""

    def __init__(self, items: list, side: int):
        self.items, self.side = items, side
        self.total = sum(len(split) for split, _, _ in items)
        self.error: DataError | None = None
        self.done = False
        self._jobs = []

    def start(self, processes: int, nice: int = 0) -> PhotoCheck:
        """Fork ``processes`` checkers per split, each decoding a share of its rows."""
        for split, marker, what in self.items:
            rows = range(len(split))
            parts = [
                Forked(_check_rows, (split, rows[k::processes], self.side), nice, "photo-check")
                for k in range(processes)
            ]
            self._jobs.append((split, marker, what, parts))
        return self

    def poll(self, block: bool = False) -> DataError | None:
        """The error naming the damaged photos once the check has found them; None meanwhile, and when none is."""
        if not self.done and all(part.poll(block) for _, _, _, parts in self._jobs for part in parts):
            self._finish()
        return self.error

    def _finish(self) -> None:
        errors = []
        for split, marker, what, parts in self._jobs:
            bad = sorted(b for part in parts if part.answer for b in part.answer)
            if bad:
                errors.append(unreadable_error(bad, len(split), what))
            elif all(part.answer is not None for part in parts):  # a checker killed first: no verdict, no marker
                with contextlib.suppress(OSError):  # only a shortcut: a failure costs the next launch a check
                    Path(marker).parent.mkdir(parents=True, exist_ok=True)
                    write_atomic(Path(marker), "")
        if errors:
            self.error = errors[0] if len(errors) == 1 else DataError(" ".join(str(e) for e in errors))
        self.done = True

    def wait(self) -> None:
        """Until every photo is checked; raises the error naming the damaged ones."""
        if self.poll(block=True) is not None:
            raise self.error


def check_splits(items: list, side: int) -> PhotoCheck | None:
    """Check the splits of ``items`` ([(split, marker, what), ...]; those with a marker are skipped): before
    returning when they hold at most ``checked_first()`` photos (on every core), else in the background (one
    process, low priority), returned running. None when there is nothing to check."""
    items = [item for item in items if not Path(item[1]).exists()]
    if not items:
        return None
    check = PhotoCheck(items, side)
    if check.total <= checked_first():
        check.start(max(1, min(len(os.sched_getaffinity(0)), check.total // 256 + 1))).wait()
        return None
    return check.start(1, nice=10)
