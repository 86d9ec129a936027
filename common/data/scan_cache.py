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

A cache folder may be shared, and someone else may write it: the kept scan is a shortcut, never an authority. Read
back, it is checked against the folder before it is used: its arrays file is one this module names, inside the
cache folder, whose arrays are no larger than the file; the folders it lists are the dataset's own (the dataset
folder first, the splits' and classes' folders among them, nothing outside it); the class names are those of the
class folders listed now; every path is relative, inside its split's class folder, and its class is read from the
path (the stored classes must agree); the fingerprints are computed from what was read. Whatever fails is not an
error: the folder is walked. The walk beside training then compares every file, so a list that leaves a file out
stops the run too. Only files this module made, by name inside the cache folder, are ever removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
import unicodedata
import uuid
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from common.data import folders
from common.data.folders import FolderScan, FolderSplit
from common.data.photo_check import Forked
from common.data.walk import entries, image_endings
from common.errors import DataError
from common.files import write_atomic

VERSION = 1


def _index(cache_dir: Path, root: Path) -> Path:
    key = hashlib.sha256(json.dumps([VERSION, os.path.realpath(root)]).encode()).hexdigest()[:32]
    return cache_dir / f"scan-{key}.json"


def _arrays_name(index: Path, name) -> str | None:
    """``name`` when it is an arrays file this module names for ``index`` (in the cache folder itself), else None:
    a path, ``..`` or another name is never read or removed."""
    ok = isinstance(name, str) and re.fullmatch(re.escape(index.stem) + r"-[0-9a-f]{8}\.npz", name)
    return name if ok else None


def _unchanged(dirs: list) -> bool:
    for path, dev, ino, mtime, ctime in dirs:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != (dev, ino, mtime, ctime):
            return False
    return True


ARRAY_KINDS = {"files": np.uint8, "labels": np.int64, "stats": np.int64}


def _load_arrays(path: Path, splits) -> dict:
    """The arrays of a kept scan, each checked before it is read: stored uncompressed, of the dtype this module
    writes, and declaring no more bytes than the file holds (a crafted header cannot make numpy allocate more)."""
    names = {
        f"{split}.{kind}.npy": (f"{split}.{kind}", dtype) for split in splits for kind, dtype in ARRAY_KINDS.items()
    }
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        if sorted(i.filename for i in archive.infolist()) != sorted(names):
            raise ValueError("not the arrays of this scan")
        for info in archive.infolist():
            key, dtype = names[info.filename]
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError("compressed")
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, found = read_header(member)
                if found != np.dtype(dtype) or fortran or len(shape) != (2 if key.endswith("stats") else 1):
                    raise ValueError("unexpected array")
                if math.prod(shape) * found.itemsize > info.file_size:
                    raise ValueError("declares more than the file holds")
                arrays[key] = np.frombuffer(member.read(), dtype=found, count=math.prod(shape)).reshape(shape)
    return arrays


def _class_folders(root: Path, kept_splits) -> tuple[dict[str, str], list[str]]:
    """Each split's path prefix in the dataset folder ('' for a split that is the folder itself) and the training
    classes, read from the folder now (a few directory listings, not a walk). ValueError when the layout differs
    from the kept scan's splits."""
    skipped = Counter()
    endings = image_endings()
    top_dirs, top_loose = entries(root, endings, skipped)
    try:
        roots = folders._split_roots(root, top_dirs, top_loose, str(root))
    except DataError as err:
        raise ValueError("layout") from err
    if set(roots) != set(kept_splits):
        raise ValueError("other splits")
    prefixes, classes = {}, {}
    for split, split_root in roots.items():
        prefixes[split] = "" if split_root == root else split_root.name + "/"
        class_dirs = top_dirs if split_root == root else entries(split_root, endings, skipped)[0]
        classes[split] = {d: unicodedata.normalize("NFC", d) for d in class_dirs}
    return prefixes, classes


def read(cache_dir: Path, root: Path) -> FolderScan | None:
    """The kept scan of ``root`` when no folder of it changed since and it passes every check (module docstring),
    else None (the folder is then walked)."""
    index, root = _index(cache_dir, root), Path(root)
    try:
        entry = json.loads(index.read_text())
        arrays_name = _arrays_name(index, entry["arrays"])
        dirs, class_names, kept_splits = entry["dirs"], entry["class_names"], list(entry["splits"])
        if entry["version"] != VERSION or arrays_name is None or not dirs or not kept_splits:
            return None
        if os.path.realpath(dirs[0][0]) != os.path.realpath(root) or not _unchanged(dirs):
            return None
        inside = os.path.join(os.path.realpath(root), "")
        if any(not os.path.realpath(d[0]).startswith(inside) for d in dirs[1:]):
            return None  # a folder that is not the dataset's
        prefixes, classes = _class_folders(root, kept_splits)
        if sorted(set(classes["train"].values())) != class_names or len(class_names) < 2:
            return None
        listed = {os.path.realpath(d[0]) for d in dirs}
        for split in kept_splits:  # every split's and class's folder is among those whose times were compared
            split_dir = root / prefixes[split] if prefixes[split] else root
            needed = [split_dir, *(split_dir / d for d in classes[split])]
            if any(os.path.realpath(p) not in listed for p in needed):
                return None
        label_of = {c: i for i, c in enumerate(class_names)}
        arrays = _load_arrays(index.parent / arrays_name, kept_splits)
        splits = {}
        for name in kept_splits:
            files = arrays[f"{name}.files"].tobytes().decode("utf-8", "surrogateescape").split("\0")
            labels = [_label(f, prefixes[name], classes[name], label_of) for f in files]
            if labels != arrays[f"{name}.labels"].tolist() or len(arrays[f"{name}.stats"]) != len(files):
                return None
            stats = [tuple(s) for s in arrays[f"{name}.stats"].tolist()]  # (size, mtime_ns, ctime_ns) per file
            splits[name] = FolderSplit(name, root, files, labels, stats)  # fingerprint computed from these
    except (OSError, ValueError, KeyError, TypeError, IndexError, zipfile.BadZipFile, DataError):
        return None
    return FolderScan(root, class_names, splits, Counter(entry["skipped"]), dirs=dirs, kept=True)


def _label(path: str, prefix: str, class_dirs: dict[str, str], label_of: dict[str, int]) -> int:
    """The class of a kept path, read from the path as the walk reads it: ``[split/]class/.../file``, relative, with
    no ``..`` or empty part. ValueError otherwise (a path outside its split's class folders)."""
    parts = path.split("/")
    if not path.startswith(prefix) or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError("a path outside the dataset")
    rest = parts[prefix.count("/") :]
    if len(rest) < 2 or rest[0] not in class_dirs or class_dirs[rest[0]] not in label_of:
        raise ValueError("a path outside the class folders")
    return label_of[class_dirs[rest[0]]]


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
        _prune(index, keep=arrays_name)


def _prune(index: Path, keep: str | None = None) -> None:
    """Remove this folder's arrays files other than ``keep``: only names this module makes, in the cache folder.
    (Two launches racing to write leave one index; the other's arrays file goes here, not on for ever.)"""
    for path in index.parent.glob(f"{index.stem}-*.npz"):
        if path.name != keep and _arrays_name(index, path.name) and not path.is_symlink():
            path.unlink(missing_ok=True)


def drop(cache_dir: Path, root: Path) -> None:
    """Forget the kept scan of ``root``."""
    index = _index(cache_dir, root)
    with contextlib.suppress(OSError):
        _prune(index)
        index.unlink(missing_ok=True)


def _walk_again(root, name, kept: dict, since_ns: int) -> str:
    """In a forked process: walk the folder; '' when it holds the files kept (a file added since ``since_ns``, after
    this run read the kept scan, is no concern of this run's), else what differs, said in full."""
    try:
        fresh = folders.scan(root, name)
        for split, old in kept.items():
            new = fresh.splits.get(split)
            if new is None:
                return f"its {split} split is gone"
            now = dict(zip(new.files, new.stats))
            for file, stat in zip(old.files, old.stats):
                found = now.pop(file, None)
                if found is None:
                    return f"{file}, in the kept scan, is no longer in the folder"
                if tuple(found) != tuple(stat):
                    return (
                        f"{file} was replaced in place under its own name, which leaves its folder's times as they were"
                    )
            unlisted = sorted(f for f, stat in now.items() if stat[2] < since_ns)
            if unlisted:
                return (
                    f"{unlisted[0]} was in the folder before this run started but is not in the kept scan (a scan "
                    "kept for another state of the folder, or written by someone else)"
                )
        if set(fresh.splits) != set(kept):
            return "its splits differ"
    except DataError as err:
        return str(err)
    return ""


class Verify:
    """The folder walked anew beside training, when the run started from a kept scan; ``poll()`` once per step
    (``common.train.stopping.StopFlag.watch``) returns the error when a file differs."""

    SLACK_NS = 5 * 10**9  # a file's ctime may be rounded down by the filesystem: added just now counts as added now

    def __init__(self, cache_dir: Path, scan: FolderScan, name: str):
        self.cache_dir, self.root, self.name = cache_dir, scan.root, name
        self.error = None
        since = time.time_ns() - self.SLACK_NS
        self._walk = Forked(_walk_again, (scan.root, name, scan.splits, since), nice=10, name="scan-verify")

    def poll(self, block: bool = False):
        if self.error is None and self._walk.poll(block) and self._walk.answer:  # '': same files; None: killed
            drop(self.cache_dir, self.root)  # the next launch walks the folder
            self.error = DataError(
                f"The folder {self.name} does not hold the files of the scan kept for it in the cache folder: "
                f"{self._walk.answer}. This run started from that list of files, so it stopped; start it again (a new "
                "--output-dir, or remove this run's): the folder is walked afresh."
            )
        return self.error
