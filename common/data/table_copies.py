"""The identity of a local table dataset (a clone of a Hub repo, a folder of parquet or arrow files) and the arrow
copy ``datasets`` keeps of it, for every recipe that reads tables: the small-image recipes (``common.data.decoded``,
whose index of decoded splits is keyed by the copy's name too) and the photo recipe (``common.data.photo_tables``).

- Identity (``table_state``): each data file's path relative to the dataset folder, size, modification time (ns)
  and a hash of its last 64 KiB. ``cp -a``, ``rsync -a``, a ``chmod`` or an added README.md keep it, so a resume
  on them goes on; rewritten tables (rows changed, added or removed) change it, and the resume is refused. A parquet
  file's last bytes are its footer (each row group's byte sizes and statistics), so rows rewritten under an old
  modification time kept (``cp -p``, ``touch -r``) change it too. Only data files count, the files ``datasets``
  reads rows from: the parquet and arrow files of a repository, else the csv, tsv, json and jsonl files; the
  folder's other files (README.md, .gitattributes, .git) do not.
- Where: ``<cache>/datasets/tables-<folder>-<state>/``, one copy per dataset folder (its resolved path) and state,
  as ``datasets`` keeps one per state in its own cache (it keys a local file by its modification time alone, so rows
  rewritten under an old modification time would be read from its stale copy). That name is the folder's identity:
  two folders holding the same tables (or none, only a README) are two datasets.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from common.data.folders import REPOSITORY_ENDINGS, TABLE_ENDINGS

TAIL_BYTES = 1 << 16
STATE_VERSION = "tables/1"


def table_state(folder: Path) -> str | None:
    """A hash of the data files of the local table dataset ``folder`` (module docstring); None when a file vanishes
    or cannot be read during the walk (the load then names what is wrong)."""
    folder = Path(folder)
    found, visited = [], set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):  # datasets reads through links
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in visited:  # a link back up the tree: each folder once
            dirnames[:] = []
            continue
        visited.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache
        for name in sorted(filenames):
            if not name.startswith(".") and name.lower().endswith(tuple(TABLE_ENDINGS)):
                found.append(os.path.join(dirpath, name))
    repository = [p for p in found if p.lower().endswith(tuple(REPOSITORY_ENDINGS))]
    files = []
    for path in repository or found:  # datasets reads a repository's parquet/arrow files, not its json or csv
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


def local_copy(cache_dir: Path, folder: Path | None) -> tuple[str | None, Path | None]:
    """(the tables' state, where ``datasets`` keeps its arrow copy of them) of the local table folder ``folder`` as it
    is now; (None, None) for a Hub id (``folder`` None) or a folder whose files vanish while they are read."""
    state = table_state(folder) if folder is not None else None
    return state, copy_dir(cache_dir, folder, state) if state else None
