"""A table's label column read as classes, by the rules an image folder's classes follow (``common.data.folders``):
a ClassLabel's names, integer labels 0..K-1, or the distinct values as names; every class with training rows, and
two or more. Used by the decoded recipes' tables (``common.data.decoded``) and the photo recipe's
(``common.data.photo_tables``)."""

from __future__ import annotations

from common.data.folders import _listing
from common.errors import DataError


def class_names_of(train, lab_col: str, name: str = "the dataset", columns: dict | None = None):
    """(class names, {label value: class index} or None when the values are the indices) of a table's train split,
    by the rules folders follow: ``table_classes``, every other split's labels among train's, ``check_trained``.
    ``columns``: {split name: its label column as a list}, train's among them, when the caller has read them (else
    train's is read here)."""
    columns = columns or {"train": list(train[lab_col])}
    for split_name, labels in columns.items():
        if None in labels:
            raise DataError(
                f"Row {labels.index(None)} of the {split_name} split of {name} has no label (column {lab_col!r} is "
                "empty there). Fill in its label, or remove the row, and run again."
            )
    column = columns["train"]
    class_names, index = table_classes(train.features[lab_col], column, lab_col, name)
    known = set(column)  # the label values train has rows of
    trained = class_names if index is not None else [c for k, c in enumerate(class_names) if k in known]

    def shown(value) -> str:  # a ClassLabel's value by its name
        named = index is None and type(value) is int and 0 <= value < len(class_names)
        return repr(class_names[value] if named else value)

    for split_name, labels in columns.items():
        unknown = sorted({v for v in labels if v not in known}, key=repr)
        if unknown:
            first = next(i for i, v in enumerate(labels) if v not in known)
            raise DataError(
                f"The {split_name} split of {name} has rows of the label{'s' if len(unknown) > 1 else ''} "
                f"{_listing(map(shown, unknown))}, which train does not have (the first at row {first}): outside the "
                f"{len(trained)} classes found in train ({_listing(trained)}), the model would be scored on a class "
                "it never saw. Add those classes to train, or remove their rows from the "
                f"{split_name} split (check the labels' spelling, or fix the label column)."
            )
    check_trained(class_names, trained, name)
    return class_names, index


def table_classes(feature, train: list, lab_col: str, name: str) -> tuple[list[str], dict | None]:
    """(class names, {label value: class index} or None when the values are the indices) of the training labels:
    a ClassLabel's names, integer labels 0..K-1 (a gap, or a huge label, would make classes with no training row:
    refused), or the sorted distinct values as names."""
    from datasets import ClassLabel

    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        odd = sorted({v for v in train if type(v) is not int or not 0 <= v < len(names)}, key=repr)
        if odd:
            raise DataError(
                f"The train split of {name} has the label(s) {_listing(map(repr, odd))} in column {lab_col!r}, "
                f"outside the {len(names)} names of its ClassLabel: the labels index those names. Fix the label "
                "column (or the ClassLabel's names), and run again."
            )
        return names, None
    distinct = set(train)
    if all(type(v) is int for v in distinct):
        values = sorted(distinct)
        if values[0] < 0:
            raise DataError(
                f"Label column {lab_col!r} holds negative labels ({values[0]}). Labels must be "
                "0..num_classes-1 or class-name strings."
            )
        if values[-1] != len(values) - 1:
            raise DataError(
                f"The integer labels of {name} (column {lab_col!r}) in train are {_listing(map(str, values))}, not "
                f"0..{len(values) - 1}: read as class indices they would make {values[-1] + 1:,} classes, "
                f"{values[-1] + 1 - len(values):,} of them with no training row (an output the model never sees "
                f"trained). Renumber the labels 0..{len(values) - 1}, or give the column the class names (a "
                "ClassLabel, or the names as strings), and run again."
            )
        return [str(v) for v in values], None
    values = sorted(distinct, key=lambda v: (str(type(v)), v))
    return [str(v) for v in values], {v: i for i, v in enumerate(values)}


def check_trained(class_names: list[str], trained: list[str], name: str) -> None:
    """Every class has training rows (a ClassLabel's name with none would be an output never trained), and there are
    two or more: the rules an image folder's classes follow."""
    seen = set(trained)
    unseen = [c for c in class_names if c not in seen]
    if unseen:
        raise DataError(
            f"The class(es) {_listing(unseen)} of {name} (names of its label column's ClassLabel) have no row in "
            "train: the model would have an output for a class it never sees. Add training rows for them, or remove "
            "them from the ClassLabel's names, and run again."
        )
    if len(class_names) < 2:
        raise DataError(
            f"{name} has a single class ({class_names[0]!r}) in train: a classifier needs at least two. Add the "
            "rows of the other classes to train."
        )
