"""Photos in a table dataset, for ``recipes/finetune_folder.py``: a Hugging Face image dataset (a Hub id when the Hub
is reachable, a local clone, or a folder of parquet files: ``data/train-*.parquet`` with an image column of encoded
photos and a label column), read through ``datasets`` the way a folder is read through its files.

Nothing is decoded up front: ``datasets`` keeps an arrow copy of the tables, memory-mapped, and each photo's encoded
bytes are read from it per batch in the loader's workers and decoded there, as a folder's files are (the same
``common.data.photos`` code: the recipe's ``train_view``, the evaluation view, the photo check, predict's
preprocessing). Memory stays flat in the dataset's size. The arrow copy of a local folder is kept in the cache folder
under a key made of every file's size and times, so a changed file is read afresh, and that key (a Hub dataset: its
``datasets`` fingerprint) joins the data fingerprint a checkpoint records: a resume on changed tables is refused.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from common.data import cache, sources
from common.data.photos import PhotoSplit
from common.errors import DataError

VALIDATION_SPLITS = ("validation", "valid", "val")


class TablePhotoSplit(PhotoSplit):
    """The rows of one split of a ``datasets`` table: encoded photos in ``table`` (its image column only, not
    decoded), labels in ``source_labels``; ``where`` names the split in messages."""

    def __init__(
        self,
        table,
        labels: torch.Tensor,
        image_size: int,
        index: torch.Tensor | None = None,
        where: str = "",
        note: str = "",
    ):
        self.table, self.where = table, where
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
            return item["path"]
        raise DataError(
            f"Row {self.source_row(position)} of {self.where} has no image (its image cell is empty). "
            "Fill it in or remove the row, and run again."
        )

    def with_index(self, index: torch.Tensor) -> TablePhotoSplit:
        return TablePhotoSplit(self.table, self.source_labels, self.image_size, index, self.where, self.note)


def _labels(split, lab_col: str, class_names: list[str], str_map, what: str) -> torch.Tensor:
    """A split's label column as class indices; a label train does not have, or none, is one paragraph."""
    values = list(split[lab_col])
    missing = next((i for i, v in enumerate(values) if v is None), None)
    if missing is not None:
        raise DataError(
            f"Row {missing} of {what} has no label (column {lab_col!r} is empty there). Fill in its label, "
            "or remove the row, and run again."
        )
    if str_map is not None:
        outside = sorted({v for v in values if v not in str_map}, key=str)
        indices = [str_map.get(v, -1) for v in values]
    else:
        outside = sorted({v for v in values if not isinstance(v, int) or not 0 <= v < len(class_names)}, key=str)
        indices = values
    if outside:
        raise DataError(
            f"{what} has the label(s) {', '.join(map(repr, outside[:5]))} outside the {len(class_names)} "
            f"classes found in train ({', '.join(class_names[:10])}"
            f"{', ...' if len(class_names) > 10 else ''}). Make every split use the training classes, or "
            "fix the label column."
        )
    return torch.tensor(indices, dtype=torch.int64)


def load_table_photos(cfg, name: str, cache_dir: Path) -> tuple[dict, list[str], str, dict]:
    """({split name: TablePhotoSplit}, class names, the tables' identity, {split: what}) of the table dataset
    ``name``; the local main process of each node builds the arrow copy first, the others then read it."""
    from accelerate import PartialState
    from datasets import Image as ImageFeature

    state = cache.source_state(name)  # a local folder's files, hashed; None for a Hub id
    with PartialState().local_main_process_first():
        ds = sources.load_source(name, cache_dir / "datasets" / state if state else None)
    train = ds["train"]
    img_col, lab_col = sources.pick_columns(train, cfg, name)
    if not isinstance(train.features[img_col], ImageFeature):
        raise DataError(
            f"Column {img_col!r} of {name!r} holds {train.features[img_col]}, not images. Pass "
            "--image-column with the column of images."
        )
    class_names, str_map = sources.class_names_of(train, lab_col)
    splits, identity = {}, hashlib.sha256((state or "").encode())
    for split_name in ds:
        if split_name not in ("train", "test", *VALIDATION_SPLITS):
            continue
        split, what = ds[split_name], f"the {split_name} split of {name}"
        for col in (img_col, lab_col):
            if col not in split.features:
                raise DataError(
                    f"The {split_name} split of {name!r} has no column {col!r}. Give every split the same columns."
                )
        if len(split) == 0:
            raise DataError(
                f"The {split_name} split of {name!r} is empty. Add images to it, or remove it so the "
                "recipe holds out part of train instead."
            )
        labels = _labels(split, lab_col, class_names, str_map, what)
        table = split.select_columns([img_col]).cast_column(img_col, ImageFeature(decode=False))
        if img_col != "image":
            table = table.rename_column(img_col, "image")
        key = "validation" if split_name in VALIDATION_SPLITS else split_name
        splits[key] = TablePhotoSplit(table, labels, cfg.image_size, where=what)
        identity.update(f"{split_name}:{len(split)}:{'' if state else split._fingerprint};".encode())
    return splits, class_names, identity.hexdigest()[:32]
