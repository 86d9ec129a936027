"""The arrow copy ``datasets`` keeps of a local table dataset (a clone of a Hub repo, a folder of parquet or arrow
files), for the photo recipe's tables (``common.data.photo_tables``): the tables' identity that keys it, where it
lives in the cache folder, and the pruning that keeps one copy per dataset folder.

- Identity (``table_state``): each data file's path relative to the dataset folder, size, modification time (ns)
  and a hash of its last 64 KiB. ``cp -a``, ``rsync -a``, a ``chmod`` or an added README.md keep it, so a resume
  on them goes on; rewritten tables (rows changed, added or removed) change it, and the resume is refused. A parquet
  file's last bytes are its footer (each row group's byte sizes and statistics), so rows rewritten under an old
  modification time kept (``cp -p``, ``touch -r``) change it too. Only data files count (``.parquet``, ``.arrow``):
  the files ``datasets`` reads rows from; the folder's other files (README.md, .gitattributes, .git) do not.
- Where: ``<cache>/datasets/tables-<folder>-<state>/``, one copy per dataset folder (its resolved path) and state.
  After a load the copies of the same folder's other states are removed, found by name inside the cache folder
  (nothing else there is touched); a copy whose tables a live process holds (a shared lock on ``<copy>.lock``,
  held as long as its tables are: ``Held``) is kept.

NOTE: on a filesystem without ``flock`` nothing is pruned (whether a copy is in use cannot be told).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import weakref
from pathlib import Path

DATA_ENDINGS = (".parquet", ".arrow")  # what datasets reads a table's rows from (common.data.folders: a repository)
TAIL_BYTES = 1 << 16
STATE_VERSION = "tables/1"


def table_state(folder: Path) -> str | None:
    """A hash of the data files of the local table dataset ``folder`` (module docstring); None when a file vanishes
    or cannot be read during the walk (the load then names what is wrong)."""
    folder = Path(folder)
    files, visited = [], set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):  # datasets reads through links
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in visited:  # a link back up the tree: each folder once
            dirnames[:] = []
            continue
        visited.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache
        for name in sorted(filenames):
            if name.startswith(".") or not name.lower().endswith(DATA_ENDINGS):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    f.seek(max(0, st.st_size - TAIL_BYTES))
                    tail = hashlib.sha256(f.read(TAIL_BYTES)).hexdigest()
            except OSError:
                return None
            files.append((os.path.relpath(path, folder), st.st_size, st.st_mtime_ns, tail))
    return hashlib.sha256(json.dumps([STATE_VERSION, files]).encode()).hexdigest()[:32]


def _folder_key(folder: Path) -> str:
    return hashlib.sha256(os.path.realpath(folder).encode("utf-8", "surrogateescape")).hexdigest()[:16]


def copy_dir(cache_dir: Path, folder: Path, state: str) -> Path:
    """Where ``datasets`` keeps its arrow copy of ``folder`` in ``state``."""
    return Path(cache_dir) / "datasets" / f"tables-{_folder_key(folder)}-{state}"


class Held:
    """A shared lock on an arrow copy, held while this object lives: the splits read from the copy keep it, so the
    copy is not pruned under them. A loader worker's pickled copy holds nothing (its parent does)."""

    def __init__(self, fd: int | None = None):
        self.fd = fd
        if fd is not None:
            weakref.finalize(self, os.close, fd)

    def __reduce__(self):
        return (Held, ())


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, own = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _take(lock_path: Path, how: int) -> int | None:
    """A descriptor holding ``flock(how)`` on the file ``lock_path`` names now; None when it is busy (``LOCK_NB``),
    cannot be made, or the filesystem has no flock."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # follows the umask
        except OSError:
            return None
        try:
            fcntl.flock(fd, how)
            same = _same_file(fd, lock_path)
        except OSError:
            os.close(fd)
            return None
        if same:
            return fd
        os.close(fd)  # a pruner removed it between the open and the lock: take the file the name holds now


def hold(copy: Path) -> Held:
    """A shared lock on ``copy`` (made before ``datasets`` writes it, so a pruner never removes it mid-build)."""
    with contextlib.suppress(OSError):
        copy.parent.mkdir(parents=True, exist_ok=True)
    return Held(_take(copy.with_name(copy.name + ".lock"), fcntl.LOCK_SH))


def prune(copy: Path) -> list[str]:
    """Remove the arrow copies of the same dataset folder in other states than ``copy``'s, and their lock files,
    unless a live process holds them; only names this module makes, inside ``copy``'s folder. The names removed."""
    head, _, state = copy.name.rpartition("-")
    ours = re.compile(rf"{re.escape(head)}-([0-9a-f]{{32}})(\.lock)?")
    try:
        names = os.listdir(copy.parent)
    except OSError:
        return []
    others = sorted({m.group(1) for e in names if (m := ours.fullmatch(e)) and m.group(1) != state})
    removed = []
    for other in others:
        old = copy.parent / f"{head}-{other}"
        lock = old.with_name(old.name + ".lock")
        fd = _take(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:  # in use by a live run (or no flock here): kept
            continue
        try:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
                removed.append(old.name)
            with contextlib.suppress(OSError):
                lock.unlink()
        finally:
            os.close(fd)
    return removed
