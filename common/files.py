"""Writing files so that a crash never leaves half of one: temporary names, exclusive creation that never
follows a symlink, fsync of files and folders, atomic replacement, and moving a folder aside without
replacing an earlier one. Shared by the decoded-image cache, checkpoints, summary.json, config.json and the
model folders."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (some filesystems refuse, which costs only durability)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)  # makes the rename durable; some filesystems refuse, which costs only durability
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A temporary name beside ``path``, unique per host and process."""
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def move_aside(path: Path, name: str) -> Path:
    """Rename ``path`` to ``name`` in its folder, or to ``name.2``, ``name.3``, ... when an earlier copy holds that
    name (the same checkpoint damaged twice): the earlier copy is kept. ``os.replace`` onto it would fail on a folder
    with files ("Directory not empty") and silently replace an empty one. One writer per run directory
    (common.train.rundir), so nothing takes the name between the check and the rename. Returns the new path."""
    target, n = path.with_name(name), 1
    while os.path.lexists(target):
        n += 1
        target = path.with_name(f"{name}.{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def create_exclusive(tmp: Path) -> int:
    """A new file, never an existing one and never through a symlink (a link planted in a shared cache folder
    would otherwise redirect the write to another user's file). A leftover of this name (a dead writer with
    the same host and PID) is unlinked first; unlinking a symlink removes the link, not its target. Mode 0o666
    follows the umask like every other file of a run (mkstemp would force 0600)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsynced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str | bytes) -> None:
    """Temp file, fsync, rename, fsync the folder: readers see the old file or the new one, even after a crash."""
    tmp = temp_name(path)
    try:
        with os.fdopen(create_exclusive(tmp), "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill: no half-written temp file is left beside the old one
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
