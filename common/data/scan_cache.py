"""A photo folder's scan kept in the cache folder, so that a later launch on a large folder starts in seconds.

Walking a folder costs one ``stat`` per file (a million files: several seconds on a VM). The scan of a folder (every
file's path, class, size and times; the folders walked and their own times) is written to the cache folder after a
walk, and read back by a later new run when every folder walked still has its device, inode, modification and change
times: a file added, removed or renamed changes its folder's times. A photo replaced in place under its own name does
not, so a run that starts from a kept scan also walks the folder anew in one low-priority process beside training
(``Verify``), and a file that differs stops it at the next step every rank agrees on (the kept scan is dropped: the
next launch walks). A resume and ``--eval-only`` always walk before they start, as they compare the files with the
run's own record.

The scan is stored as data: a small JSON file naming a ``.npz`` (``allow_pickle=False``) of each split's paths
(NUL-joined UTF-8), classes and (size, mtime_ns, ctime_ns).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from common.data import folders
from common.data.folders import FolderScan, FolderSplit
from common.data.photo_check import Forked
from common.errors import DataError
from common.files import write_atomic

VERSION = 1


def _index(cache_dir: Path, root: Path) -> Path:
    key = hashlib.sha256(json.dumps([VERSION, os.path.realpath(root)]).encode()).hexdigest()[:32]
    return cache_dir / f"scan-{key}.json"


def _unchanged(dirs: list) -> bool:
    for path, dev, ino, mtime, ctime in dirs:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != (dev, ino, mtime, ctime):
            return False
    return True


def read(cache_dir: Path, root: Path) -> FolderScan | None:
    """The kept scan of ``root`` when no folder of it changed since, else None."""
    index = _index(cache_dir, root)
    try:
        entry = json.loads(index.read_text())
        if entry["version"] != VERSION or not _unchanged(entry["dirs"]):
            return None
        with np.load(index.parent / entry["arrays"], allow_pickle=False) as arrays:
            splits = {}
            for name in entry["splits"]:
                files = arrays[f"{name}.files"].tobytes().decode("utf-8", "surrogateescape").split("\0")
                stats = list(zip(*arrays[f"{name}.stats"].T.tolist()))  # (size, mtime_ns, ctime_ns) per file
                split = FolderSplit(name, Path(root), files, arrays[f"{name}.labels"].tolist(), stats)
                split._fingerprint = entry["splits"][name]
                splits[name] = split
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return FolderScan(
        Path(root), entry["class_names"], splits, Counter(entry["skipped"]), dirs=entry["dirs"], kept=True
    )


def write(cache_dir: Path, scan: FolderScan) -> None:
    """Keep ``scan`` (only a shortcut: a failure costs the next launch a walk)."""
    index = _index(cache_dir, scan.root)
    arrays_name = f"{index.stem}-{uuid.uuid4().hex[:8]}.npz"
    arrays = {}
    for name, split in scan.splits.items():
        arrays[f"{name}.files"] = np.frombuffer("\0".join(split.files).encode("utf-8", "surrogateescape"), np.uint8)
        arrays[f"{name}.labels"] = np.asarray(split.labels, dtype=np.int64)
        arrays[f"{name}.stats"] = np.asarray(split.stats, dtype=np.int64).reshape(-1, 3)
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            old = json.loads(index.read_text()).get("arrays")
        except (OSError, ValueError, AttributeError):
            old = None
        np.savez(cache_dir / arrays_name, **arrays)
        write_atomic(
            index,
            json.dumps(
                {
                    "version": VERSION,
                    "root": str(scan.root),
                    "arrays": arrays_name,
                    "dirs": scan.dirs,
                    "class_names": scan.class_names,
                    "skipped": dict(scan.skipped),
                    "splits": {k: s.fingerprint for k, s in scan.splits.items()},
                }
            ),
        )
        if old and old != arrays_name:
            (cache_dir / old).unlink(missing_ok=True)


def drop(cache_dir: Path, root: Path) -> None:
    """Forget the kept scan of ``root``."""
    index = _index(cache_dir, root)
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        (cache_dir / json.loads(index.read_text()).get("arrays")).unlink(missing_ok=True)
    index.unlink(missing_ok=True)


def _walk_again(root, name, kept: dict) -> str:
    """In a forked process: walk the folder; '' when every split's files are those kept, else a file that differs."""
    try:
        fresh = folders.scan(root, name)
        diff = ""
        for split, old in kept.items():
            new = fresh.splits.get(split)
            if new is None or new.fingerprint != old.fingerprint:
                pairs = zip(old.files, old.stats, new.files if new else [], new.stats if new else [])
                diff = next((f for f, s, g, t in pairs if (f, s) != (g, t)), None) or f"the {split} split's files"
                break
        if not diff and set(fresh.splits) != set(kept):
            diff = "its splits"
    except DataError as err:
        diff = str(err)
    return diff


class Verify:
    """The folder walked anew beside training, when the run started from a kept scan; ``poll()`` once per step
    (``common.train.stopping.StopFlag.watch``) returns the error when a file differs."""

    def __init__(self, cache_dir: Path, scan: FolderScan, name: str):
        self.cache_dir, self.root, self.name = cache_dir, scan.root, name
        self.error = None
        self._walk = Forked(_walk_again, (scan.root, name, scan.splits), nice=10, name="scan-verify")

    def poll(self, block: bool = False):
        if self.error is None and self._walk.poll(block) and self._walk.answer:  # '': same files; None: killed
            drop(self.cache_dir, self.root)  # the next launch walks the folder
            self.error = DataError(
                f"The folder {self.name} changed since its scan was kept in the cache folder ({self._walk.answer}: a "
                "photo replaced in place under its own name leaves its folder's times as they were), so this run "
                "started from a list of files that is not the folder's. The run stopped; start it again (a new "
                "--output-dir, or remove this run's): the folder is walked afresh."
            )
        return self.error
