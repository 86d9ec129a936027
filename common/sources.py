"""Finding a dataset and reading it through ``datasets``: a Hub id or a local folder (a clone of a Hub repo,
or an image folder), its image and label columns and class names, and the decode of one split into uint8
tensors. Every mistake a user can make with a source gets a one-paragraph ``DataError`` naming the fix
(git-lfs pointers instead of files, a flat folder, corrupt images listed in one pass, ...)."""

from __future__ import annotations

import io
import os
import socket
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import torch

from common.errors import DataError
from common.splits import ImageSplit

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
LFS_POINTER = b"version https://git-lfs.github.com/spec"
MAX_BAD_IMAGES_SHOWN = 5


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

def decode_split(split, img_col: str, lab_col: str, channels: int, image_size: int, label_map, what: str,
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
