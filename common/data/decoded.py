"""Load an image-classification dataset with `datasets`, decode it once into uint8 tensors, cache it.

The decoded tensors ARE the training data: batches are formed by indexing them (one gather per
batch, see ``TensorImages.__getitems__``), travel to the device as uint8, and are converted and
augmented there (``common.data.augment``). No per-sample Python runs in the training loop.

Accepted sources (``--dataset``):
- a Hub id such as ``ylecun/mnist`` (needs network the first time, then the Hub cache serves it);
- a local clone of a Hub dataset repo (parquet files per split; the files themselves, so clone with
  git-lfs installed);
- an image folder: ``<dir>/<class>/.../*.png`` (optionally under ``train/``, ``validation/``, ``test/``), read
  by torchvision's ImageFolder rules (``common.data.folders``).

Contract of ``load_image_data(cfg, default_dataset, is_main)``:
- Call it on EVERY process at the same time; it needs no collective and no main-first ordering.
  Each decoded split is cached in one file under ``--cache-dir`` (default
  ``~/.cache/accelerate-recipes``), keyed by the split's fingerprint and the decode settings. The first
  process of a node (of all nodes, when they share the cache directory) to take the file lock
  ``<key>.lock`` decodes the split and writes the cache; the others wait on that lock, not on a
  collective with a timeout, so a first decode may take as long as it needs. Then every process
  memory-maps the same file, so the processes of a node share one copy of the images in the page cache
  instead of holding one copy each. The images are mapped copy-on-write: writing to them never touches
  the file.
- Only the process with ``is_main=True`` prints (``common.console.say``) and shows a progress bar.
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

import sys
from functools import partial
from pathlib import Path

import torch

from common.console import say
from common.data import cache, folders, sources, table_labels
from common.data.batches import loader_batch
from common.data.cache import default_cache_dir  # noqa: F401 - part of this module's interface
from common.data.splits import ImageData, ImageSplit, data_fingerprint, hold_out  # noqa: F401 - re-exported
from common.errors import DataError  # noqa: F401 - raised by everything here

VALIDATION_SPLITS = ("validation", "valid", "val")


def _label_map(what: str, class_names, str_map):
    """A split's label -> class index, refusing what the training classes do not hold."""
    num_classes = len(class_names)

    def label_map(value, src):
        if value is None:
            raise DataError(
                f"{what} has an image with no label ({src}). Fill in its label, or remove the row, and run again."
            )
        idx = str_map.get(value) if str_map is not None else value
        if idx is None or not isinstance(idx, int) or not 0 <= idx < num_classes:
            raise DataError(
                f"{what} has the label {value!r} (at {src}) outside the {num_classes} classes "
                f"found in train ({', '.join(class_names[:10])}{', ...' if num_classes > 10 else ''}). "
                "Make every split use the training classes, or fix the label column."
            )
        return idx

    return label_map


def _same_label(label, src):
    return label


def _decoder(cfg, split, columns: tuple, label_map, what: str, is_main: bool):
    """The decode of one split (``sources.decode_split``), for the cache to call when it holds no copy."""
    progress = is_main and sys.stderr.isatty()
    return partial(
        sources.decode_split, split, *columns, cfg.channels, cfg.image_size, label_map, what, progress=progress
    )


def _decode_folder(cfg, path: Path, name: str, cache_dir: Path, is_main: bool):
    """An image folder read by ``common.data.folders`` (torchvision's ImageFolder rules), each split decoded into (or
    read from) the cache under a key made of every file's path, class, size and times."""
    scan = folders.scan(path, name)
    settings = {"channels": cfg.channels, "size": cfg.image_size}
    splits = {}
    for split_name, split in scan.splits.items():
        what = f"the {split_name} split of {name}"
        decode = _decoder(cfg, split, (None, None), _same_label, what, is_main)

        splits[split_name] = cache.cached_split(
            cache.cache_path(cache_dir, split.fingerprint, settings),
            decode,
            f"the {split_name} split of {name} ({len(split)} images)",
            scan.class_names,
            is_main,
        )
        splits[split_name].provenance = split.provenance()
    return splits, scan.class_names, scan.skipped_line()


def _decode_source(cfg, name: str, cache_dir: Path, is_main: bool, state: str | None, index: Path | None):
    """Each split of a table dataset (parquet, arrow, ...: a local repository or a Hub id), read through ``datasets``
    and decoded into (or read from) the cache. A local folder's splits are keyed by its files' identity too."""
    ds = sources.load_source(name, cache_dir / "datasets" / state if state else None)
    train = ds["train"]
    img_col, lab_col = sources.pick_columns(train, cfg, name)
    class_names, str_map = table_labels.class_names_of(train, lab_col, name)

    settings = {"img": img_col, "lab": lab_col, "channels": cfg.channels, "size": cfg.image_size, "source": state}
    splits, files = {}, {}
    for split_name in ds:
        if split_name != "train" and split_name != "test" and split_name not in VALIDATION_SPLITS:
            continue
        split = ds[split_name]
        for col in (img_col, lab_col):
            if col not in split.features:
                raise DataError(
                    f"The {split_name} split of {name!r} has no column {col!r}. Give every split the same columns."
                )

        label_map = _label_map(f"The {split_name} split", class_names, str_map)
        decode = _decoder(cfg, split, (img_col, lab_col), label_map, f"the {split_name} split of {name!r}", is_main)

        files[split_name] = cache.cache_path(cache_dir, split._fingerprint, settings)
        splits[split_name] = cache.cached_split(
            files[split_name], decode, f"the {split_name} split of {name} ({len(split)} images)", class_names, is_main
        )

    if index is not None and is_main:
        cache.write_source_index(index, {k: p.name for k, p in files.items()}, class_names)
    return splits, class_names


def _same_channels(splits: dict, cfg, is_main: bool) -> dict:
    """Without --channels, a grey split beside colour ones is read as RGB too (one note says so)."""
    counts = {k: v.image_shape[0] for k, v in splits.items()}
    if cfg.channels or set(counts.values()) != {1, 3}:
        return splits
    grey = [k for k, c in counts.items() if c == 1]
    if is_main:
        say(
            f"NOTE: the {', '.join(grey)} split(s) hold only grey images and the others colour ones: read as RGB "
            "(pass --channels 1 to train on grey)."
        )
    out = dict(splits)
    for k in grey:
        s = splits[k]
        out[k] = ImageSplit(s.source_images.expand(-1, 3, -1, -1).contiguous(), s.source_labels, s.index, s.note)
        out[k].provenance = s.provenance
    return out


def load_image_data(cfg, default_dataset: str, is_main: bool = True) -> ImageData:
    """Load, decode (or read from cache), split. Call on every process at once (see the module docstring).

    ``cfg`` needs dataset, image_column, label_column, val_fraction, image_size, channels, cache_dir and seed."""
    name = cfg.dataset or default_dataset
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    path, skipped = sources.local_folder(name), ""
    if path is not None and folders.is_image_folder(path):
        splits, class_names, skipped = _decode_folder(cfg, path, name, cache_dir, is_main)
    else:
        state = cache.source_state(name)  # a local folder's files, hashed; None for a Hub id
        index = cache.source_index_path(
            cache_dir,
            state,
            {"img": cfg.image_column, "lab": cfg.label_column, "channels": cfg.channels, "size": cfg.image_size},
        )
        known = cache.read_source_index(index) if index else None
        if known is not None:  # a local folder decoded before and unchanged since: no `datasets` import, no scan
            splits, class_names = known
        else:
            splits, class_names = _decode_source(cfg, name, cache_dir, is_main, state, index)
    splits = _same_channels(splits, cfg, is_main)
    shapes = {k: v.image_shape for k, v in splits.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(
            f"The splits of {name!r} have different image shapes {shapes}. Pass --image-size N "
            "(and --channels) so every split is decoded to the same shape."
        )
    val_name = next((s for s in VALIDATION_SPLITS if s in splits), None)
    train_split, val_split = splits["train"], splits.get(val_name) if val_name else None
    if val_split is None and cfg.val_fraction > 0:
        train_split, val_split = hold_out(train_split, cfg.val_fraction, cfg.seed)
    notes = [n for n in [skipped] + [s.note for s in splits.values()] if n]
    return ImageData(
        train_split,
        val_split,
        splits.get("test"),
        class_names,
        name,
        "; ".join(notes),
        make_loader=split_loader,
        on_device=cfg.data_on_device,
    )


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
        pos = torch.as_tensor(indices)  # the sampler's positions, on the host
        if self.labels.device.type == "cuda":  # a copy from pinned memory is queued; from pageable memory it waits
            pos = pos.pin_memory()
        pos = pos.to(self.labels.device, non_blocking=True)
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


def make_loader(
    split: ImageSplit,
    batch_size: int,
    train: bool,
    device=None,
    pin: bool = False,
    flip_seed: int | None = None,
    drop_last: bool | None = None,
):
    dataset = TensorImages(split, flip_seed)
    if device is not None:
        dataset.to(device)
    # Its own generator: creating an iterator must not draw from the global RNG (dropout's stream),
    # or a run resumed mid-epoch would diverge from the uninterrupted one.
    drop_last = train if drop_last is None else drop_last
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        drop_last=drop_last,
        collate_fn=keep_batch,
        num_workers=0,
        pin_memory=pin and device is None,
        generator=torch.Generator().manual_seed(0),
    )


DEVICE_SHARE = 0.25  # the decoded data may take this share of the GPU's free memory; the rest is the model's


def place_on_device(cfg, accelerator, data: ImageData) -> str:
    """On a GPU, without an explicit --data-on-device: the decoded data goes on the GPU when it takes under a quarter
    of the free memory (a batch is then one on-device gather, no host-to-device copy per step), recorded in
    ``data.on_device``. Returns the note for the startup line ('' on a CPU, where host memory is the device's, and
    for photos, decoded per batch). CPU runs are unchanged."""
    shared = {  # the decoded splits' arrays (photos hold file names)
        id(s.source_images): s.source_images
        for s in (data.train, data.val, data.test)
        if s is not None and hasattr(s, "source_images")
    }
    if accelerator.device.type != "cuda" or "data_on_device" in getattr(cfg, "explicit", ()) or not shared:
        return ""
    need = sum(t.numel() * t.element_size() for t in shared.values())  # train and held-out share one source
    free, _ = torch.cuda.mem_get_info(accelerator.device)
    data.on_device = need < DEVICE_SHARE * free
    where = "on the GPU" if data.on_device else "in host memory (over a quarter of the GPU's free memory)"
    return f"data {where}: {need / 2**20:,.0f} MB of {free / 2**20:,.0f} MB free; --data-on-device false|true decides"


def split_loader(
    cfg, accelerator, split: ImageSplit | None, train=False, on_device=False, alternating_flip=False, drop_last=None
):
    """A recipe's DataLoader over a decoded split (None for none): the global --batch-size split over processes
    and accumulation steps for training, --eval-batch-size over processes for evaluation; on the accelerator
    when ``on_device`` (--data-on-device, or ``place_on_device``'s choice). ``alternating_flip``: airbench's flip,
    seeded by --seed (``TensorImages``)."""
    if split is None:
        return None
    n = accelerator.num_processes
    batch = loader_batch(cfg, n, train)
    return make_loader(
        split,
        batch,
        train,
        device=accelerator.device if on_device else None,
        pin=accelerator.device.type == "cuda",
        flip_seed=cfg.seed if alternating_flip else None,
        drop_last=drop_last,
    )
