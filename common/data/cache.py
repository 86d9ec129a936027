"""The decoded-image cache shared by the processes of a node (see ``common.data.decoded`` for the contract): one
safetensors file per decoded split, written once under a file lock and read by every process through a
memory map; the checks that catch a damaged file; and the index that lets an unchanged local folder skip
``datasets`` on the next launch."""

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
from common.files import create_exclusive as _create_exclusive
from common.files import fsync_dir as _fsync_dir
from common.files import temp_name as _temp_name
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


def _read_cache(path: Path) -> ImageSplit:
    """Open a cache file written by ``_write_cache``; FileNotFoundError if absent, _Damaged if not intact.
    safetensors checks the header and that the tensors cover the file exactly, and maps the file (copy-on-write: the
    pages are the page cache's, shared by every process of the node until one writes to them, and nothing here does:
    batches are gathered copies); the labels and the images' last bytes are checked against their CRCs. One open
    does all of it, so what is checked is what is mapped, whatever a peer renames over the name meanwhile. NOTE: the
    file must never be rewritten in place (a truncated mapped file faults its readers); writers rename a new file over
    it."""
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
    tail = images.reshape(-1)[-TAIL_BYTES:]
    crcs = f"{zlib.crc32(labels.numpy().tobytes()):08x}", f"{zlib.crc32(tail.numpy()):08x}"
    if crcs != (meta.get("labels_crc32"), meta.get("tail_crc32")):
        raise _Damaged("checksum mismatch")
    return ImageSplit(images, labels, note=meta.get("note", ""))


def _write_cache(path: Path, split: ImageSplit, class_names):
    """Write to a temporary file, fsync, rename: a reader sees no file or the whole file, even after a crash."""
    import numpy as np

    images = split.images.contiguous().numpy()
    labels = split.labels.numpy().astype("<i8").tobytes()
    n, n_img = images.shape[0], images.size
    header = {
        "__metadata__": {
            "format": CACHE_FORMAT,
            "class_names": json.dumps(class_names),
            "note": split.note,
            "labels_crc32": f"{zlib.crc32(labels):08x}",
            "tail_crc32": f"{zlib.crc32(images.reshape(-1)[-TAIL_BYTES:]):08x}",
        },
        "labels": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
        "images": {"dtype": "U8", "shape": list(images.shape), "data_offsets": [8 * n, 8 * n + n_img]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    tmp = _temp_name(path)
    try:
        fd = _create_exclusive(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            f.write(labels)
            f.write(memoryview(np.ascontiguousarray(images).reshape(-1)))
            f.flush()
            os.fsync(f.fileno())  # data on disk before the rename publishes it
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise DataError(
            f"Could not write the decoded-image cache {path} ({err.strerror or err}). Free space there, "
            "or pass --cache-dir a writable directory with room for the decoded images."
        ) from None
    _fsync_dir(path.parent)


def _remove_stale_temps(path: Path, max_age_s: float = 86400):
    """Temporary files of a writer that died. Called under the lock of ``path``, so this key's temporary files
    are all stale; those of other keys only when a day old (their writers may be alive, unlocked)."""
    now = time.time()
    for tmp in path.parent.glob("*.tmp"):
        try:
            if tmp.name.startswith(path.name + ".") or now - tmp.stat().st_mtime > max_age_s:
                tmp.unlink()
        except OSError:
            pass


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
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _prepare(product: Path):
    """Before taking the lock for ``product``: its folder exists, and the identity of the error file a peer that
    fails on it would write ('.error' beside it; a new identity after the wait means that peer failed)."""
    try:
        product.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"Could not create the cache directory {product.parent} ({err.strerror or err}). Pass "
            "--cache-dir a directory this user can write."
        ) from None
    error_file = product.with_suffix(".error")
    return error_file, _identity(error_file)


def cached_split(path: Path, decode, what: str, class_names, is_main: bool) -> ImageSplit:
    """Read the split from ``path``, or decode it and write it there: one decoder per cache file."""
    say = console.say if is_main else (lambda *_: None)  # the process that decodes says what it does
    damage = None
    try:
        return _read_cache(path)
    except FileNotFoundError:
        pass
    except PermissionError as err:
        raise DataError(
            f"The decoded-image cache {path} is not readable by this user ({err.strerror}). Make it "
            "readable (a cache shared with a team wants a umask of 002 for whoever writes it), or pass "
            "--cache-dir a directory of your own."
        ) from None
    except _Damaged as err:
        damage = err
        say(f"The decoded-image cache {path} is damaged ({err}); decoding {what} again.")
    error_file, before = _prepare(path)

    def waiting(holder):
        say(f"waiting for {holder} to decode {what} into {path} ...")

    with _file_lock(path.with_suffix(".lock"), waiting) as locked:
        try:
            return _read_cache(path)  # a peer wrote it while this process waited
        except FileNotFoundError:
            pass
        except _Damaged as err:
            if damage is None:
                say(f"The decoded-image cache {path} is damaged ({err}); decoding {what} again.")
        if locked:
            after = _identity(error_file)
            if after is not None and after != before:  # the peer that held the lock failed on this split
                raise DataError(error_file.read_text())
            _remove_stale_temps(path)
        say(f"decoding {what} into {path} ...")
        try:
            split = decode()
            _write_cache(path, split, class_names)
        except DataError as err:
            if locked:  # tell the processes waiting on this lock, so they do not decode again to fail alike
                with contextlib.suppress(OSError):
                    write_atomic(error_file, str(err))
            raise
        with contextlib.suppress(OSError):
            error_file.unlink()
        try:
            return _read_cache(path)
        except (OSError, _Damaged) as err:
            raise DataError(
                f"The decoded-image cache {path} could not be read back right after writing it ({err}). "
                "Check the disk behind --cache-dir, or pass another --cache-dir."
            ) from None


def once(marker: Path, work, what: str, is_main: bool) -> None:
    """Run ``work()`` once per ``marker`` across the processes sharing this cache folder (the node's ranks, other
    jobs): the first takes the lock and works, the others wait, then find the marker; when the work fails with a
    DataError, the waiting ones raise the same message instead of doing it again. The marker is written after the
    work succeeds (a failed or killed check leaves none, so the next launch checks again)."""
    if marker.exists():
        return
    say = console.say if is_main else (lambda *_: None)
    error_file, before = _prepare(marker)
    with _file_lock(
        marker.with_suffix(".lock"), lambda holder: say(f"waiting for {holder} to finish {what} ...")
    ) as locked:
        if marker.exists():  # a peer did it while this process waited
            return
        after = _identity(error_file)
        if locked and after is not None and after != before:  # the peer that held the lock failed
            raise DataError(error_file.read_text())
        try:
            work()
        except DataError as err:
            if locked:
                with contextlib.suppress(OSError):
                    write_atomic(error_file, str(err))
            raise
        with contextlib.suppress(OSError):
            error_file.unlink()
        write_atomic(marker, "")


def source_state(name: str) -> str | None:
    """For a local dataset folder: a hash of every file's path, size, modification and change times (a file
    replaced with its old mtime kept, by ``cp -p`` or ``rsync``, still has a new ctime). None for a Hub id (only
    ``datasets`` can tell whether its copy changed) or a file that vanishes during the walk."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return None
    stats = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .cache
        for f in sorted(filenames):
            try:
                st = os.stat(os.path.join(dirpath, f))
            except OSError:
                return None
            stats.append((os.path.relpath(os.path.join(dirpath, f), path), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    key = json.dumps([CACHE_VERSION, str(path.resolve()), stats], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def source_index_path(cache_dir: Path, state: str | None, settings: dict) -> Path | None:
    """The cache entry naming the decoded split files of a local folder in ``state`` with these decoding settings."""
    if state is None:
        return None
    key = json.dumps([state, settings], sort_keys=True)
    return cache_dir / f"source-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_source_index(index: Path):
    """(splits, class names) when the index and every split file it names are intact, else None: the caller
    then takes the full path, which re-decodes what is missing or damaged."""
    try:
        entry = json.loads(index.read_text())
        return {k: _read_cache(index.parent / f) for k, f in entry["splits"].items()}, entry["class_names"]
    except (OSError, ValueError, KeyError, TypeError, _Damaged):
        return None


def write_source_index(index: Path, files: dict, class_names) -> None:
    with contextlib.suppress(OSError):  # only a shortcut: a failure costs the next run the full path
        write_atomic(index, json.dumps({"splits": files, "class_names": list(class_names)}))


def default_cache_dir() -> Path:
    return Path(os.environ.get("ACCELERATE_RECIPES_CACHE", Path.home() / ".cache" / "accelerate-recipes"))
