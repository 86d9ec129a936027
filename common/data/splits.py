"""The decoded images of a dataset: ``ImageSplit`` (uint8 images and int64 labels, possibly an index into
shared tensors), ``ImageData`` (train / validation / test and the class names), the seeded hold-out of a
validation split, and the fingerprint a checkpoint records of what training and validation see."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import DataError


class Rows:
    """The rows of a split that may share their source with other splits (a held-out split is an index into
    train's): ``source_labels`` (N,) int64 and ``index`` (int64 positions into them, or None for all N), in order.
    Subclasses hold what the rows are (decoded images, or photo files) and make a copy with another index."""

    source_labels: torch.Tensor
    index: torch.Tensor | None
    # per source row, the file it was read from: (path in the dataset folder, size, mtime_ns); None for a table
    # dataset's rows. The files fingerprint covers it, so a renamed or swapped file is noticed.
    provenance: list | None = None

    def __len__(self):
        return (self.source_labels if self.index is None else self.index).numel()

    @property
    def labels(self) -> torch.Tensor:
        return self.source_labels if self.index is None else self.source_labels[self.index]

    def source_row(self, position: int) -> int:
        """The source row of this split's ``position``."""
        return int(position if self.index is None else self.index[position])

    def label_at(self, position: int) -> torch.Tensor:
        """One row's label, without gathering the others (``labels`` gathers them all)."""
        return self.source_labels[self.source_row(position)]

    def select(self, positions):
        """The rows at ``positions`` of this split, as a split sharing the same source (no copy)."""
        positions = torch.as_tensor(positions, dtype=torch.int64)
        out = self.with_index(positions if self.index is None else self.index[positions])
        out.provenance = self.provenance
        return out

    def row_files(self) -> list | None:
        """This split's rows' files, in order ((path, size, mtime_ns) each), or None."""
        if self.provenance is None:
            return None
        return self.provenance if self.index is None else [self.provenance[i] for i in self.index.tolist()]

    def with_index(self, index: torch.Tensor):
        raise NotImplementedError


class ImageSplit(Rows):
    """The images and labels of one split.

    ``source_images`` (N, C, H, W) uint8 and ``source_labels`` (N,) int64 may be shared: by the train and
    held-out splits, and (memory-mapped from the cache) by the processes of a node. ``index`` (int64, or
    None for all N rows) names this split's rows of them, in order.

    ``images`` and ``labels`` are this split's own rows: free when ``index`` is None, otherwise a gathered
    COPY made on each access (for a 54,000-image MNIST train split, 42 MB). Code that needs only some rows
    should call ``images_at`` (gathers only those); batches go through ``make_loader``/``TensorImages``,
    which gather per batch.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor | None = None, note: str = ""):
        self.source_images, self.source_labels = images, labels
        self.index = None if index is None else torch.as_tensor(index, dtype=torch.int64)
        self.note = note  # what decoding changed about the files (grey images read as RGB), for the startup line

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

    def with_index(self, index: torch.Tensor) -> ImageSplit:
        return ImageSplit(self.source_images, self.source_labels, index, self.note)

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
    note: str = ""  # files skipped and conversions made while reading the data, for the startup line
    # how a loader over one of its splits is made (common.data.decoded.split_loader, common.data.photos.photo_loader):
    # the reader that made the data says, so every recipe gets its loaders from run.loader(...) alike
    make_loader: Callable | None = None
    on_device: bool = False  # the decoded images were placed on the accelerator (common.data.decoded.place_on_device)
    damaged: object | None = None  # the photos a loader could not read (common.data.damaged.DamagedPhotos)
    listing: dict | None = field(default=None, repr=False)  # files_listing, made once
    listing_json: str | None = field(default=None, repr=False)  # ... and its JSON
    identity: str = ""  # a table dataset's files (size and times) or Hub fingerprint: in data_fingerprint

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.train.image_shape

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def data_fingerprint(data: ImageData) -> str:
    """A short hash of what training and validation see: the class names, the image shape, and each split's
    labels and held-out positions. A checkpoint records it; a resume on other data is refused."""
    h = hashlib.sha256(json.dumps([list(data.class_names), list(data.shape)]).encode())
    if data.identity:  # photos read from tables: their encoded bytes changed, the fingerprint changes
        h.update(data.identity.encode())
    for split in (data.train, data.val):
        if split is not None:
            h.update(len(split).to_bytes(8, "little"))
            h.update(split.labels.numpy().tobytes())
            if split.index is not None:
                h.update(split.index.numpy().tobytes())
    return h.hexdigest()[:16]


def files_listing(data: ImageData) -> dict | None:
    """Which file is at each row of training and validation, {"train": [[path, size, mtime_ns], ...], "val": ...}
    (None for a table dataset): what a run records, so a changed folder can be named file by file. Size and
    modification time are the identity a copy with ``cp -p`` or ``rsync -a`` keeps (the change time is not)."""
    if data.train.provenance is None:
        return None
    if data.listing is None:  # once per data: a million rows take a second (checkpoints and the model card ask)
        data.listing = {k: s.row_files() for k, s in (("train", data.train), ("val", data.val)) if s is not None}
    return data.listing  # rows are tuples: json writes them as the lists it reads back


def files_listing_json(data: ImageData) -> str | None:
    """``files_listing`` as the JSON a run records (``DATA_FILES``), made once per data."""
    if data.listing_json is None and files_listing(data) is not None:
        data.listing_json = json.dumps(data.listing)
    return data.listing_json


def files_fingerprint(data: ImageData) -> str | None:
    """A short hash of ``files_listing``: a renamed, swapped or replaced file changes it."""
    text = files_listing_json(data)
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


DATA_FILES = "data_files.json"  # a run's files_listing, in its run directory


def recorded_files_changed(run_dir, data: ImageData) -> str:
    """Where the data's files differ from the run's recorded listing (``DATA_FILES`` in ``run_dir``), or ''."""
    from pathlib import Path

    try:
        recorded = json.loads((Path(run_dir) / DATA_FILES).read_text())
    except (OSError, ValueError):
        return ""
    return files_changed(recorded, data) if isinstance(recorded, dict) else ""


def files_changed(recorded: dict, data: ImageData, shown: int = 5) -> str:
    """'' or where the files differ from ``recorded`` (a ``files_listing``), first ``shown`` rows named."""
    now, diffs = files_listing(data) or {}, []
    for split in ("train", "val"):
        old, new = recorded.get(split) or [], now.get(split) or []
        for i in range(max(len(old), len(new))):
            a, b = (old[i] if i < len(old) else None), (list(new[i]) if i < len(new) else None)
            if a == b:
                continue
            if a and b and a[0] == b[0]:
                diffs.append(f"{split} row {i}: {b[0]} is another file now (its size or modification time changed)")
            else:
                diffs.append(f"{split} row {i}: {b[0] if b else '(no file)'} (was {a[0] if a else 'no file'})")
    if not diffs:
        return ""
    return f"{len(diffs)} row(s) differ, e.g. {'; '.join(diffs[:shown])}"


def data_record(data: ImageData) -> dict:
    """What a model card records of the data: the fingerprints and each split's size."""
    sizes = {
        k: len(v) if v is not None else 0 for k, v in (("train", data.train), ("val", data.val), ("test", data.test))
    }
    files = files_fingerprint(data)
    return {"fingerprint": data_fingerprint(data), **({"files": files} if files else {}), **sizes}


def hold_out(split: ImageSplit, fraction: float, seed: int) -> tuple[ImageSplit, ImageSplit]:
    """A fixed, seeded random fraction of ``split`` becomes validation; the same for every process. Both
    results index ``split``'s images (no copy of them is made). Every class keeps at least one training image: a
    class the draw would put wholly into validation (a class of one image, say) gets its first drawn image back, so
    the model is never scored on a class it had no image of."""
    n = len(split)
    n_val = max(1, int(round(n * fraction)))
    if n_val >= n:
        raise DataError(
            f"Holding out {fraction:.0%} of a {n}-image train split leaves nothing to train on. "
            "Lower --val-fraction or add images."
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_pos, train_pos = perm[:n_val], perm[n_val:]
    labels = split.labels.long()  # (a split of your own may hold another integer type)
    val_labels = labels[val_pos]
    in_train = torch.zeros(int(labels.max()) + 1, dtype=torch.bool)
    in_train[labels[train_pos]] = True
    missing = (~in_train[val_labels]).nonzero().flatten()  # val positions of classes with no training image
    if missing.numel():
        _, first = np.unique(val_labels[missing].numpy(), return_index=True)  # each class's first drawn image back
        back = missing[torch.from_numpy(first)]
        keep = torch.ones(n_val, dtype=torch.bool)
        keep[back] = False
        if not keep.any():
            raise DataError(
                f"Every image --val-fraction {fraction:g} would hold out is its class's only one in the {n}-image "
                "train split, so nothing is left to validate on without leaving a class untrained. Add images, "
                "or give a validation split of your own."
            )
        train_pos, val_pos = torch.cat([train_pos, val_pos[back]]), val_pos[keep]
    return split.select(train_pos.sort().values), split.select(val_pos.sort().values)
