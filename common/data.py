"""Load an image-classification dataset with `datasets`, decode it once into uint8 tensors, cache it.

The decoded tensors ARE the training data: batches are formed by indexing them (one gather per
batch, see ``TensorImages.__getitems__``), travel to the device as uint8, and are converted and
augmented there (``common.augment``). No per-sample Python runs in the training loop.

Accepted sources (``--dataset``):
- a Hub id such as ``ylecun/mnist`` (needs network the first time, then the Hub cache serves it);
- a local clone of a Hub dataset repo (parquet files per split);
- an image folder: ``<dir>/<class>/*.png`` (optionally under ``train/``, ``validation/``, ``test/``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from common.errors import DataError

CACHE_VERSION = "1"
IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
VALIDATION_SPLITS = ("validation", "valid", "val")


@dataclass
class ImageSplit:
    images: torch.Tensor  # (N, C, H, W) uint8
    labels: torch.Tensor  # (N,) int64

    def __len__(self):
        return self.labels.numel()


@dataclass
class ImageData:
    train: ImageSplit
    val: ImageSplit | None
    test: ImageSplit | None
    class_names: list[str]
    source: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train.images.shape[1:])

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
    arrays, labels = [], []
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
                raise DataError(f"Could not decode the image {src} in {what} ({err}). Remove or replace that "
                                "file and run again.") from None
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


def _cache_path(cache_dir: Path, fingerprint: str, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps([CACHE_VERSION, fingerprint, settings], sort_keys=True).encode()).hexdigest()
    return cache_dir / f"{key[:32]}.safetensors"


def _load_cached(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        return ImageSplit(f.get_tensor("images"), f.get_tensor("labels")), json.loads(meta["class_names"])


def _save_cached(path: Path, split: ImageSplit, class_names):
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    save_file({"images": split.images, "labels": split.labels}, tmp,
              metadata={"class_names": json.dumps(class_names)})
    os.replace(tmp, path)  # atomic: a reader sees the old state or the whole file


def default_cache_dir() -> Path:
    return Path(os.environ.get("ACCELERATE_RECIPES_CACHE", Path.home() / ".cache" / "accelerate-recipes"))


def load_image_data(cfg, default_dataset: str, is_main: bool = True, log=print) -> ImageData:
    """Load, decode (or read from cache), split. Call on the main process first, then on the others."""
    name = cfg.dataset or default_dataset
    ds = load_source(name)
    train = ds["train"]
    img_col = _pick_column(train.features, cfg.image_column, IMAGE_COLUMNS, "image", name)
    lab_col = _pick_column(train.features, cfg.label_column, LABEL_COLUMNS, "label", name)
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

    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    settings = {"img": img_col, "lab": lab_col, "channels": cfg.channels, "size": cfg.image_size}
    splits = {}
    for split_name in ds:
        if split_name != "train" and split_name != "test" and split_name not in VALIDATION_SPLITS:
            continue
        split = ds[split_name]
        for col in (img_col, lab_col):
            if col not in split.features:
                raise DataError(f"The {split_name} split of {name!r} has no column {col!r}. Give every split the "
                                "same columns.")
        path = _cache_path(cache_dir, split._fingerprint, settings)
        if path.exists():
            splits[split_name] = _load_cached(path)[0]
            continue
        if is_main:
            log(f"decoding {split_name} split of {name} ({len(split)} images) into {path} ...")
        decoded = _decode_split(split, img_col, lab_col, cfg.channels, cfg.image_size,
                                label_map_for(f"The {split_name} split"), f"the {split_name} split of {name!r}",
                                progress=is_main and sys.stderr.isatty())
        if is_main:
            _save_cached(path, decoded, class_names)
        splits[split_name] = decoded

    shapes = {k: tuple(v.images.shape[1:]) for k, v in splits.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(f"The splits of {name!r} have different image shapes {shapes}. Pass --image-size N "
                        "(and --channels) so every split is decoded to the same shape.")
    val_name = next((s for s in VALIDATION_SPLITS if s in splits), None)
    train_split, val_split = splits["train"], splits.get(val_name) if val_name else None
    if val_split is None and cfg.val_fraction > 0:
        train_split, val_split = hold_out(train_split, cfg.val_fraction, cfg.seed)
    return ImageData(train_split, val_split, splits.get("test"), class_names, name)


def hold_out(split: ImageSplit, fraction: float, seed: int) -> tuple[ImageSplit, ImageSplit]:
    """A fixed, seeded random fraction of ``split`` becomes validation; the same for every process."""
    n = len(split)
    n_val = max(1, int(round(n * fraction)))
    if n_val >= n:
        raise DataError(f"Holding out {fraction:.0%} of a {n}-image train split leaves nothing to train on. "
                        "Lower --val-fraction or add images.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
    return (ImageSplit(split.images[train_idx], split.labels[train_idx]),
            ImageSplit(split.images[val_idx], split.labels[val_idx]))


# --- batching ------------------------------------------------------------------------------------

class TensorImages(torch.utils.data.Dataset):
    """A dataset over decoded tensors. ``__getitems__`` lets the DataLoader fetch a whole batch with one
    index gather instead of one Python call per sample."""

    def __init__(self, split: ImageSplit):
        self.images, self.labels = split.images, split.labels

    def __len__(self):
        return self.labels.numel()

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices):
        idx = torch.as_tensor(indices, device=self.images.device)
        return self.images[idx], self.labels[idx]

    def to(self, device):
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        return self


def keep_batch(batch):
    """collate_fn for ``TensorImages``: the batch is already a (images, labels) pair."""
    return batch


def make_loader(split: ImageSplit, batch_size: int, train: bool, device=None, pin: bool = False):
    dataset = TensorImages(split)
    if device is not None:
        dataset.to(device)
    # Its own generator: creating an iterator must not draw from the global RNG (dropout's stream),
    # or a run resumed mid-epoch would diverge from the uninterrupted one.
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train,
                                       collate_fn=keep_batch, num_workers=0, pin_memory=pin and device is None,
                                       generator=torch.Generator().manual_seed(0))
