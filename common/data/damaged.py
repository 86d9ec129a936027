"""Damaged photos (cut short, not an image, a decompression bomb): timm's policy, with the count said.

A photo a DataLoader worker cannot read is skipped, and the process that trains on the batch warns once per photo,
naming it and why. In training another photo of the split takes its place in the batch (drawn at random, seeded;
timm's ``ImageDataset`` takes the next one, which hands a whole damaged class folder's places to the next class), so
every batch keeps its size; in evaluation it is left out of the scores (the evaluation's ``count`` says how many
photos were scored). Past ``--max-damaged`` (a share of the photos a process reads, 1% by default) the run stops at
the next optimizer step, in one paragraph naming them; summary.json lists those met (``damaged_photos``).

The loader's batches carry the damaged photos met as a third item, ``[(file, reason), ...]`` (usually empty), which
``unpack`` hands to the split's tally; an evaluation row without its photo has the label ``SKIPPED``
(``cross_entropy``'s ``ignore_index``), left out by ``common.train.metrics.evaluate``.
"""

from __future__ import annotations

import sys

import torch

from common.errors import DataError

SKIPPED = -100  # the label of an evaluation row whose photo could not be read: cross_entropy's ignore_index
SHOWN = 10


class DamagedPhotos:
    """The damaged photos one process met, in order. Past ``share`` of the photos one process reads (``total`` over
    the processes), ``poll()`` (asked at every optimizer step by the run's stop flag) returns an error: the run then
    stops at the next step every rank agrees on, and ``stop_error`` (every rank, at that step) names every rank's."""

    def __init__(self, total: int, share: float, processes: int = 1):
        self.found: dict[str, str] = {}  # file -> why it could not be read
        self.total, self.share, self.processes = total, share, max(1, processes)
        self.limit = share * total / self.processes

    def met(self, damaged) -> None:
        for where, reason in damaged:
            if where not in self.found:
                self.found[where] = reason
                print(f"warning: skipped a damaged photo, {where} ({reason})", file=sys.stderr, flush=True)

    def poll(self) -> DataError | None:
        return self._error() if len(self.found) > self.limit else None

    def stop_error(self, accelerator) -> DataError | None:
        """The error every rank raises when any rank met more damaged photos than its share allows, naming every
        rank's (a collective: every rank calls it at the step the run stops); None otherwise."""
        return self._error() if self.gather(accelerator) else None

    def gather(self, accelerator) -> bool:
        """Every process's damaged photos in each one's tally (a collective, on every rank); True when any process
        met more than its share allows."""
        from accelerate.utils import gather_object

        over = False
        for found in gather_object([self.found]) if accelerator.num_processes > 1 else [self.found]:
            over = over or len(found) > self.limit
            for where, reason in found.items():
                self.found.setdefault(where, reason)
        return over

    def _error(self) -> DataError:
        found = self.found
        shown = "; ".join(f"{f} ({r})" for f, r in list(found.items())[:SHOWN])
        more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        per = f" each of the {self.processes} processes reads" if self.processes > 1 else ""
        return DataError(
            f"{len(found)} damaged photo{'s' if len(found) > 1 else ''} met, more than --max-damaged {self.share:g} "
            f"of the {self.total / self.processes:,.0f} photos{per} allows: {shown}{more}. Remove or replace those "
            "files and start the run again (a resume refuses a folder whose files changed), or raise --max-damaged to "
            "train without them."
        )

    def listing(self) -> dict:
        """What summary.json records."""
        return {"count": len(self.found), "files": [{"file": f, "reason": r} for f, r in self.found.items()]}


def unpack(loader, batch):
    """``(images, labels)`` of a loader's batch; a photo loader's third item (the damaged photos met) goes to the
    tally of its dataset's split."""
    if len(batch) == 2:
        return batch
    images, labels, damaged = batch
    tally = getattr(getattr(getattr(loader, "dataset", None), "split", None), "damaged", None)
    if damaged and tally is not None:
        tally.met(damaged)
    return images, labels


def collate(samples):
    """``(images, labels, damaged)`` of ``(image, label, None or (file, reason))`` samples."""
    images = torch.stack([s[0] for s in samples])
    labels = torch.stack([torch.as_tensor(s[1], dtype=torch.int64) for s in samples])
    return images, labels, [s[2] for s in samples if s[2] is not None]
