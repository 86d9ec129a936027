"""Photos of any size and mode, for fine-tuning (``recipes/finetune_folder.py``): read from their files per batch,
in DataLoader workers, never held decoded.

Why not the decoded cache of ``common.data.decoded``: it stores every image at one size, which for photos means a squash
(aspect ratio lost) and a cache many times the JPEGs' size (ImageNet at 224 px: ~190 GB). Here a split is a list of
files and labels; memory grows with the number of file names, not pixels, and nothing is written to disk.

- Training: the recipe's own per-image transform (``train_view``: recipes/finetune_folder.py's random resized
  crop and flip, and what else it adds), run on uint8 tensors in the worker. Each image's draws are seeded by
  (seed, epoch, image), so a run resumed mid-epoch, or run with another number of workers, sees exactly the same
  pixels.
- Evaluation and ``predict``: the shorter side resized to ``image_size / 0.875`` and a centre crop of
  ``image_size`` (torchvision's 256 -> 224), never a squash.
- JPEGs are decoded at a reduced scale when the photo is much larger than needed (Pillow's ``draft``: the DCT
  itself skips the detail), so a 12-megapixel photo costs little more than a small one.
- Pixels are read by ``common.data.pixels`` (EXIF orientation, 16-bit, transparency) and always as RGB: the torchvision
  models take three channels.
"""

from __future__ import annotations

import os
import random

import torch

from common.data.augment import channel_stats
from common.data.batches import loader_batch
from common.data.damaged import SKIPPED, collate
from common.data.pixels import read_rgb, unreadable_reason
from common.data.splits import Rows
from common.errors import DataError

EVAL_RATIO = 0.875  # the centre crop's share of the resized shorter side (torchvision: 224 of 256)
STAND_IN_TRIES = 32  # photos drawn to stand in for a damaged one before the split is called unreadable


def resize_side(image_size: int) -> int:
    return int(round(image_size / EVAL_RATIO))


def eval_view(image: torch.Tensor, image_size: int) -> torch.Tensor:
    """Shorter side to ``resize_side(image_size)``, then the centre ``image_size`` square."""
    from torchvision.transforms.v2 import functional as TF

    image = TF.resize(image, [resize_side(image_size)], antialias=True)
    return TF.center_crop(image, [image_size, image_size])


class Paths:
    """Many file paths as one pyarrow binary array (one buffer and its offsets): no Python object per path (a loader
    worker copies no reference counts), a quarter of the memory of a numpy string array. ``prefix`` + the i-th name
    is a path."""

    def __init__(self, prefix: str, names: list[str]):
        import pyarrow as pa

        self.prefix = prefix
        self.names = pa.array([n.encode("utf-8", "surrogateescape") for n in names], pa.large_binary())

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i: int) -> str:
        return self.prefix + self.names[i].as_py().decode("utf-8", "surrogateescape")


class PhotoSplit(Rows):
    """The files and labels of one split, with the interface of ``common.data.splits.ImageSplit`` that the run needs
    (length, labels and ``select`` for the hold-out from ``Rows``; ``images_at`` for the misclassified-image grid)."""

    def __init__(self, files, labels: torch.Tensor, image_size: int, index: torch.Tensor | None = None, note=""):
        self.files = files if isinstance(files, Paths) else Paths("", list(files))  # one buffer, not N strings
        self.source_labels, self.image_size, self.note = labels, image_size, note
        self.index = None if index is None else torch.as_tensor(index, dtype=torch.int64)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    @property
    def preprocess(self) -> dict:
        """What model.json records for predict and export: resize the shorter side, then centre-crop."""
        return {"resize_shorter": resize_side(self.image_size), "center_crop": self.image_size}

    def file_at(self, position: int) -> str:
        """Where the photo at ``position`` is, for messages: its path."""
        return self.source_at(position)

    def source_at(self, position: int):
        """What ``open_rgb`` opens for the photo at ``position``: its path."""
        return str(self.files[self.source_row(position)])

    def try_read(self, position: int, min_side: int) -> tuple[torch.Tensor | None, tuple[str, str] | None]:
        """(the photo, None), or (None, (its file, why it could not be read)) for a damaged one."""
        try:
            return read_rgb(self.source_at(position), min_side), None
        except DataError:  # a table row naming a file outside the dataset, or no image: never a photo to skip
            raise
        except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, name it
            return None, (self.file_at(position), unreadable_reason(err))

    def with_index(self, index: torch.Tensor) -> PhotoSplit:
        return PhotoSplit(self.files, self.source_labels, self.image_size, index, self.note)

    def images_at(self, positions) -> torch.Tensor:
        """The evaluation views of the images at ``positions`` (an index tensor, list or slice), decoded now; a damaged
        photo's view is black (the misclassified-image grid)."""
        if isinstance(positions, slice):
            positions = range(*positions.indices(len(self)))
        black = torch.zeros(self.image_shape, dtype=torch.uint8)
        views = [black if v is None else v for v in map(self.eval_view_at, map(int, positions))]
        return torch.stack(views) if views else torch.zeros((0, *self.image_shape), dtype=torch.uint8)

    def eval_view_at(self, position: int) -> torch.Tensor | None:
        """The evaluation view of the photo at ``position``; None for a damaged one."""
        image, _ = self.try_read(position, resize_side(self.image_size))
        return None if image is None else eval_view(image, self.image_size)


class PhotoDataset(torch.utils.data.Dataset):
    """Per-image decoding and augmentation, run in the DataLoader's workers. ``sides``: progressive resizing, a
    function of the epoch giving its training crop side; ``train_view`` is then a function of that side giving the
    epoch's transform (else the transform itself, at the split's --image-size)."""

    def __init__(self, split: PhotoSplit, seed: int, train_view=None, sides=None):
        self.split, self.seed, self.views, self.sides = split, seed, train_view, sides
        # The epoch lives in shared memory: persistent DataLoader workers (kept across epochs) read the one the main
        # process set before the epoch's iterator sent them its first index.
        self.shared_epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.epoch = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:  # called before each epoch's iterator hands the workers an index
        self.shared_epoch.fill_(epoch)
        self.follow_epoch()

    def follow_epoch(self) -> None:
        """This process's copy of the epoch, its crop side and its transform, brought up to the shared epoch."""
        epoch = int(self.shared_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.side = self.sides(epoch) if self.sides else self.split.image_size
            self.train_view = self.views(self.side) if self.sides and self.views else self.views

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        """(image, label, None), or where the photo is damaged (``common.data.damaged``), (file, reason) third: in
        evaluation with a black image and the label ``SKIPPED``, in training with another photo of the split, drawn at
        random (seeded by the run's seed, the epoch and the photo), in its place."""
        size = self.split.image_size
        self.follow_epoch()
        if self.train_view is None:
            image, damaged = self.split.try_read(i, resize_side(size))
            if image is None:
                return torch.zeros(self.split.image_shape, dtype=torch.uint8), SKIPPED, damaged
            return eval_view(image, size), self.split.label_at(i), None
        key, side = (self.seed * 1_000_003 + self.epoch) * 1_000_033 + int(i), resize_side(max(size, self.side))
        image, damaged = self.split.try_read(i, side)
        j, draws = i, random.Random(key) if image is None else None  # a damaged photo's stand-in: drawn at random
        for _ in range(STAND_IN_TRIES if image is None else 0):  # (seeded: a resumed run draws the same one)
            j = draws.randrange(len(self.split))
            image, _ = self.split.try_read(j, side)
            if image is not None:
                break
        if image is None:
            raise DataError(
                f"{damaged[0]} could not be read ({damaged[1]}), nor could any of the {STAND_IN_TRIES} photos of the "
                "training split drawn at random to stand in for it: most of the split is unreadable. Check that the "
                "files are whole images Pillow reads (docs/data.md), and run again."
            )
        # torchvision's transforms draw from torch's global generator: seed it per image, inside fork_rng so the
        # main process's own stream (dropout, the shuffle) is untouched when there are no workers
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(key)
            image = self.train_view(image)
        if image.shape != (3, self.side, self.side) or image.dtype != torch.uint8:
            epoch = f" (epoch {self.epoch + 1}'s crop side)" if self.side != size else ""
            raise DataError(
                f"The recipe's train_view made a {tuple(image.shape)} {image.dtype} image of "
                f"{self.split.file_at(j)}; the loader hands out (3, {self.side}, {self.side}) uint8 "
                f"images (--image-size {size}{epoch}), normalised on the device. End train_view with a "
                "crop or resize to that side and keep uint8 pixels."
            )
        return image, self.split.label_at(j), damaged


def photo_loader(
    cfg,
    accelerator,
    split: PhotoSplit | None,
    train=False,
    on_device=False,
    train_view=None,
    sides=None,
    drop_last=None,
):
    """A DataLoader decoding in ``--workers`` worker processes: the global --batch-size split over processes and
    accumulation steps for training, --eval-batch-size over processes for evaluation. ``train_view``: the recipe's
    per-image training transform (uint8 (3, H, W) in, (3, --image-size, --image-size) out), required for training;
    evaluation resizes the shorter side and centre-crops. ``sides``: progressive resizing (``PhotoDataset``): a
    function of the epoch giving its crop side, ``train_view`` then a function of the side giving the transform.
    ``on_device``: unused (photos are decoded on the host). A batch is ``(images, labels, damaged)``: ``damaged`` lists
    the photos skipped in it, ``(file, reason)`` each (``common.data.damaged``; ``run.batches`` and ``evaluate`` hand
    them to the run's tally and give the loop ``(images, labels)``)."""
    if split is None:
        return None
    if train and train_view is None:
        raise TypeError("a training photo loader needs the recipe's train_view (its per-image augmentation)")
    n = accelerator.num_processes
    batch = loader_batch(cfg, n, train)
    dataset = PhotoDataset(split, cfg.seed, train_view if train else None, sides if train else None)
    workers = cfg.workers
    if workers < 0:  # this process's share of the node's cores, less the one the training loop runs on
        local = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        workers = min(8, max(0, len(os.sched_getaffinity(0)) // max(1, local) - 1))
    # Training workers are kept across epochs (PhotoDataset reads the epoch from shared memory, so every epoch still
    # draws its own crops); evaluation's start for each evaluation. The loader's own generator keeps the shuffle off
    # the global RNG (exact resume).
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=train,
        drop_last=train if drop_last is None else drop_last,
        num_workers=workers,
        pin_memory=accelerator.device.type == "cuda",
        generator=torch.Generator().manual_seed(0),
        prefetch_factor=4 if workers else None,
        persistent_workers=bool(workers) and train,
        collate_fn=collate,
    )


def photo_stats(split: PhotoSplit, count: int = 500) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of ``count`` evenly spaced training images (their evaluation views; damaged ones left
    out)."""
    positions = torch.linspace(0, len(split) - 1, min(count, len(split))).round().long().unique().tolist()
    views = [v for v in map(split.eval_view_at, positions) if v is not None]
    if not views:
        raise DataError(f"None of the {len(positions)} training photos read for the normalisation could be decoded.")
    return channel_stats(torch.stack(views))
