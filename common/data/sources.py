"""Finding a dataset: a Hub id or a local folder, which is an image folder (torchvision's ImageFolder rule,
``common.data.folders``) or a table dataset (a clone of a Hub repo, a folder of parquet files) opened with
``datasets``; ``image_folder`` is the one place the two part. Then a table's image and label columns. Every mistake
a user can make with a source gets a one-paragraph ``DataError`` naming the fix (git-lfs pointers instead of files,
no images, offline, a full disk, ...)."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from common import console
from common.data.folders import TABLE_ENDINGS, FolderScan, _listing, scan
from common.data.walk import image_endings
from common.errors import DataError

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")
LFS_POINTER = b"version https://git-lfs.github.com/spec"


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


EXTENSIONS_SHOWN = ".png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff and the other formats Pillow reads"


def _refuse_unusable_folder(name: str, root: Path) -> None:
    """Raise what is wrong with a local folder that gives no images: git-lfs pointer files in place of the data (the
    text stubs a clone made without git-lfs leaves), or no image nor table file at all. Walks the tree (the first
    200,000 files), so only called on error paths."""

    def files():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache
            yield from (Path(dirpath) / f for f in filenames if not f.startswith("."))

    endings, pointers = Counter(), []
    for p in itertools.islice(files(), 200_000):
        endings[p.suffix.lower() or "(no ending)"] += 1
        with contextlib.suppress(OSError):
            if p.stat().st_size < 1024 and p.read_bytes()[: len(LFS_POINTER)] == LFS_POINTER:  # a stub is ~130 bytes
                pointers.append(p)
    if pointers:
        shown = ", ".join(str(p) for p in pointers[:3]) + (", ..." if len(pointers) > 3 else "")
        raise DataError(
            f"{len(pointers)} file(s) in {name!r} are git-lfs pointer files, not data ({shown}): the repository was "
            "cloned without git-lfs, which leaves a small text stub in place of each parquet file. Install git-lfs "
            "(e.g. `apt install git-lfs` or `brew install git-lfs`), then run `git lfs install` and `git lfs pull` "
            "inside the clone, and run again."
        )
    if not any(e in image_endings() | TABLE_ENDINGS for e in endings):  # a table says "no column" instead
        found = ", ".join(f"{n} {e}" for e, n in endings.most_common(5)) or "no files at all"
        raise DataError(
            f"No images were found in {name!r} (found: {found}). The image-folder layout reads files ending "
            f"{EXTENSIONS_SHOWN}, one sub-folder per class ({name}/<class>/<image>). Put the images there, or pass "
            "--dataset a directory with the dataset's parquet files."
        )


def local_folder(name: str) -> Path | None:
    """The checked local directory ``name`` names, or None for a Hub id; DataError for a path that is missing,
    a file or unreadable."""
    looks_local = (
        name.startswith((".", "/", "~"))
        or os.sep in name.strip("/").split("/", 1)[-1]
        or Path(name).expanduser().exists()
    )
    path = Path(name).expanduser()
    if looks_local and not path.exists():
        raise DataError(
            f"The dataset path {name!r} does not exist. Pass --dataset a directory that holds the dataset "
            "(a clone of the Hub repo with its parquet files, or an image folder with one sub-folder per "
            "class), or a Hub id such as ylecun/mnist on a machine with network access."
        )
    if not path.exists():
        return None
    if not path.is_dir():
        raise DataError(
            f"The dataset path {name!r} is a file, not a directory. Pass --dataset the folder "
            "that holds the parquet files or the class sub-folders."
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise DataError(
            f"The dataset directory {name!r} is not readable by this user. Fix its permissions "
            "(e.g. chmod -R u+rX) or copy it somewhere readable."
        )
    return path


def image_folder(name: str) -> FolderScan | None:
    """The scan of the image folder ``name`` names (``common.data.folders``), or None for a table dataset, read
    through ``datasets`` (``load_source``): a Hub id, or a local folder of tables (parquet or arrow files, or no image
    at all: csv or json tables, say). The one decision between the two, for every recipe."""
    path = local_folder(name)
    if path is None:
        return None
    try:
        found = scan(path, name)
    except DataError as err:  # a layout refused beside tables (train.csv and images/, say): say why they were not read
        tables = sorted(p.name for p in path.iterdir() if p.suffix.lower() in TABLE_ENDINGS and p.is_file())
        if not tables or " is not read" in str(err):
            raise
        raise DataError(
            f"{err} ({_listing(tables)} beside the images {'is' if len(tables) == 1 else 'are'} not read: a folder "
            "holding images is read by the ImageFolder rule, its labels the names of its class folders. To train on "
            "a table's labels, sort the images into folders by its label column, or write the table with its images "
            "in it as parquet into a folder of its own and pass that folder (docs/data.md, 'A table of labels': a "
            "few lines of `datasets`).)"
        ) from None
    return None if found.tables else found


def load_source(name: str, hf_cache: Path | None = None):
    """Return a ``datasets.DatasetDict`` for a local directory of tables (parquet, arrow, ...) or a Hub id, or
    raise DataError. ``hf_cache``: where ``datasets`` keeps its arrow copy of a local folder; keyed by the
    files' identity by the caller, since ``datasets`` itself keys it by modification time alone."""
    path = local_folder(name) or Path(name)
    if not path.exists() and not _hub_reachable():
        _go_offline()

    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    own_copy = hf_cache if hf_cache and path.exists() else None

    def load():
        return datasets.load_dataset(
            str(path) if path.exists() else name, cache_dir=str(own_copy) if own_copy else None
        )

    try:
        try:
            ds = load()
        except Exception as err:  # noqa: BLE001 - our own arrow copy may be what is damaged (a kill or a full disk
            if own_copy is None or not own_copy.exists() or _disk_full(err):  # while it was written): rebuilt once
                raise
            import shutil

            shutil.rmtree(own_copy, ignore_errors=True)
            ds = load()
            console.say(
                f"NOTE: the arrow copy of {name} in {own_copy} could not be read (damaged by an interrupted "
                "write); it was rebuilt from the dataset's files."
            )
    except Exception as err:  # datasets raises many types; all mean "could not load"
        if _disk_full(err):
            raise _disk_full_error(name, path, own_copy) from None
        if "corresponds to no data" in str(err):  # datasets' wording for a split with no rows
            split = str(err).split('"')[1] if '"' in str(err) else "a"
            raise DataError(
                f"The {split} split of {name!r} is empty. Add images to it, or remove its files so the "
                "recipe holds out part of train instead."
            ) from None
        if path.exists():
            _refuse_unusable_folder(name, path)
            raise DataError(
                f"datasets could not read {name!r}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}. "
                "Pass a directory laid out like the Hub repo (data/train-*.parquet, ...) or an image folder "
                "with one sub-folder per class."
            ) from None
        raise DataError(
            f"Could not load the Hub dataset {name!r}: the Hugging Face Hub is not reachable from this machine "
            "and the dataset is not in the local cache. On an offline machine, copy the dataset first "
            f"(e.g. `git clone https://huggingface.co/datasets/{name}` elsewhere) and pass --dataset "
            "<that directory>; or set HF_ENDPOINT to a reachable mirror."
        ) from None
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({"train": ds})
    if "train" not in ds:
        raise DataError(
            f"The dataset {name!r} has no 'train' split (found: {', '.join(ds) or 'none'}). "
            "Name the training files train-*.parquet (e.g. data/train-00000-of-00001.parquet)."
        )
    return ds


def _disk_full(err: BaseException) -> bool:
    """True when a full disk or quota (ENOSPC, EDQUOT) is behind ``err``: datasets wraps what failed in errors of its
    own (DatasetGenerationError), so the causes are followed."""
    import errno

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def _disk_full_error(name: str, path: Path, own_copy: Path | None) -> DataError:
    """The paragraph for a disk that filled while ``datasets`` wrote its arrow copy: the data is not at fault. The
    partial copy is removed first, which gives its space back."""
    if own_copy is not None:
        import shutil

        shutil.rmtree(own_copy, ignore_errors=True)
        where, fix = own_copy.parent.parent, "pass --cache-dir a folder on a disk with room for it"
    else:
        import datasets.config

        where = Path(datasets.config.HF_DATASETS_CACHE)
        fix = "set HF_HOME (or HF_DATASETS_CACHE) to a folder on a disk with room for it"
    try:
        size = sum(p.stat().st_size for p in path.rglob("*") if p.suffix in TABLE_ENDINGS) if path.is_dir() else 0
    except OSError:
        size = 0
    need = f" (about {size / 2**20:,.0f} MB here: as large as the dataset's table files)" if size else ""
    return DataError(
        f"The disk holding the cache folder {where} is full (no space left on device): datasets could not write "
        f"its arrow copy of {name}{need}, which the recipe reads the tables from. The dataset itself is fine. "
        f"Free space on that disk, or {fix}, and run again (what was written of the copy has been removed)."
    )


def _pick_column(features, wanted: str, candidates, kind: str, name: str) -> str:
    if wanted:
        if wanted not in features:
            raise DataError(
                f"The dataset {name!r} has no column {wanted!r} (columns: {', '.join(features)}). "
                f"Pass --{kind}-column with one of those."
            )
        return wanted
    for col in candidates:
        if col in features:
            return col
    raise DataError(
        f"The dataset {name!r} has no {kind} column: looked for {', '.join(candidates)} among "
        f"{', '.join(features)}. Pass --{kind}-column <name> to say which column holds the {kind}s."
    )


def pick_columns(train, cfg, name: str) -> tuple[str, str]:
    """The image and label columns of a table dataset, or a message naming the fix."""
    path = Path(name).expanduser()
    if not cfg.image_column and not any(c in train.features for c in IMAGE_COLUMNS) and path.is_dir():
        _refuse_unusable_folder(name, path)
    img_col = _pick_column(train.features, cfg.image_column, IMAGE_COLUMNS, "image", name)
    lab_col = _pick_column(train.features, cfg.label_column, LABEL_COLUMNS, "label", name)
    return img_col, lab_col
