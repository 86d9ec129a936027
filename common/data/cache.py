"""The decoded-image store shared by the processes of a node (the contract: ``common.data.decoded``). One
safetensors file per decoded split, written once under a file lock (``safetensors.torch.save`` through
``common.files.write_atomic``: a new file, never through a planted symlink, fsynced, renamed into place) and read by
every process through ``safe_open``'s memory map; a damaged file is named and decoded again. Plus the index that
lets an unchanged local table folder skip ``datasets`` on the next launch (keyed by the folder's identity,
``common.data.table_copies``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
import zlib
from pathlib import Path

import torch

from common import console
from common.data.splits import ImageSplit
from common.errors import DataError
from common.files import write_atomic

CACHE_VERSION = "3"  # 3: 16-bit scaled, transparency flattened, EXIF applied, channels over the split
CACHE_FORMAT = "accelerate-recipes-decoded/2"
TAIL_BYTES = 1 << 16
LOCK_WAIT_S = 4 * 3600  # how long a process waits for a peer to decode a split before it gives up
LOCK_POLL_S = 0.5


class _Damaged(Exception):
    """The cache file exists but cannot be trusted; the message says why."""


def cache_path(cache_dir: Path, fingerprint: str, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps([CACHE_VERSION, fingerprint, settings], sort_keys=True).encode()).hexdigest()
    return cache_dir / f"{key[:32]}.safetensors"


def _checksums(images: torch.Tensor, labels: torch.Tensor) -> dict:
    """CRC32s of the labels and of the images' last 64 KiB: with the exact file size safetensors checks, they catch a
    truncated or zero-filled file without a pass over all of it (which would cost every process a read of the data)."""
    tail = images.reshape(-1)[-TAIL_BYTES:].numpy()
    return {"labels_crc32": f"{zlib.crc32(labels.numpy()):08x}", "tail_crc32": f"{zlib.crc32(tail):08x}"}


def _read(path: Path) -> ImageSplit:
    """A cache file ``_write`` wrote; FileNotFoundError if absent, _Damaged if not intact. safetensors checks the header
    and that the tensors cover the file exactly, and maps the file copy-on-write (the pages are the page cache's, shared
    by the node's processes; batches are gathered copies, so nothing writes to them). One open does all of it, so what
    is checked is what is mapped, whatever a peer renames over the name meanwhile. The file is never rewritten in place
    (a truncated mapped file faults its readers): writers rename a new file over it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != CACHE_FORMAT or set(f.keys()) != {"images", "labels"}:
                raise _Damaged("not a decoded split of this version")
            images, labels = f.get_tensor("images"), f.get_tensor("labels")
    except SafetensorError as err:
        raise _Damaged(str(err)) from None
    n = images.shape[0] if images.dim() == 4 else -1
    if images.dtype != torch.uint8 or labels.dtype != torch.int64 or tuple(labels.shape) != (n,):
        raise _Damaged("tensors of the wrong type or shape")
    if _checksums(images, labels) != {k: meta.get(k) for k in ("labels_crc32", "tail_crc32")}:
        raise _Damaged("checksum mismatch")
    return ImageSplit(images, labels, note=meta.get("note", ""))


def _write(path: Path, split: ImageSplit, class_names) -> None:
    from safetensors.torch import save

    images, labels = split.images.contiguous(), split.labels.to(torch.int64).contiguous()
    meta = {"format": CACHE_FORMAT, "class_names": json.dumps(class_names), "note": split.note}
    try:
        write_atomic(path, save({"images": images, "labels": labels}, {**meta, **_checksums(images, labels)}))
    except OSError as err:
        raise DataError(
            f"Could not write the decoded-image cache {path} ({err.strerror or err}). Free space there, "
            "or pass --cache-dir a writable directory with room for the decoded images."
        ) from None


def _remove_stale_temps(path: Path, max_age_s: float = 86400):
    """Temporary files of a writer that died. Called under the lock of ``path``, so this key's temporary files
    are all stale; those of other keys only when a day old (their writers may be alive, unlocked)."""
    now = time.time()
    for tmp in path.parent.glob("*.tmp"):
        with contextlib.suppress(OSError):
            if tmp.name.startswith(path.name + ".") or now - tmp.stat().st_mtime > max_age_s:
                tmp.unlink()


@contextlib.contextmanager
def _file_lock(lock_path: Path, on_wait):
    """Hold an exclusive flock on ``lock_path``; yields False where the filesystem has no flock. The lock is
    released when the file is closed, including when the process dies, so a crashed decoder frees it."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # follows the umask, like the cache
    except OSError as err:
        raise DataError(
            f"Could not create {lock_path} ({err.strerror or err}). Pass --cache-dir a directory this "
            "user can write, or fix the permissions of that one."
        ) from None
    try:
        locked, deadline = True, time.time() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # a peer decodes: wait (a stop signal interrupts the wait, common.train.stopping)
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                if time.time() > deadline:
                    raise DataError(
                        f"Gave up after {LOCK_WAIT_S // 60} minutes waiting for {holder} to decode into "
                        f"the cache (it holds {lock_path}). If that process is gone (a machine that lost "
                        "its connection to a network filesystem can hold a lock), delete the lock file "
                        "and rerun, or pass --cache-dir a folder of your own."
                    ) from None
                if on_wait is not None:
                    on_wait(holder)
                    on_wait = None
                time.sleep(LOCK_POLL_S)
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                locked = False
                break
        if locked:  # name the holder for whoever waits next
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{socket.gethostname()} PID {os.getpid()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield locked
    finally:
        os.close(fd)


def _identity(path: Path):
    with contextlib.suppress(OSError):
        st = path.stat()
        return st.st_ino, st.st_mtime_ns, st.st_size
    return None


def cached_split(path: Path, decode, what: str, class_names, is_main: bool) -> ImageSplit:
    """Read the split from ``path``, or decode it and write it there: one decoder per cache file. A process that
    waited on a peer that failed raises the peer's message (its '.error' file) instead of decoding to fail alike."""
    say = console.say if is_main else (lambda *_: None)  # the process that decodes says what it does
    damage_said = []

    def read() -> ImageSplit | None:
        try:
            return _read(path)
        except FileNotFoundError:
            return None
        except PermissionError as err:
            raise DataError(
                f"The decoded-image cache {path} is not readable by this user ({err.strerror}). Make it "
                "readable (a cache shared with a team wants a umask of 002 for whoever writes it), or pass "
                "--cache-dir a directory of your own."
            ) from None
        except _Damaged as err:
            if not damage_said:  # once, though the file is read again under the lock
                say(f"The decoded-image cache {path} is damaged ({err}); decoding {what} again.")
            damage_said.append(err)
            return None

    if (split := read()) is not None:
        return split
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"Could not create the cache directory {path.parent} ({err.strerror or err}). Pass "
            "--cache-dir a directory this user can write."
        ) from None
    error_file = path.with_suffix(".error")
    before = _identity(error_file)  # a new identity after the wait: the peer that held the lock failed
    with _file_lock(
        path.with_suffix(".lock"), lambda holder: say(f"waiting for {holder} to decode {what} into {path} ...")
    ) as locked:
        if (split := read()) is not None:  # a peer wrote it while this process waited
            return split
        if locked:
            after = _identity(error_file)
            if after is not None and after != before:
                raise DataError(error_file.read_text())
            _remove_stale_temps(path)
        say(f"decoding {what} into {path} ...")
        try:
            _write(path, decode(), class_names)
        except DataError as err:
            if locked:  # tell the processes waiting on this lock
                with contextlib.suppress(OSError):
                    write_atomic(error_file, str(err))
            raise
        with contextlib.suppress(OSError):
            error_file.unlink()
        try:
            return _read(path)
        except (OSError, _Damaged) as err:
            raise DataError(
                f"The decoded-image cache {path} could not be read back right after writing it ({err}). "
                "Check the disk behind --cache-dir, or pass another --cache-dir."
            ) from None


def source_index_path(cache_dir: Path, identity: str | None, settings: dict) -> Path | None:
    """The cache entry naming the decoded split files of a local table folder with these decoding settings;
    ``identity``: the folder's, the name of its arrow copy (``common.data.table_copies.copy_dir``: the folder's
    resolved path and its tables' state), or None for a Hub id (only ``datasets`` can tell whether its copy changed)."""
    if identity is None:
        return None
    key = json.dumps([CACHE_VERSION, identity, settings], sort_keys=True)
    return cache_dir / f"source-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_source_index(index: Path):
    """(splits, class names) when the index and every split file it names are intact, else None: the caller
    then takes the full path, which re-decodes what is missing or damaged."""
    try:
        entry = json.loads(index.read_text())
        return {k: _read(index.parent / f) for k, f in entry["splits"].items()}, entry["class_names"]
    except (OSError, ValueError, KeyError, TypeError, _Damaged):
        return None


def write_source_index(index: Path, files: dict, class_names) -> None:
    with contextlib.suppress(OSError):  # only a shortcut: a failure costs the next run the full path
        write_atomic(index, json.dumps({"splits": files, "class_names": list(class_names)}))


def default_cache_dir() -> Path:
    return Path(os.environ.get("ACCELERATE_RECIPES_CACHE", Path.home() / ".cache" / "accelerate-recipes"))
