"""From a small-image dataset to uint8 tensors, read top to bottom: ``load_image_data`` finds the dataset (a Hub id, a
local clone of a Hub repo, or an image folder read by torchvision's ImageFolder rules, ``common.data.folders``), reads
its tables through ``datasets``, decodes each split once into uint8 images (N, C, H, W) and int64 labels kept in the
node's shared cache (``common.data.cache``), and holds out validation. The loaders at the end batch those tensors
(one index gather per batch, ``TensorImages.__getitems__``) on the host or the accelerator, where they are converted
and augmented (``common.data.augment``): no per-sample Python runs in the training loop.

Contract of ``load_image_data(cfg, default_dataset, is_main)``:
- Call it on EVERY process at once; it needs no collective and no main-first ordering. The first process (of all
  nodes sharing --cache-dir, default ``~/.cache/accelerate-recipes``) to take a split's file lock decodes it into a
  safetensors file keyed by the split's fingerprint and the decode settings; the others wait on that lock, not on a
  collective with a timeout, so a first decode may take as long as it needs. Then every process memory-maps the
  same file copy-on-write: the processes of a node share one copy of the images in the page cache.
- Only the process with ``is_main=True`` prints (``common.console.say``) and shows a progress bar.
- Bad data raises ``DataError`` (one paragraph naming the problem and the fix) on every process that meets it; a
  process that waited on a peer that failed raises the peer's message rather than decoding again.
- A damaged cache file (truncated by a crash, a full disk, a copy) is named in one line and decoded again. Cache,
  lock and temporary files follow the umask like the rest of a run.
- A held-out validation split is an index into the train images, not a copy (``ImageSplit.index``).

NOTE: the lock is ``fcntl.flock``. On a filesystem without it (Lustre mounted without ``flock``) every process
decodes for itself and the last rename wins: correct, only slower.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

from common.console import say
from common.data import cache, sources, table_copies, table_labels
from common.data.batches import loader_batch
from common.data.folders import FolderScan, FolderSplit
from common.data.pixels import at_size, unreadable_error, unreadable_reason
from common.data.splits import ImageData, ImageSplit, data_fingerprint, hold_out  # noqa: F401 - re-exported
from common.errors import DataError

VALIDATION_SPLITS = ("validation", "valid", "val")


def load_image_data(cfg, default_dataset: str, is_main: bool = True) -> ImageData:
    """Find, decode (or read from the cache), split. Call on every process at once (see the module docstring).

    ``cfg`` needs dataset, image_column, label_column, val_fraction, image_size, channels, cache_dir and seed."""
    name = cfg.dataset or default_dataset
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache.default_cache_dir()
    scan, skipped = sources.image_folder(name), ""
    if scan is not None:
        splits, class_names, skipped = _folder_splits(cfg, scan, name, cache_dir, is_main)
    else:
        splits, class_names = _table_splits(cfg, name, cache_dir, is_main)
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


def _folder_splits(cfg, scan: FolderScan, name: str, cache_dir: Path, is_main: bool):
    """An image folder's splits (``scan``, by ``common.data.folders``: torchvision's ImageFolder rules), each cached
    under a key made of every file's path, class, size and times, and knowing which file each row came from."""
    settings = {"channels": cfg.channels, "size": cfg.image_size}
    splits = {}
    for split_name, split in scan.splits.items():
        key = cache.cache_path(cache_dir, split.fingerprint, settings)
        what = f"the {split_name} split of {name}"
        splits[split_name] = _cached(cfg, key, split, None, split.labels, what, scan.class_names, is_main)
        splits[split_name].provenance = split.provenance()
    return splits, scan.class_names, scan.skipped_line()


def _table_splits(cfg, name: str, cache_dir: Path, is_main: bool):
    """A table dataset's splits (parquet, arrow, ...: a local repository or a Hub id), read through ``datasets``, their
    labels by the rule a folder's classes follow (``common.data.table_labels``). A local folder's identity (its
    resolved path and its tables' state, ``common.data.table_copies``) names ``datasets``' arrow copy of it and keys
    its decoded splits, and an index of them lets the next launch on the unchanged folder read the cache without
    importing ``datasets`` or scanning the tables."""
    folder = sources.local_folder(name)
    _, copy = table_copies.local_copy(cache_dir, folder)  # None for a Hub id
    identity = copy.name if copy else None
    asked = {"img": cfg.image_column, "lab": cfg.label_column, "channels": cfg.channels, "size": cfg.image_size}
    index = cache.source_index_path(cache_dir, identity, asked)
    known = cache.read_source_index(index) if index else None
    if known is not None:
        return known
    ds = sources.load_source(name, copy)
    from datasets import Image as ImageFeature

    img_col, lab_col = sources.pick_columns(ds["train"], cfg, name)
    used = [s for s in ds if s in ("train", "test", *VALIDATION_SPLITS)]
    for split_name in used:
        for col in (img_col, lab_col):
            if col not in ds[split_name].features:
                raise DataError(
                    f"The {split_name} split of {name!r} has no column {col!r}. Give every split the same columns."
                )
    columns = {k: ds[k].data.column(lab_col).to_pylist() for k in used}  # the labels only, not the images
    class_names, index_of = table_labels.class_names_of(ds["train"], lab_col, name, columns)
    for split_name in used:  # the labels' rules speak first, whatever the image column holds
        feature = ds[split_name].features[img_col]
        if not isinstance(feature, ImageFeature):
            raise DataError(
                f"Column {img_col!r} of the {split_name} split of {name!r} holds {feature}, not images. "
                "Pass --image-column with the column of images."
            )
    settings = {"img": img_col, "lab": lab_col, "channels": cfg.channels, "size": cfg.image_size, "source": identity}
    splits, files = {}, {}
    for split_name in used:
        split, labels = ds[split_name], columns[split_name]
        labels = labels if index_of is None else [index_of[v] for v in labels]
        files[split_name] = cache.cache_path(cache_dir, split._fingerprint, settings)
        what = f"the {split_name} split of {name!r}"
        splits[split_name] = _cached(cfg, files[split_name], split, img_col, labels, what, class_names, is_main)
    if index is not None and is_main:
        cache.write_source_index(index, {k: p.name for k, p in files.items()}, class_names)
    return splits, class_names


def _cached(cfg, key: Path, split, img_col, labels, what: str, class_names, is_main: bool) -> ImageSplit:
    """One split read from the cache file ``key``, decoded into it first when it holds none (one process decodes)."""
    progress = is_main and sys.stderr.isatty()

    def decode():
        return decode_split(split, img_col, labels, cfg.channels, cfg.image_size, what, progress=progress)

    return cache.cached_split(key, decode, f"{what} ({len(split)} images)", class_names, is_main)


def _items(split, img_col: str | None):
    """(where, how to open) for every image of a split: a ``FolderSplit`` or a ``datasets`` split, whose images are
    read undecoded (the bytes), so each bad one can be named, not only the first."""
    if isinstance(split, FolderSplit):
        for rel in split.files:
            path = str(split.base / rel)
            yield path, path
        return
    from datasets import Image as ImageFeature

    split = split.cast_column(img_col, ImageFeature(decode=False)).select_columns([img_col])
    for batch in split.iter(batch_size=2048):
        for item in batch[img_col]:
            item = item or {}
            src = item.get("path") or "<embedded image>"
            yield src, io.BytesIO(item["bytes"]) if item.get("bytes") else item.get("path")


def decode_split(split, img_col, labels, channels: int, image_size: int, what: str, progress: bool = False):
    """Decode one split (a ``FolderSplit`` or a ``datasets`` split) into an ``ImageSplit`` of uint8 images and
    ``labels``, each row's class index.

    Pixels are read by ``common.data.pixels`` (16-bit scaled, transparency flattened, EXIF orientation applied).
    The channel count is decided over the whole split: ``channels`` (1 or 3) when given, else RGB when any
    image is in colour (the grey ones are repeated to three channels, and the split's ``note`` says how many),
    else grey. Every file that can't be read is listed in one error, not only the first."""
    import numpy as np
    from PIL import Image
    from tqdm.auto import tqdm

    n = len(split)
    if n == 0:
        raise DataError(
            f"T{what[1:]} is empty. Add images to it, or remove it so the recipe holds out part of train instead."
        )
    forced = {1: "L", 3: "RGB"}.get(channels)
    arrays, bad, size = [], [], None
    bar = tqdm(total=n, desc=f"decoding {what}", unit="img", disable=not progress, leave=False)
    for src, fp in _items(split, img_col):
        bar.update(1)
        try:
            with Image.open(fp) as opened:
                opened.load()
                img, _ = at_size(opened, forced, (image_size, image_size) if image_size else None)
        except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, it is one bad file, named
            bad.append((src, unreadable_reason(err)))  # keep going: one run names every bad file of the split
            continue
        size = size or img.size
        if not image_size and img.size != size:  # without --image-size every image must have the first one's size
            raise DataError(
                f"The image {src} in {what} is {img.size[0]}x{img.size[1]} but earlier images are "
                f"{size[0]}x{size[1]}. Pass --image-size N to resize every image to NxN."
            )
        arrays.append(np.asarray(img, dtype=np.uint8))
    bar.close()
    if bad:
        raise unreadable_error(bad, n, what)
    grey = sum(a.ndim == 2 for a in arrays)
    note = ""
    if 0 < grey < len(arrays):  # colour and grey mixed, no --channels: the grey ones get three equal channels
        arrays = [np.repeat(a[:, :, None], 3, axis=2) if a.ndim == 2 else a for a in arrays]
        note = f"{grey} grey image(s) of {what} read as RGB"
    images = torch.from_numpy(np.stack(arrays))
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return ImageSplit(images.contiguous(), torch.tensor(labels, dtype=torch.int64), note=note)


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
