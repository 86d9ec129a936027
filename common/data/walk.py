"""Walking a folder for image files, the one walk that a dataset folder's scan (``common.data.folders``) and
``predict`` share: links followed, each folder once, a link back up the tree refused, hidden entries and files that
are not images counted, everything sorted so that every process sees the same files in the same order."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from common.errors import DataError

# Pillow registers these formats but opens them only with a plug-in or program of its own (ghostscript for EPS)
NOT_DECODED = {"BUFR", "GRIB", "HDF5", "MPEG", "WMF", "EPS"}


def image_endings() -> set[str]:
    """The file endings read as images: those of the formats Pillow decodes by itself."""
    from PIL import Image

    Image.init()
    return {
        ext.lower()
        for ext, fmt in Image.registered_extensions().items()
        if fmt in Image.OPEN and fmt not in NOT_DECODED
    }


def walk_error(err: OSError):
    if isinstance(err, FileNotFoundError):
        raise DataError(
            f"The folder {err.filename} vanished while the dataset was read (moved or deleted meanwhile): "
            "its images would be left out. Run again once the dataset folder is settled."
        )
    raise DataError(
        f"Could not read the folder {err.filename} ({err.strerror}): its images would be left out "
        "without a word. Fix its permissions (e.g. chmod -R u+rX) or move it out of the dataset."
    )


def images_below(top: Path, endings: set[str] | None = None, skipped: Counter | None = None) -> list[str]:
    """Every image file at any depth below ``top`` (links followed, each folder once; a link back up the tree
    refused), sorted; hidden entries and other files counted in ``skipped``. The walk predict shares."""
    return [path for path, _ in walk_images(top, endings, skipped, stat=False)]


def walk_images(top: Path, endings: set[str] | None, skipped: Counter | None, stat: bool = True) -> list:
    """(path, (st_dev, st_ino, size, mtime_ns, ctime_ns, linked) or None) of every image below ``top``, sorted by
    path: one stat per file (None for a dangling link: the decode names it among the unreadable files); ``linked``:
    reached through a link, or one of several hard links to its file."""
    endings = image_endings() if endings is None else endings
    skipped = Counter() if skipped is None else skipped
    found, visited, top_real = [], set(), os.path.realpath(top)
    pending = [(str(top), os.path.islink(top))]  # (folder, reached through a link)
    while pending:
        dirpath, via_link = pending.pop()
        real = os.path.realpath(dirpath)
        if dirpath != str(top) and (real == top_real or top_real.startswith(real + os.sep)):
            raise DataError(
                f"{dirpath} is a link back up the tree (to {real}), which holds the class folder {top}: "
                f"every image below {real} would also be read as class {Path(top).name}. Remove the "
                "link, or replace it with a copy of the images that belong to that class."
            )
        try:
            st = os.stat(dirpath)
            entries = list(os.scandir(dirpath))
        except OSError as err:  # it vanished (moved or deleted) while the folder was read, or is unreadable
            walk_error(err)
        if (st.st_dev, st.st_ino) in visited:  # a second link to a folder already walked: once
            continue
        visited.add((st.st_dev, st.st_ino))
        below = []
        for e in entries:
            name = e.name
            if name.startswith("."):
                skipped["hidden"] += 1
                continue
            try:
                is_dir = e.is_dir()  # follows a link, as os.walk(followlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                below.append((e.path, via_link or e.is_symlink()))
                continue
            dot = name.rfind(".")  # os.path.splitext's ending (hidden names are skipped above), without its cost
            ext = name[dot:].lower() if dot > 0 else ""
            if ext not in endings:
                skipped[ext or "(no ending)"] += 1
            elif not stat:
                found.append((e.path, None))
            else:
                try:
                    s = e.stat()
                    linked = via_link or s.st_nlink > 1 or e.is_symlink()
                    found.append((e.path, (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns, linked)))
                except OSError:
                    found.append((e.path, None))
        pending.extend(sorted(below, reverse=True))  # folders in name order, depth first (a folder reached twice
        # through links is walked where it comes first)
    found.sort(key=lambda item: item[0])
    return found


def entries(folder: Path, endings: set[str], skipped: Counter):
    """(sub-folders, loose images) directly in ``folder``; hidden entries and other files counted."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as err:
        walk_error(err)
    dirs, images = [], []
    for e in entries:
        if e.name.startswith("."):
            skipped["hidden"] += 1
        elif e.is_dir():
            dirs.append(e.name)
        elif os.path.splitext(e.name)[1].lower() in endings:
            images.append(e.name)
        else:
            skipped[os.path.splitext(e.name)[1].lower() or "(no ending)"] += 1
    return dirs, images
