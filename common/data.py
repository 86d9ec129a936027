"""Load an image-classification dataset with `datasets`, decode it once into uint8 tensors, cache it.

The decoded tensors ARE the training data: batches are formed by indexing them (one gather per
batch, see ``TensorImages.__getitems__``), travel to the device as uint8, and are converted and
augmented there (``common.augment``). No per-sample Python runs in the training loop.

Accepted sources (``--dataset``):
- a Hub id such as ``ylecun/mnist`` (needs network the first time, then the Hub cache serves it);
- a local clone of a Hub dataset repo (parquet files per split; the files themselves, so clone with
  git-lfs installed);
- an image folder: ``<dir>/<class>/*.png`` (optionally under ``train/``, ``validation/``, ``test/``).

Contract of ``load_image_data(cfg, default_dataset, is_main, log)``:
- Call it on EVERY process at the same time; it needs no collective and no main-first ordering.
  Each decoded split is cached in one file under ``--cache-dir`` (default
  ``~/.cache/accelerate-recipes``), keyed by the split's fingerprint and the decode settings. The first
  process of a node (of all nodes, when they share the cache directory) to take the file lock
  ``<key>.lock`` decodes the split and writes the cache; the others wait on that lock, not on a
  collective with a timeout, so a first decode may take as long as it needs. Then every process
  memory-maps the same file, so the processes of a node share one copy of the images in the page cache
  instead of holding one copy each. The images are mapped copy-on-write: writing to them never touches
  the file.
- Only the process with ``is_main=True`` prints (through ``log``) and shows a progress bar.
- Bad data raises ``common.errors.DataError`` (one paragraph naming the problem and the fix) on every
  process that meets it; a process that waited on a peer that failed raises the peer's message rather
  than decoding again.
- A cache file is written to a temporary name, fsynced and renamed, so it is complete or absent; one that
  is damaged anyway (truncated by a crash, a full disk, a copy) is detected, reported in one line naming
  it, and decoded again. Cache, lock and temporary files follow the umask like the rest of a run. The
  cache files are safetensors files (``images`` uint8 N x C x H x W, ``labels`` int64 N).
- A held-out validation split is an index into the train images, not a copy (``ImageSplit.index``).

NOTE: the lock is ``fcntl.flock``. On a filesystem without it (Lustre mounted without ``flock``)
every process decodes for itself and the last rename wins: correct, only slower.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import socket
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from common.errors import DataError

CACHE_VERSION = "2"  # 2: images memory-mapped from a checked safetensors layout (labels first)
CACHE_FORMAT = "accelerate-recipes-decoded/2"
IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
VALIDATION_SPLITS = ("validation", "valid", "val")
LFS_POINTER = b"version https://git-lfs.github.com/spec"
MAX_BAD_IMAGES_SHOWN = 5


class ImageSplit:
    """The images and labels of one split.

    ``source_images`` (N, C, H, W) uint8 and ``source_labels`` (N,) int64 may be shared: by the train and
    held-out splits, and (memory-mapped from the cache) by the processes of a node. ``index`` (int64, or
    None for all N rows) names this split's rows of them, in order.

    ``images`` and ``labels`` are this split's own rows: free when ``index`` is None, otherwise a gathered
    COPY made on each access (for a 54,000-image MNIST train split, 42 MB). Code that needs only some rows
    should call ``images_at`` (gathers only those); batches go through ``make_loader``/``TensorImages``,
    which gather per batch.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor | None = None):
        self.source_images, self.source_labels = images, labels
        self.index = None if index is None else torch.as_tensor(index, dtype=torch.int64)

    def __len__(self):
        return (self.source_labels if self.index is None else self.index).numel()

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.source_images.shape[1:])

    def images_at(self, positions) -> torch.Tensor:
        """Images at ``positions`` (an int, slice or index tensor into this split); a slice of an unindexed
        split is a view, everything else one gather."""
        return self.source_images[positions if self.index is None else self.index[positions]]

    @property
    def images(self) -> torch.Tensor:
        return self.source_images if self.index is None else self.source_images[self.index]

    @property
    def labels(self) -> torch.Tensor:
        return self.source_labels if self.index is None else self.source_labels[self.index]

    def select(self, positions: torch.Tensor) -> "ImageSplit":
        """The rows at ``positions`` of this split, as a split sharing the same source tensors (no copy)."""
        positions = torch.as_tensor(positions, dtype=torch.int64)
        return ImageSplit(self.source_images, self.source_labels,
                          positions if self.index is None else self.index[positions])

    def __repr__(self):
        rows = "indexed" if self.index is not None else "all rows"
        return f"ImageSplit({len(self)} images of {self.image_shape}, {rows})"


@dataclass
class ImageData:
    train: ImageSplit
    val: ImageSplit | None
    test: ImageSplit | None
    class_names: list[str]
    source: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.train.image_shape

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


# --- loading -------------------------------------------------------------------------------------

def _hub_reachable(timeout: float = 5.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _go_offline():
    """Make datasets read only its local cache (its own retries would take far over 30 s)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _image_extensions() -> set[str]:
    """The file endings datasets' image-folder loader reads (Pillow's formats)."""
    try:
        from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

        return {e.lower() for e in ImageFolder.EXTENSIONS}
    except Exception:  # an older or newer datasets layout: the common ones
        return {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


TABLE_ENDINGS = {".parquet", ".arrow", ".csv", ".tsv", ".json", ".jsonl"}
EXTENSIONS_SHOWN = ".png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff and the other formats Pillow reads"


def _survey(root: Path, limit: int = 200_000):
    """What a local dataset folder holds: file endings counted, and git-lfs pointer files (the text stubs a
    clone made without git-lfs leaves instead of the data). Walks the tree, so only called on error paths."""
    endings, pointers, seen = Counter(), [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache
        for fname in filenames:
            if fname.startswith("."):
                continue
            seen += 1
            if seen > limit:
                return endings, pointers
            p = Path(dirpath) / fname
            endings[p.suffix.lower() or "(no ending)"] += 1
            try:
                if p.stat().st_size < 1024:  # pointer files are ~130 bytes
                    with open(p, "rb") as f:
                        if f.read(len(LFS_POINTER)) == LFS_POINTER:
                            pointers.append(p)
            except OSError:
                pass
    return endings, pointers


def _lfs_error(name: str, pointers) -> DataError:
    shown = ", ".join(str(p) for p in pointers[:3]) + (", ..." if len(pointers) > 3 else "")
    return DataError(
        f"{len(pointers)} file(s) in {name!r} are git-lfs pointer files, not data ({shown}): the repository was "
        "cloned without git-lfs, which leaves a small text stub in place of each parquet file. Install git-lfs "
        "(e.g. `apt install git-lfs` or `brew install git-lfs`), then run `git lfs install` and `git lfs pull` "
        "inside the clone, and run again.")


def _no_images_error(name: str, endings: Counter) -> DataError:
    found = ", ".join(f"{n} {e}" for e, n in endings.most_common(5)) or "no files at all"
    return DataError(
        f"No images were found in {name!r} (found: {found}). The image-folder layout reads files ending "
        f"{EXTENSIONS_SHOWN}, one sub-folder per class ({name}/<class>/<image>). Put the images there, or pass "
        "--dataset a directory with the dataset's parquet files.")


def load_source(name: str):
    """Return a ``datasets.DatasetDict`` for a local directory or a Hub id, or raise DataError."""
    looks_local = name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1] \
        or Path(name).expanduser().exists()
    path = Path(name).expanduser()
    if looks_local and not path.exists():
        raise DataError(
            f"The dataset path {name!r} does not exist. Pass --dataset a directory that holds the dataset "
            "(a clone of the Hub repo with its parquet files, or an image folder with one sub-folder per "
            "class), or a Hub id such as ylecun/mnist on a machine with network access.")
    if path.exists():
        if not path.is_dir():
            raise DataError(f"The dataset path {name!r} is a file, not a directory. Pass --dataset the folder "
                            "that holds the parquet files or the class sub-folders.")
        if not os.access(path, os.R_OK | os.X_OK):
            raise DataError(f"The dataset directory {name!r} is not readable by this user. Fix its permissions "
                            "(e.g. chmod -R u+rX) or copy it somewhere readable.")
    elif not _hub_reachable():
        _go_offline()

    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(str(path) if path.exists() else name)
    except Exception as err:  # datasets raises many types; all mean "could not load"
        if "corresponds to no data" in str(err):  # datasets' wording for a split with no rows
            split = str(err).split('"')[1] if '"' in str(err) else "a"
            raise DataError(f"The {split} split of {name!r} is empty. Add images to it, or remove its files so the "
                            "recipe holds out part of train instead.") from None
        if path.exists():
            endings, pointers = _survey(path)
            if pointers:
                raise _lfs_error(name, pointers) from None
            if not any(e in TABLE_ENDINGS | _image_extensions() for e in endings):
                raise _no_images_error(name, endings) from None
            raise DataError(
                f"datasets could not read {name!r}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                "Pass a directory laid out like the Hub repo (data/train-*.parquet, ...) or an image folder "
                "with one sub-folder per class.") from None
        raise DataError(
            f"Could not load the Hub dataset {name!r}: the Hugging Face Hub is not reachable from this machine "
            "and the dataset is not in the local cache. On an offline machine, copy the dataset first "
            f"(e.g. `git clone https://huggingface.co/datasets/{name}` elsewhere) and pass --dataset "
            "<that directory>; or set HF_ENDPOINT to a reachable mirror.") from None
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({"train": ds})
    if "train" not in ds:
        raise DataError(f"The dataset {name!r} has no 'train' split (found: {', '.join(ds) or 'none'}). "
                        "Name the training files train-*.parquet or put the class folders under train/.")
    return ds


def _pick_column(features, wanted: str, candidates, kind: str, name: str) -> str:
    if wanted:
        if wanted not in features:
            raise DataError(f"The dataset {name!r} has no column {wanted!r} (columns: {', '.join(features)}). "
                            f"Pass --{kind}-column with one of those.")
        return wanted
    for col in candidates:
        if col in features:
            return col
    raise DataError(f"The dataset {name!r} has no {kind} column: looked for {', '.join(candidates)} among "
                    f"{', '.join(features)}. Pass --{kind}-column <name> to say which column holds the {kind}s.")


def _pick_columns(train, cfg, name: str) -> tuple[str, str]:
    """The image and label columns, with messages that name the layout fix for image folders."""
    path = Path(name).expanduser()
    builder = getattr(train.info, "builder_name", None)
    if not cfg.image_column and not any(c in train.features for c in IMAGE_COLUMNS) and path.is_dir():
        endings, pointers = _survey(path)
        if pointers:
            raise _lfs_error(name, pointers)
        if not any(e in _image_extensions() | TABLE_ENDINGS for e in endings):  # a table says "no column" below
            raise _no_images_error(name, endings)
    img_col = _pick_column(train.features, cfg.image_column, IMAGE_COLUMNS, "image", name)
    if builder == "imagefolder" and not cfg.label_column and not any(c in train.features for c in LABEL_COLUMNS):
        # datasets' image folder labels images by their parent folder, and only when there are >= 2 of them
        raise DataError(
            f"The images in {name!r} are not sorted into class folders, so they have no labels. Put the images "
            f"of each class in a sub-folder named after the class ({name}/<class>/<image>, at least two classes; "
            "optionally under train/, validation/ and test/), then run again.")
    lab_col = _pick_column(train.features, cfg.label_column, LABEL_COLUMNS, "label", name)
    return img_col, lab_col


# --- decoding ------------------------------------------------------------------------------------

def _decode_split(split, img_col: str, lab_col: str, channels: int, image_size: int, label_map, what: str,
                  progress: bool = False):
    import numpy as np
    from tqdm.auto import tqdm
    from datasets import Image as ImageFeature
    from PIL import Image, UnidentifiedImageError

    if not isinstance(split.features[img_col], ImageFeature):
        raise DataError(f"Column {img_col!r} of {what} holds {split.features[img_col]}, not images. "
                        "Pass --image-column with the column of images.")
    split = split.cast_column(img_col, ImageFeature(decode=False)).select_columns([img_col, lab_col])
    n = len(split)
    if n == 0:
        raise DataError(f"The {what} split is empty. Add images to it, or remove it so the recipe holds out "
                        "part of train instead.")
    arrays, labels, bad = [], [], []
    mode, size = None, None
    bar = tqdm(total=n, desc=f"decoding {what}", unit="img", disable=not progress, leave=False)
    for batch in split.iter(batch_size=2048):
        bar.update(len(batch[lab_col]))
        for item, label in zip(batch[img_col], batch[lab_col]):
            src = item.get("path") or "<embedded image>"
            try:
                img = Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"])
                img.load()
            except (UnidentifiedImageError, OSError, ValueError) as err:
                bad.append((src, err))  # keep going: one run names every bad file of the split
                continue
            if mode is None:
                gray = img.mode in ("1", "L", "LA", "I", "I;16", "F")
                mode = {1: "L", 3: "RGB"}.get(channels) or ("L" if gray else "RGB")
            if img.mode != mode:
                img = img.convert(mode)
            if image_size:
                if img.size != (image_size, image_size):
                    img = img.resize((image_size, image_size), Image.BILINEAR)
            elif size is None:
                size = img.size
            elif img.size != size:
                raise DataError(f"The image {src} in {what} is {img.size[0]}x{img.size[1]} but earlier images are "
                                f"{size[0]}x{size[1]}. Pass --image-size N to resize every image to NxN.")
            arrays.append(np.asarray(img, dtype=np.uint8))
            labels.append(label_map(label, src))
    bar.close()
    if bad:
        shown = "; ".join(f"{src} ({err})" for src, err in bad[:MAX_BAD_IMAGES_SHOWN])
        more = f"; and {len(bad) - MAX_BAD_IMAGES_SHOWN} more" if len(bad) > MAX_BAD_IMAGES_SHOWN else ""
        raise DataError(f"{len(bad)} of the {n} images in {what} could not be decoded: {shown}{more}. Remove or "
                        "replace those files and run again.")
    images = torch.from_numpy(np.stack(arrays))
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return ImageSplit(images.contiguous(), torch.tensor(labels, dtype=torch.int64))


def _class_names(train, lab_col: str):
    from datasets import ClassLabel

    feat = train.features[lab_col]
    if isinstance(feat, ClassLabel):
        return list(feat.names), None
    values = sorted(set(train[lab_col]))
    if all(isinstance(v, int) for v in values):
        if values[0] < 0:
            raise DataError(f"Label column {lab_col!r} holds negative labels ({values[0]}). Labels must be "
                            "0..num_classes-1 or class-name strings.")
        return [str(i) for i in range(values[-1] + 1)], None
    names = [str(v) for v in values]
    return names, {v: i for i, v in enumerate(values)}


# --- cache ---------------------------------------------------------------------------------------
# Layout: a safetensors file, labels (int64, 8-byte aligned after the padded header) then images (uint8),
# so the images can be memory-mapped at a known offset. The header's metadata holds CRC32s of the labels
# and of the images' last 64 KiB: with the exact file size they catch a truncated or zero-filled file
# without reading the whole file (a full checksum would cost every process a pass over the data each run).

TAIL_BYTES = 1 << 16
LOCK_WAIT_S = 4 * 3600  # how long a process waits for a peer to decode a split before it gives up
LOCK_POLL_S = 0.5


class _Damaged(Exception):
    """The cache file exists but cannot be trusted; the message says why."""


def _cache_path(cache_dir: Path, fingerprint: str, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps([CACHE_VERSION, fingerprint, settings], sort_keys=True).encode()).hexdigest()
    return cache_dir / f"{key[:32]}.safetensors"


def _read_cache(path: Path, mmap: bool = True) -> ImageSplit:
    """Open a cache file written by ``_write_cache``; FileNotFoundError if absent, _Damaged if not intact."""
    import numpy as np

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _Damaged(f"{size} bytes, shorter than a header")
        hlen = int.from_bytes(head, "little")
        if hlen > min(size - 8, 1 << 26):
            raise _Damaged(f"header of {hlen} bytes in a {size}-byte file")
        try:
            header = json.loads(f.read(hlen))
            meta = header["__metadata__"]
            assert meta["format"] == CACHE_FORMAT
            lab, img = header["labels"], header["images"]
            assert lab["dtype"] == "I64" and img["dtype"] == "U8" and len(img["shape"]) == 4
            n = img["shape"][0]
            n_img = n * img["shape"][1] * img["shape"][2] * img["shape"][3]
            assert lab["shape"] == [n] and lab["data_offsets"] == [0, 8 * n]
            assert img["data_offsets"] == [8 * n, 8 * n + n_img]
        except (ValueError, KeyError, TypeError, AssertionError):
            raise _Damaged("unreadable header") from None
        start = 8 + hlen
        if size != start + 8 * n + n_img:
            raise _Damaged(f"{size} bytes, expected {start + 8 * n + n_img}")
        labels = f.read(8 * n)
        f.seek(start + 8 * n + n_img - min(TAIL_BYTES, n_img))
        tail = f.read(TAIL_BYTES)
        if f"{zlib.crc32(labels):08x}" != meta["labels_crc32"] or f"{zlib.crc32(tail):08x}" != meta["tail_crc32"]:
            raise _Damaged("checksum mismatch")
        shape = tuple(img["shape"])
        # Map / read through the descriptor that was checked, not the name, which a peer may rename over.
        if mmap:
            # Copy-on-write mapping: pages are the page cache's, shared by every process of the node until one
            # writes to them (nothing here does: batches are gathered copies). NOTE: the file must never be
            # rewritten in place (a truncated mapped file faults its readers); writers rename a new file over it.
            images = np.memmap(f, dtype=np.uint8, mode="c", offset=start + 8 * n, shape=shape)
        else:
            f.seek(start + 8 * n)
            images = np.fromfile(f, dtype=np.uint8, count=n_img).reshape(shape)
    labels = torch.from_numpy(np.frombuffer(labels, dtype="<i8").astype(np.int64))
    return ImageSplit(torch.from_numpy(images), labels)


def _fsync_dir(directory: Path):
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


def _temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def _create_exclusive(tmp: Path) -> int:
    """A new file, never an existing one and never through a symlink (a link planted in a shared cache folder
    would otherwise redirect the write to another user's file). A leftover of this name (a dead writer with
    the same host and PID) is unlinked first; unlinking a symlink removes the link, not its target. Mode 0o666
    follows the umask like every other file of a run (mkstemp would force 0600)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def _write_cache(path: Path, split: ImageSplit, class_names):
    """Write to a temporary file, fsync, rename: a reader sees no file or the whole file, even after a crash."""
    import numpy as np

    images = split.images.contiguous().numpy()
    labels = split.labels.numpy().astype("<i8").tobytes()
    n, n_img = images.shape[0], images.size
    header = {
        "__metadata__": {"format": CACHE_FORMAT, "class_names": json.dumps(class_names),
                         "labels_crc32": f"{zlib.crc32(labels):08x}",
                         "tail_crc32": f"{zlib.crc32(images.reshape(-1)[-TAIL_BYTES:]):08x}"},
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
        raise DataError(f"Could not write the decoded-image cache {path} ({err.strerror or err}). Free space there, "
                        "or pass --cache-dir a writable directory with room for the decoded images.") from None
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
        raise DataError(f"Could not create {lock_path} ({err.strerror or err}). Pass --cache-dir a directory this "
                        "user can write, or fix the permissions of that one.") from None
    try:
        locked, deadline = True, time.time() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # a peer decodes: wait (a stop signal interrupts the wait, common.stopping)
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                if time.time() > deadline:
                    raise DataError(f"Gave up after {LOCK_WAIT_S // 60} minutes waiting for {holder} to decode into "
                                    f"the cache (it holds {lock_path}). If that process is gone (a machine that lost "
                                    "its connection to a network filesystem can hold a lock), delete the lock file "
                                    "and rerun, or pass --cache-dir a folder of your own.") from None
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


def _cached_split(path: Path, decode, what: str, class_names, is_main: bool, log, mmap: bool) -> ImageSplit:
    """Read the split from ``path``, or decode it and write it there: one decoder per cache file."""
    say = log if is_main else (lambda *_: None)
    damage = None
    try:
        return _read_cache(path, mmap)
    except FileNotFoundError:
        pass
    except PermissionError as err:
        raise DataError(f"The decoded-image cache {path} is not readable by this user ({err.strerror}). Make it "
                        "readable (a cache shared with a team wants a umask of 002 for whoever writes it), or pass "
                        "--cache-dir a directory of your own.") from None
    except _Damaged as err:
        damage = err
        say(f"The decoded-image cache {path} is damaged ({err}); decoding {what} again.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"Could not create the cache directory {path.parent} ({err.strerror or err}). Pass "
                        "--cache-dir a directory this user can write.") from None
    error_file = path.with_suffix(".error")
    before = _identity(error_file)

    def waiting(holder):
        say(f"waiting for {holder} to decode {what} into {path} ...")

    with _file_lock(path.with_suffix(".lock"), waiting) as locked:
        try:
            return _read_cache(path, mmap)  # a peer wrote it while this process waited
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
                    tmp = _temp_name(error_file)
                    fd = _create_exclusive(tmp)
                    with os.fdopen(fd, "w") as f:
                        f.write(str(err))
                    os.replace(tmp, error_file)
            raise
        with contextlib.suppress(OSError):
            error_file.unlink()
        if not mmap:
            return split
        try:
            return _read_cache(path, mmap)
        except (OSError, _Damaged) as err:
            raise DataError(f"The decoded-image cache {path} could not be read back right after writing it ({err}). "
                            "Check the disk behind --cache-dir, or pass another --cache-dir.") from None


def _source_index_path(cache_dir: Path, name: str, settings: dict) -> Path | None:
    """For a local dataset folder: a cache entry keyed by every file's path, size and modification time and
    by the decoding settings, naming the decoded split files. None for a Hub id (only ``datasets`` can tell
    whether its copy changed)."""
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
            stats.append((os.path.relpath(os.path.join(dirpath, f), path), st.st_size, st.st_mtime_ns))
    key = json.dumps([CACHE_VERSION, str(path.resolve()), stats, settings], sort_keys=True)
    return cache_dir / f"source-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _read_source_index(index: Path, mmap: bool):
    """(splits, class names) when the index and every split file it names are intact, else None: the caller
    then takes the full path, which re-decodes what is missing or damaged."""
    try:
        entry = json.loads(index.read_text())
        return {k: _read_cache(index.parent / f, mmap) for k, f in entry["splits"].items()}, entry["class_names"]
    except (OSError, ValueError, KeyError, TypeError, _Damaged):
        return None


def _write_source_index(index: Path, files: dict, class_names) -> None:
    tmp = _temp_name(index)
    with contextlib.suppress(OSError):  # only a shortcut: a failure costs the next run the full path
        with os.fdopen(_create_exclusive(tmp), "w") as f:
            json.dump({"splits": files, "class_names": list(class_names)}, f)
        os.replace(tmp, index)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ACCELERATE_RECIPES_CACHE", Path.home() / ".cache" / "accelerate-recipes"))


def _decode_source(cfg, name: str, cache_dir: Path, is_main: bool, log, mmap: bool, index: Path | None):
    """Each split of the source, read through ``datasets`` and decoded into (or read from) the cache."""
    ds = load_source(name)
    train = ds["train"]
    img_col, lab_col = _pick_columns(train, cfg, name)
    class_names, str_map = _class_names(train, lab_col)
    num_classes = len(class_names)

    def label_map_for(what):
        def label_map(value, src):
            idx = str_map.get(value) if str_map is not None else value
            if idx is None or not isinstance(idx, int) or not 0 <= idx < num_classes:
                raise DataError(f"{what} has the label {value!r} (at {src}) outside the {num_classes} classes "
                                f"found in train ({', '.join(class_names[:10])}{', ...' if num_classes > 10 else ''}). "
                                "Make every split use the training classes, or fix the label column.")
            return idx
        return label_map

    settings = {"img": img_col, "lab": lab_col, "channels": cfg.channels, "size": cfg.image_size}
    splits, files = {}, {}
    for split_name in ds:
        if split_name != "train" and split_name != "test" and split_name not in VALIDATION_SPLITS:
            continue
        split = ds[split_name]
        for col in (img_col, lab_col):
            if col not in split.features:
                raise DataError(f"The {split_name} split of {name!r} has no column {col!r}. Give every split the "
                                "same columns.")

        def decode(split=split, split_name=split_name):
            return _decode_split(split, img_col, lab_col, cfg.channels, cfg.image_size,
                                 label_map_for(f"The {split_name} split"), f"the {split_name} split of {name!r}",
                                 progress=is_main and sys.stderr.isatty())

        files[split_name] = _cache_path(cache_dir, split._fingerprint, settings)
        splits[split_name] = _cached_split(files[split_name], decode,
                                           f"the {split_name} split of {name} ({len(split)} images)", class_names,
                                           is_main, log, mmap)

    if index is not None and is_main:
        _write_source_index(index, {k: p.name for k, p in files.items()}, class_names)
    return splits, class_names


def load_image_data(cfg, default_dataset: str, is_main: bool = True, log=print, *, mmap: bool = True) -> ImageData:
    """Load, decode (or read from cache), split. Call on every process at once (see the module docstring).

    ``cfg`` needs dataset, image_column, label_column, val_fraction, image_size, channels, cache_dir and seed.
    ``mmap=False`` reads the cached images into this process's own memory instead of mapping them (the
    behaviour before memory-mapping; kept for measuring it)."""
    name = cfg.dataset or default_dataset
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    index = _source_index_path(cache_dir, name, {"img": cfg.image_column, "lab": cfg.label_column,
                                                 "channels": cfg.channels, "size": cfg.image_size})
    known = _read_source_index(index, mmap) if index else None
    if known is not None:  # a local folder decoded before and unchanged since: no `datasets` import, no scan
        splits, class_names = known
    else:
        splits, class_names = _decode_source(cfg, name, cache_dir, is_main, log, mmap, index)
    shapes = {k: v.image_shape for k, v in splits.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(f"The splits of {name!r} have different image shapes {shapes}. Pass --image-size N "
                        "(and --channels) so every split is decoded to the same shape.")
    val_name = next((s for s in VALIDATION_SPLITS if s in splits), None)
    train_split, val_split = splits["train"], splits.get(val_name) if val_name else None
    if val_split is None and cfg.val_fraction > 0:
        train_split, val_split = hold_out(train_split, cfg.val_fraction, cfg.seed)
    return ImageData(train_split, val_split, splits.get("test"), class_names, name)


def data_fingerprint(data: "ImageData") -> str:
    """A short hash of what training and validation see: the class names, the image shape, and each split's
    labels and held-out positions. A checkpoint records it; a resume on other data is refused."""
    h = hashlib.sha256(json.dumps([list(data.class_names), list(data.shape)]).encode())
    for split in (data.train, data.val):
        if split is not None:
            h.update(len(split).to_bytes(8, "little"))
            h.update(split.labels.numpy().tobytes())
            if split.index is not None:
                h.update(split.index.numpy().tobytes())
    return h.hexdigest()[:16]


def hold_out(split: ImageSplit, fraction: float, seed: int) -> tuple[ImageSplit, ImageSplit]:
    """A fixed, seeded random fraction of ``split`` becomes validation; the same for every process. Both
    results index ``split``'s images (no copy of them is made)."""
    n = len(split)
    n_val = max(1, int(round(n * fraction)))
    if n_val >= n:
        raise DataError(f"Holding out {fraction:.0%} of a {n}-image train split leaves nothing to train on. "
                        "Lower --val-fraction or add images.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
    return split.select(train_idx), split.select(val_idx)


# --- batching ------------------------------------------------------------------------------------

class TensorImages(torch.utils.data.Dataset):
    """A dataset over decoded tensors. ``__getitems__`` lets the DataLoader fetch a whole batch with one
    index gather instead of one Python call per sample. An indexed split is gathered through its index,
    so the shared (memory-mapped) source is never copied whole.

    ``flip_seed``: airbench's alternating flip. Each image gets one random flip bit, drawn once from the
    seed; in even epochs an image is shown flipped when its bit is set, in odd epochs when it is not. Every
    image is seen both ways within two epochs, which i.i.d. random flips do not guarantee (the paper's
    ablation: about -9% epochs to 94%). The flip depends on the image's index and the epoch only, so a
    resumed run shows exactly the same pixels."""

    def __init__(self, split: ImageSplit, flip_seed: int | None = None):
        self.images, self.labels, self.index = split.source_images, split.source_labels, split.index
        self.epoch, self.flip_bits = 0, None
        if flip_seed is not None:
            self.flip_bits = torch.rand(len(self), generator=torch.Generator().manual_seed(flip_seed)) < 0.5

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return (self.labels if self.index is None else self.index).numel()

    def __getitem__(self, i):
        images, labels = self.__getitems__([i])
        return images[0], labels[0]

    def __getitems__(self, indices):
        pos = torch.as_tensor(indices).to(self.labels.device)
        idx = pos if self.index is None else self.index[pos]
        images, labels = self.images[idx], self.labels[idx]
        if self.flip_bits is not None:
            flip = self.flip_bits[pos] ^ bool(self.epoch % 2)
            images = torch.where(flip.view(-1, 1, 1, 1), images.flip(3), images)
        return images, labels

    def to(self, device):
        """Move this split's rows (only those: not the whole shared source) to ``device``."""
        if self.index is not None:
            self.images, self.labels, self.index = self.images[self.index], self.labels[self.index], None
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        if self.flip_bits is not None:
            self.flip_bits = self.flip_bits.to(device)
        return self


def keep_batch(batch):
    """collate_fn for ``TensorImages``: the batch is already a (images, labels) pair."""
    return batch


def make_loader(split: ImageSplit, batch_size: int, train: bool, device=None, pin: bool = False,
                flip_seed: int | None = None):
    dataset = TensorImages(split, flip_seed)
    if device is not None:
        dataset.to(device)
    # Its own generator: creating an iterator must not draw from the global RNG (dropout's stream),
    # or a run resumed mid-epoch would diverge from the uninterrupted one.
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train,
                                       collate_fn=keep_batch, num_workers=0, pin_memory=pin and device is None,
                                       generator=torch.Generator().manual_seed(0))
