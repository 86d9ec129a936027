"""A folder of the user's own images, read by one rule: torchvision's ``ImageFolder``, the layout users know.

    my_images/                      my_images/
      cat/ 001.jpg ...                train/ cat/ ... dog/ ...
      dog/ 2023/ a.png 2024/ b.png    val/   cat/ ... dog/ ...     (or validation/ or valid/)
                                      test/  cat/ ... dog/ ...

- Splits are folders at the top level only, and only beside a ``train/`` folder: ``train/``, one of
  ``validation/``, ``valid/``, ``val/``, and ``test/`` (any letter case). Without ``train/`` the whole folder
  is the training split, so ``valid/`` and ``invalid/`` side by side are two classes.
- The class of an image is the first folder under its split's root; every image below that folder, at any
  depth, belongs to it (``cat/2023/a.png`` is a cat). Any folder name is a class name: split words, names
  starting with ``__``, spaces, unicode (compared in Unicode NFC form).
- Hidden files and folders (``.name``) and files that are not images are skipped and counted.
- A class found in validation or test but not in train is refused with its name; so are images lying
  outside any class folder, and a class folder in train with no image.

The folder is walked here, sorted, on every process, so every rank sees the same files in the same order,
and no library's file patterns decide what a folder means. Each split's ``fingerprint`` covers every file's
path, class, size and modification and change times in nanoseconds (what git's index compares), so a file
replaced in place, even with its old modification time kept (``cp -p``, ``rsync``, ``touch -r``), changes
it and is decoded afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from common.data.walk import entries, image_endings, walk_images
from common.errors import DataError

SPLIT_FOLDERS = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "test": "test",
}
REPOSITORY_ENDINGS = {".parquet", ".arrow"}  # a folder holding these is a dataset repository, read by `datasets`
# files `datasets` reads as tables (a folder with no image is read by `datasets`, whatever it holds)
TABLE_ENDINGS = REPOSITORY_ENDINGS | {".csv", ".tsv", ".json", ".jsonl"}
METADATA_FILES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")
SHOWN = 5


def _listing(names) -> str:
    names = list(names)
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN:,} more" if len(names) > SHOWN else "")


@dataclass
class FolderSplit:
    """The image files of one split: paths relative to the dataset folder ``base``, their class indices and
    (size, mtime_ns, ctime_ns)."""

    name: str
    base: Path
    files: list[str]
    labels: list[int]
    stats: list[tuple[int, int, int]]

    def __len__(self):
        return len(self.files)

    def provenance(self) -> list[tuple[str, int, int]]:
        """Each file's (path in the dataset folder, size, mtime_ns): which file is at each row (common.data.splits)."""
        return [(f, st[0], st[1]) for f, st in zip(self.files, self.stats)]

    @property
    def fingerprint(self) -> str:
        """A hash of the split's folder, name, and every file's path, class, size and times."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = self._hash()
        return self._fingerprint

    def _hash(self) -> str:
        import numpy as np

        h = hashlib.sha256(json.dumps([str(self.base.resolve()), self.name, len(self.files)]).encode())
        h.update("\0".join(self.files).encode("utf-8", "surrogateescape"))
        h.update(np.asarray(self.labels, dtype=np.int64).tobytes())
        h.update(np.asarray(self.stats, dtype=np.int64).tobytes())
        return h.hexdigest()[:32]


@dataclass
class FolderScan:
    root: Path
    class_names: list[str]
    splits: dict[str, FolderSplit]
    skipped: Counter = field(default_factory=Counter)
    tables: bool = False  # parquet or arrow files (a dataset repository), or no image at all: read by `datasets`

    def skipped_line(self) -> str:
        """'' or e.g. 'skipped 2 hidden, 3 not images (.txt 2, .csv 1)', for the startup line."""
        hidden = self.skipped.get("hidden", 0)
        other = [(k, n) for k, n in self.skipped.most_common() if k != "hidden"]
        parts = [f"{hidden} hidden"] if hidden else []
        if other:
            parts.append(
                f"{sum(n for _, n in other)} not images ({', '.join(f'{k} {n}' for k, n in other[:SHOWN])}"
                f"{', ...' if len(other) > SHOWN else ''})"
            )
        return f"skipped {', '.join(parts)}" if parts else ""


def _refuse_shared_files(found: dict, name: str) -> None:
    """One file reached through links from two classes or two splits would train as both, or be scored on
    after training on it: refused, naming it. Within one class a file reached twice (a link to a folder of the
    same class) is read once. ``found``: {split: {class: [(path, stat), ...]}}, from ``walk_images``."""
    # only files that can be reached twice take part: those reached through a link or with several hard links,
    # and the files they are
    linked = {
        st[:2]
        for classes in found.values()
        for items in classes.values()
        for _, st in items
        if st is not None and st[5]
    }
    if not linked:
        return
    owner, clashes = {}, []
    for split, classes in found.items():
        for c, items in classes.items():
            kept = []
            for path, st in items:
                if st is None or st[:2] not in linked:  # None: a dangling link, named among the unreadable files
                    kept.append((path, st))
                    continue
                key = st[:2]
                if key not in owner:
                    owner[key] = (split, c, path)
                    kept.append((path, st))
                elif owner[key][:2] != (split, c):
                    clashes.append(f"{path} (also {owner[key][2]})")
            items[:] = kept
    if clashes:
        raise DataError(
            f"{len(clashes)} file(s) of {name} are reached from two classes or splits through links, e.g. "
            f"{'; '.join(clashes[:3])}: each would be trained on as two classes, or scored on after "
            "being trained on. Remove the links, or keep one copy of each file in its own class."
        )


def _relative_to(root: Path):
    """path -> its path relative to ``root`` (os.path.relpath's result, without its cost per file)."""
    prefix = os.path.join(str(root), "")
    return lambda p: p[len(prefix) :] if p.startswith(prefix) else os.path.relpath(p, root)


def _split_roots(root: Path, dirs: list[str], loose: list[str], name: str) -> dict[str, Path]:
    """Which folders are splits (module docstring), with the errors for layouts that cannot be read one way."""
    as_split = {d: SPLIT_FOLDERS[d.lower()] for d in dirs if d.lower() in SPLIT_FOLDERS}
    if "train" not in as_split.values():
        if dirs and len(as_split) == len(dirs):
            raise DataError(
                f"{name} holds {', '.join(d + '/' for d in dirs)} and no train/ folder. If these are splits, add "
                "train/ with one sub-folder per class beside them; if they are class names, put them under "
                f"train/ ({name}/train/{dirs[0]}/...): splits are read only beside a train/ folder."
            )
        for d in as_split:  # `test/cat/`, `test/dog/` beside `cat/`, `dog/`: a split that is not read as one
            inner = {s.name for s in (root / d).iterdir() if s.is_dir() and not s.name.startswith(".")}
            shared = sorted(inner & (set(dirs) - {d}))
            if shared:
                raise DataError(
                    f"{name}/{d}/ holds folders named like the classes beside it ({_listing(shared)}), so it looks "
                    f"like a {as_split[d]} split; but without a train/ folder it would be read as one more class "
                    f"named {d!r}. Move the training classes into {name}/train/ (train/<class>/...), or rename "
                    f"{d}/ if it really is a class."
                )
        return {"train": root}
    others = [d for d in dirs if d not in as_split]
    if others or loose:
        what = _listing([f"{d}/" for d in others] + loose)
        raise DataError(
            f"{name} has a train/ folder, so its top-level folders are read as splits (train/, validation/ or "
            f"valid/ or val/, test/), but it also holds {what}, which belongs to no split. Move it into the "
            "split it belongs to (train/<class>/...), or out of the dataset folder."
        )
    roots: dict[str, Path] = {}
    for d, split in as_split.items():
        if split in roots:
            clash = [x for x, s in as_split.items() if s == split]
            raise DataError(
                f"{name} holds {' and '.join(c + '/' for c in clash)}, both read as the {split} split. "
                "Merge them into one folder or remove one."
            )
        roots[split] = root / d
    return roots


def scan(root: Path, name: str) -> FolderScan:
    """Walk an image folder (module docstring) once; DataError with its fix for every layout that can't be read. A
    folder of tables is no image folder (``tables``: it holds parquet or arrow files, or no image at all):
    its scan holds no split, and ``datasets`` reads it (``common.data.sources.image_folder``)."""
    root = Path(root)
    endings, skipped = image_endings(), Counter()
    top_dirs, top_loose = entries(root, endings, skipped)
    if any(ending in REPOSITORY_ENDINGS for ending in skipped):  # a clone of a Hub repo: not walked further
        return FolderScan(root, [], {}, skipped, tables=True)
    if not top_dirs and top_loose:
        meta = [m for m in METADATA_FILES if (root / m).is_file()]
        raise DataError(
            f"The {len(top_loose)} images in {name} are not sorted into class folders, so they have no labels. Put "
            f"the images of each class in a sub-folder named after the class ({name}/<class>/<image>, at least "
            "two classes; optionally under train/, validation/ and test/), then run again."
            + (
                f" ({meta[0]} is not read: labels come from folder names only. To keep its labels, sort the "
                "images into folders by its label column.)"
                if meta
                else ""
            )
        )
    roots = _split_roots(root, top_dirs, top_loose, name)
    found: dict[str, dict[str, list[str]]] = {}
    strays: dict[Path, list[str]] = {}  # images outside any class folder: refused once no table is found
    for split, split_root in roots.items():
        if split_root != root:
            class_dirs, strays[split_root] = entries(split_root, endings, skipped)
        else:
            class_dirs, strays[split_root] = top_dirs, top_loose
        classes: dict[str, list[str]] = {}
        for d in class_dirs:
            classes.setdefault(unicodedata.normalize("NFC", d), []).extend(
                walk_images(split_root / d, endings, skipped)
            )
        found[split] = classes
    images = any(strays.values()) or any(files for classes in found.values() for files in classes.values())
    # no image at all: not an image folder; the table path reads its tables, or names what it holds instead
    # (git-lfs pointers, no images), and reads an unchanged folder's decoded splits by its source index
    if not images or any(e in REPOSITORY_ENDINGS for e in skipped):
        return FolderScan(root, [], {}, skipped, tables=True)
    for split_root, loose in strays.items():
        if loose:
            raise DataError(
                f"{len(loose)} images lie directly in {split_root}, outside any class folder ({_listing(loose)}): "
                f"they have no class. Move them into {split_root}/<class>/, or out of the dataset folder."
            )
    _refuse_shared_files(found, name)
    train = found["train"]
    folded = Counter(c.casefold() for c in train)
    twins = sorted(c for c in train if folded[c.casefold()] > 1)
    if twins:
        raise DataError(
            f"The class folders {_listing(twins)} of {name} differ only in letter case: here they are "
            "separate classes, on a case-insensitive filesystem (macOS, Windows) one folder. Merge them "
            "into one folder, or rename one if they really are different classes."
        )
    empty = [c for c, files in train.items() if not files]
    if not any(train.values()):
        raise DataError(
            f"No images were found in {name} (the files there end in "
            f"{_listing(k for k in skipped if k != 'hidden') or 'nothing'}). The image folder reads files Pillow "
            f"opens (.png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, ...), one sub-folder per class "
            f"({name}/<class>/<image>)."
        )
    if empty:
        raise DataError(
            f"The training class folder(s) {_listing(sorted(empty))} of {name} hold no images: the model "
            "would have an output for a class it never sees. Add images to them or remove them."
        )
    class_names = sorted(train)
    if len(class_names) < 2:
        raise DataError(
            f"{name} has a single class folder ({class_names[0]}/) in train: a classifier needs at "
            "least two. Add a sub-folder for each other class."
        )
    index = {c: i for i, c in enumerate(class_names)}
    splits = {}
    for split, classes in found.items():
        unknown = sorted(c for c, files in classes.items() if files and c not in index)
        if unknown:
            raise DataError(
                f"The {split} split of {name} has the class folder(s) {_listing(unknown)}, which train does not "
                f"have (train's classes: {_listing(class_names)}): the model would be scored on a class it never "
                "saw. Add those classes to train, or remove them from the split (check the folder names' spelling "
                "and letter case)."
            )
        files = [(item, index[c]) for c in sorted(classes) for item in classes[c]]
        if not files:
            raise DataError(
                f"The {split} split of {name} ({roots[split]}) is empty. Add images to it, or remove the "
                "folder so the recipe holds out part of train instead."
            )
        relative, missing = _relative_to(root), (-1, -1, -1)
        splits[split] = FolderSplit(
            split,
            root,
            [relative(p) for (p, _), _ in files],
            [k for _, k in files],
            [st[2:5] if st else missing for (_, st), _ in files],
        )
    return FolderScan(root, class_names, splits, skipped)
