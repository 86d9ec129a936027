"""Photos of any size and mode, for fine-tuning (``recipes/finetune_folder.py``): read from their files per batch,
in DataLoader workers, never held decoded.

Why not the decoded cache of ``common.data``: it stores every image at one size, which for photos means a squash
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
- Pixels are read by ``common.pixels`` (EXIF orientation, 16-bit, transparency) and always as RGB: the torchvision
  models take three channels.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
import numpy as np
import torch

from common.errors import DataError
from common.splits import ImageData, Rows

EVAL_RATIO = 0.875  # the centre crop's share of the resized shorter side (torchvision: 224 of 256)


def resize_side(image_size: int) -> int:
    return int(round(image_size / EVAL_RATIO))


def read_rgb(path: str, min_side: int) -> torch.Tensor:
    """uint8 (3, H, W) of the photo at ``path``; a JPEG decoded at the smallest scale whose shorter side is still
    at least ``min_side``."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    from common.pixels import as_mode

    with Image.open(path) as img:
        if img.format == "JPEG":
            w, h = img.size
            scale = min_side / min(w, h)
            img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))  # at least this big; 1/2, 1/4, 1/8
        img.load()
        return pil_to_tensor(as_mode(img, "RGB"))


def eval_view(image: torch.Tensor, image_size: int) -> torch.Tensor:
    """Shorter side to ``resize_side(image_size)``, then the centre ``image_size`` square."""
    from torchvision.transforms.v2 import functional as TF

    image = TF.resize(image, [resize_side(image_size)], antialias=True)
    return TF.center_crop(image, [image_size, image_size])


class PhotoSplit(Rows):
    """The files and labels of one split, with the interface of ``common.splits.ImageSplit`` that the run needs
    (length, labels and ``select`` for the hold-out from ``Rows``; ``images_at`` for the misclassified-image grid)."""

    def __init__(self, files, labels: torch.Tensor, image_size: int, index: torch.Tensor | None = None, note=""):
        self.files = files if isinstance(files, np.ndarray) else np.array(files)  # no per-item refcounts in workers
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
        return str(self.files[self.source_row(position)])

    def with_index(self, index: torch.Tensor) -> "PhotoSplit":
        return PhotoSplit(self.files, self.source_labels, self.image_size, index, self.note)

    def images_at(self, positions) -> torch.Tensor:
        """The evaluation views of the images at ``positions`` (an index tensor, list or slice), decoded now."""
        if isinstance(positions, slice):
            positions = range(*positions.indices(len(self)))
        side = resize_side(self.image_size)
        views = [eval_view(read_rgb(self.file_at(int(p)), side), self.image_size) for p in positions]
        return torch.stack(views) if views else torch.zeros((0, *self.image_shape), dtype=torch.uint8)


class PhotoDataset(torch.utils.data.Dataset):
    """Per-image decoding and augmentation, run in the DataLoader's workers."""

    def __init__(self, split: PhotoSplit, seed: int, train_view=None):
        self.split, self.seed, self.train_view, self.epoch = split, seed, train_view, 0

    def set_epoch(self, epoch: int) -> None:  # called before each epoch's iterator (and its workers) starts
        self.epoch = epoch

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        size = self.split.image_size
        path = self.split.file_at(i)
        try:
            image = read_rgb(path, resize_side(size))
        except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, name it
            raise DataError(f"Could not read {path} ({type(err).__name__}: {err}); every photo was decoded whole "
                            "before training, so the file changed while the run went on. Put the original file back "
                            "and resume (--resume-from latest): a resume refuses a folder whose files changed, as "
                            "the held-out split would no longer be the run's.") from None
        if self.train_view is None:
            return eval_view(image, size), self.split.label_at(i)
        # torchvision's transforms draw from torch's global generator: seed it per image, inside fork_rng so the
        # main process's own stream (dropout, the shuffle) is untouched when there are no workers
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_033 + int(i))
            image = self.train_view(image)
        if image.shape != (3, size, size) or image.dtype != torch.uint8:
            raise DataError(f"The recipe's train_view made a {tuple(image.shape)} {image.dtype} image of {path}; the "
                            f"loader hands out (3, {size}, {size}) uint8 images (--image-size {size}), normalised on "
                            "the device. End train_view with a crop or resize to --image-size and keep uint8 pixels.")
        return image, self.split.label_at(i)


def check_photos(split: PhotoSplit, what: str) -> None:
    """Decode every photo whole, as training reads it (JPEG draft scaling keeps it cheap), on all of this process's
    cores, so a file whose header reads but whose data is cut short or damaged is named before training starts,
    never met by a DataLoader worker mid-epoch (which ended the run without a checkpoint). All bad files are
    listed in one message."""
    from concurrent.futures import ThreadPoolExecutor

    from common.pixels import unreadable_error, unreadable_reason

    side = resize_side(split.image_size)

    def problem(position: int):
        path = split.file_at(position)
        try:
            read_rgb(path, side)  # Pillow decodes with the GIL released: threads share the cores
        except Exception as err:  # noqa: BLE001 - a file is data: whatever it does, it is one bad file, named
            return path, unreadable_reason(err)
        return None

    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        bad = [p for p in pool.map(problem, range(len(split)), chunksize=64) if p is not None]
    if bad:
        raise unreadable_error(bad, len(split), what)


def load_photos(cfg, default_dataset: str = "", is_main: bool = True) -> ImageData:
    """An image folder (``common.folders`` rules) as PhotoSplits at ``cfg.image_size``; validation held out of
    train (``--val-fraction``, seeded) when the folder has no validation split."""
    from common import cache, folders, sources
    from common.cache import default_cache_dir
    from common.splits import hold_out

    name = cfg.dataset or default_dataset
    path = sources.local_folder(name) if name else None
    if path is None or not folders.is_image_folder(path):
        raise DataError(f"--dataset {name!r} is not a folder of images. This recipe fine-tunes on a folder of photos "
                        "(<dir>/<class>/<image>, optionally under train/ val/ test/); for a Hub dataset or parquet "
                        "files use recipes/cifar_cnn.py.")
    scan = folders.scan(path, name)
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    splits = {}
    for split_name, fs in scan.splits.items():
        files = [str(fs.base / f) for f in fs.files]
        splits[split_name] = PhotoSplit(files, torch.tensor(fs.labels, dtype=torch.int64), cfg.image_size)
        splits[split_name].provenance = fs.provenance()
        # Decoded whole once per state of the files (the fingerprint covers every file's size and times), by one
        # process of those sharing the cache folder: a marker there says these very files were checked.
        cache.once(cache_dir / f"photos-checked-{fs.fingerprint}",
                   lambda s=splits[split_name], n=split_name: check_photos(s, f"the {n} split of {name}"),
                   f"checking the {split_name} split's {len(fs)} photos", is_main)
    train, val = splits["train"], splits.get("validation")
    if val is None and cfg.val_fraction > 0:
        train, val = hold_out(train, cfg.val_fraction, cfg.seed)
    return ImageData(train, val, splits.get("test"), scan.class_names, name, scan.skipped_line(),
                     make_loader=photo_loader)


def photo_loader(cfg, accelerator, split: PhotoSplit | None, train: bool = False, on_device: bool = False,
                 train_view=None, drop_last: bool | None = None):
    """A DataLoader decoding in ``--workers`` worker processes: the global --batch-size split over processes and
    accumulation steps for training, --eval-batch-size over processes for evaluation. ``train_view``: the recipe's
    per-image training transform (uint8 (3, H, W) in, (3, --image-size, --image-size) out), required for training;
    evaluation resizes the shorter side and centre-crops. ``on_device``: unused (photos are decoded on the host)."""
    from common.accelerator import loader_batch

    if split is None:
        return None
    if train and train_view is None:
        raise TypeError("a training photo loader needs the recipe's train_view (its per-image augmentation)")
    n = accelerator.num_processes
    batch = loader_batch(cfg, n, train)
    dataset = PhotoDataset(split, cfg.seed, train_view if train else None)
    workers = cfg.workers
    if workers < 0:  # this process's share of the node's cores, less the one the training loop runs on
        local = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        workers = min(8, max(0, len(os.sched_getaffinity(0)) // max(1, local) - 1))
    # Workers start anew each epoch (not persistent): they copy the dataset after set_epoch, so every epoch
    # draws its own crops. The loader's own generator keeps the shuffle off the global RNG (exact resume).
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=train,
                                       drop_last=train if drop_last is None else drop_last,
                                       num_workers=workers, pin_memory=accelerator.device.type == "cuda",
                                       generator=torch.Generator().manual_seed(0),
                                       prefetch_factor=4 if workers else None)


def photo_stats(split: PhotoSplit, count: int = 500) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of ``count`` evenly spaced training images (their evaluation views)."""
    from common.augment import channel_stats

    positions = torch.linspace(0, len(split) - 1, min(count, len(split))).round().long().unique()
    return channel_stats(split.images_at(positions))
