"""Photos in a table dataset, for ``recipes/finetune_folder.py``: a Hugging Face image dataset (a Hub id when the Hub
is reachable, a local clone, or a folder of parquet files: ``data/train-*.parquet`` with an image column of encoded
photos and a label column), read through ``datasets`` the way a folder is read through its files.

Nothing is decoded up front: ``datasets`` keeps an arrow copy of the tables, memory-mapped, and each photo's encoded
bytes are read from it per batch in the loader's workers and decoded there, as a folder's files are (the same
``common.data.photos`` code: the recipe's ``train_view``, the evaluation view, the damaged-photo policy, predict's
preprocessing). Memory stays flat in the dataset's size. The arrow copy of a local folder is kept in the cache
folder, one per state of its tables, under the tables' identity (``common.data.table_copies``: each data file's
relative path, size, modification time and footer), and that identity (a Hub dataset: its ``datasets``
fingerprint) joins the data fingerprint a checkpoint records: a resume on changed tables is refused; on copied,
chmod-ed or documented ones not.

The folder rules (``common.data.folders``) hold for tables too, each broken one a paragraph: every class of the labels
has a training row, train has at least two classes, no other split has a class train lacks, and integer labels are
class indices 0..K-1 with no gap (or the column names them: a ClassLabel, or strings). A split with no label at all
(every row -1, datasets' "no label": the Hub's test splits whose answers are not published, as ImageNet-1k's) is
skipped with a note; some rows without a label are refused. An image cell holding only a path (no bytes) is read from
inside the dataset folder only.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import torch

from common.data import sources, table_copies, table_labels
from common.data.photos import PhotoSplit
from common.errors import DataError

VALIDATION_SPLITS = ("validation", "valid", "val")
UNLABELLED = -1  # datasets' ClassLabel value for "no label"


class TablePhotoSplit(PhotoSplit):
    """The rows of one split of a ``datasets`` table: encoded photos in ``table`` (its image column only, not
    decoded), labels in ``source_labels``; ``where`` names the split in messages. ``files_at``: (the dataset folder
    or None, the folders inside which an image cell holding a path and no bytes is read: ``_inside``)."""

    def __init__(
        self,
        table,
        labels: torch.Tensor,
        image_size: int,
        index: torch.Tensor | None = None,
        where: str = "",
        note: str = "",
        files_at: tuple = (None, ()),
    ):
        self.table, self.where, self.files_at = table, where, files_at
        self.files = None  # no files: the rows are the table's
        self.source_labels, self.image_size, self.note = labels, image_size, note
        self.index = None if index is None else torch.as_tensor(index, dtype=torch.int64)

    def _item(self, position: int) -> dict:
        return self.table[self.source_row(position)]["image"] or {}

    def file_at(self, position: int) -> str:
        row = self.source_row(position)
        path = (self.table[row]["image"] or {}).get("path")
        return f"row {row} of {self.where}" + (f" ({path})" if path else "")

    def source_at(self, position: int):
        item = self._item(position)
        if item.get("bytes"):
            return io.BytesIO(item["bytes"])
        if item.get("path"):
            path = _inside(self.files_at, item["path"], real=True)
            if path is None:
                raise _outside_error(self.where, self.files_at, [(self.source_row(position), item["path"])], 1)
            return path
        raise DataError(
            f"Row {self.source_row(position)} of {self.where} has no image (its image cell is empty). "
            "Fill it in or remove the row, and run again."
        )

    def with_index(self, index: torch.Tensor) -> TablePhotoSplit:
        return TablePhotoSplit(
            self.table, self.source_labels, self.image_size, index, self.where, self.note, self.files_at
        )


# --- image cells that name a file ----------------------------------------------------------------------------------


def files_at(folder: Path | None) -> tuple:
    """(home, roots) for ``_inside``: a local dataset folder is both (a relative path is relative to it); a Hub
    dataset's files are those ``datasets`` downloaded, in its own cache and the Hub's (an image-folder repo's rows name
    them), and a relative path names none."""
    if folder is not None:
        home = os.path.realpath(folder)
        return home, (home,)
    import datasets.config
    import huggingface_hub.constants

    caches = (datasets.config.HF_DATASETS_CACHE, huggingface_hub.constants.HF_HUB_CACHE)
    return None, tuple(os.path.realpath(c) for c in caches)


def _inside(at: tuple, path: str, real: bool = False) -> str | None:
    """The file an image cell's ``path`` names when it lies inside one of the folders ``at`` = (home, roots) allows
    (``files_at``), else None. ``real``: links resolved (what is opened); without, by its name (every row, up front)."""
    home, roots = at
    if not os.path.isabs(path):
        if home is None:
            return None
        path = os.path.join(home, path)
    full = os.path.realpath(path) if real else os.path.normpath(path)
    return full if any(full.startswith(os.path.join(r, "")) for r in roots) else None


def _outside_error(what: str, at: tuple, rows: list, count: int) -> DataError:
    shown = "; ".join(f"row {r}: {p}" for r, p in rows[:3])
    home, roots = at
    where = (
        f"outside the dataset folder {home}"
        if home is not None
        else f"outside the folders datasets downloaded the dataset to ({', '.join(roots)})"
    )
    return DataError(
        f"{count:,} image cell(s) of {what} hold only a path, no image bytes, {where} ({shown}). A table is data: "
        "the recipe reads the files it names only inside the dataset's own folder, never a file anywhere on this "
        "machine. Embed the images' bytes in the table's image column, or put the images inside the dataset folder "
        "with their paths relative to it, and run again."
    )


def _path_cells(table, at: tuple, what: str) -> str:
    """Checks the image cells of ``table`` (column "image", not decoded) that hold a path and no bytes: each must lie
    inside the folders ``at`` allows (``files_at``: a local dataset's own folder). Returns a hash of those files'
    (path, size, mtime_ns) for the identity ('' when there are none): they are data the tables' own files do not
    hold."""
    import numpy as np
    import pyarrow.compute as pc

    found, offset = [], 0
    for chunk in table.data.column("image").chunks:
        if chunk.null_count < len(chunk):
            no_bytes = pc.equal(pc.fill_null(pc.binary_length(chunk.field("bytes")), 0), 0)
            mask = pc.and_(pc.and_(no_bytes, pc.is_valid(chunk.field("path"))), chunk.is_valid())
            rows = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
            paths = chunk.field("path").take(rows).to_pylist()
            found.extend(zip((rows + offset).tolist(), paths))
        offset += len(chunk)
    if not found:
        return ""
    outside = [(r, p) for r, p in found if _inside(at, p) is None]
    if outside:
        raise _outside_error(what, at, outside, len(outside))
    h = hashlib.sha256()
    for _, p in found:
        try:
            st = os.stat(_inside(at, p))
            h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode("utf-8", "surrogateescape"))
        except OSError:  # missing or unreadable: the photo check names it
            h.update(f"{p}\0-\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


# --- labels, by the folder rules -------------------------------------------------------------------------------------


def _unlabelled(value) -> bool:
    return value is None or (type(value) is int and value == UNLABELLED)


def _read_labels(ds, split_names: list[str], lab_col: str, name: str) -> tuple[dict, list[str]]:
    """{split: its label column as a list}, the splits with no label at all left out (and named in the notes); a
    split with some rows unlabelled, or a train split with none labelled, is one paragraph."""
    values, notes = {}, []
    for split_name in split_names:
        column = ds[split_name].data.column(lab_col).to_pylist()
        missing = [i for i, v in enumerate(column) if _unlabelled(v)]
        if missing and len(missing) == len(column):
            if split_name == "train":
                raise DataError(
                    f"The train split of {name} has no labels: each of its {len(column):,} rows has the label -1 "
                    f"(or none) in column {lab_col!r}, which datasets uses for 'no label'. There is nothing to "
                    "train on: pass a dataset whose train split is labelled, or --label-column the column that "
                    "holds its labels."
                )
            notes.append(
                f"the {split_name} split ({len(column):,} rows) is skipped: none of its rows has a label "
                "(-1 or empty, as the Hub keeps the answers of some test splits unpublished)"
                + (", so validation is held out of train" if split_name in VALIDATION_SPLITS else "")
            )
            continue
        if missing:
            raise DataError(
                f"Row {missing[0]} of the {split_name} split of {name} has no label (column {lab_col!r} is "
                f"{'empty' if column[missing[0]] is None else '-1'} there, datasets' 'no label'), and so do "
                f"{len(missing) - 1:,} other row(s) of its {len(column):,}. Fill in their labels, or remove those "
                "rows, and run again (a split with no label at all is skipped, with a note)."
            )
        values[split_name] = column
    return values, notes


def load_table_photos(cfg, name: str, cache_dir: Path) -> tuple[dict, list[str], str, str]:
    """({split name: TablePhotoSplit}, class names, the tables' identity, a note for the startup line) of the table
    dataset ``name``; the local main process of each node builds the arrow copy first, the others then read it."""
    from accelerate import PartialState
    from datasets import Image as ImageFeature

    folder = sources.local_folder(name)
    state, copy = table_copies.local_copy(cache_dir, folder)  # None for a Hub id
    with PartialState().local_main_process_first():
        ds = sources.load_source(name, copy)
    train = ds["train"]
    img_col, lab_col = sources.pick_columns(train, cfg, name)
    if not isinstance(train.features[img_col], ImageFeature):
        raise DataError(
            f"Column {img_col!r} of {name!r} holds {train.features[img_col]}, not images. Pass "
            "--image-column with the column of images."
        )
    used = [k for k in ds if k in ("train", "test", *VALIDATION_SPLITS)]
    for split_name in used:
        for col in (img_col, lab_col):
            if col not in ds[split_name].features:
                raise DataError(
                    f"The {split_name} split of {name!r} has no column {col!r}. Give every split the same columns."
                )
        if len(ds[split_name]) == 0:
            raise DataError(
                f"The {split_name} split of {name!r} is empty. Add images to it, or remove it so the "
                "recipe holds out part of train instead."
            )
    values, notes = _read_labels(ds, used, lab_col, name)
    class_names, index = table_labels.class_names_of(train, lab_col, name, values)
    labels = {
        k: torch.tensor(v if index is None else [index[x] for x in v], dtype=torch.int64) for k, v in values.items()
    }
    at = files_at(folder)
    splits, identity = {}, hashlib.sha256((state or "").encode())
    for split_name in values:
        split, what = ds[split_name], f"the {split_name} split of {name}"
        table = split.select_columns([img_col]).cast_column(img_col, ImageFeature(decode=False))
        if img_col != "image":
            table = table.rename_column(img_col, "image")
        files = _path_cells(table, at, what)
        key = "validation" if split_name in VALIDATION_SPLITS else split_name
        splits[key] = TablePhotoSplit(table, labels[split_name], cfg.image_size, where=what, files_at=at)
        identity.update(f"{split_name}:{len(split)}:{'' if state else split._fingerprint}:{files};".encode())
    return splits, class_names, identity.hexdigest()[:32], "; ".join(notes)
