"""Exact distributed evaluation and the metrics derived from it.

Every rank evaluates its shard; ``gather_for_metrics`` collects per-sample predictions, labels and
losses and drops the samples Accelerate duplicated to even out the last batch, so the count equals
the size of the eval set on any number of processes."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from common.data.damaged import SKIPPED, unpack
from common.errors import DataError
from common.train.sharding import share_buffers
from common.train.tracking import on_terminal


def tta_logits(model, x: torch.Tensor, level: int = 0) -> torch.Tensor:
    """Test-time augmentation (airbench's levels). 0: the image alone. 1: the mean of the image's and its
    mirror image's logits. 2: half of that, plus half the mean over the two images shifted by one pixel
    (up-left and down-right, edges reflected) and their mirrors: 6 views. In the paper's ablation level 2
    cut the epochs to 94% by about 7%."""

    def with_mirror(v):
        return 0.5 * (model(v).float() + model(v.flip(3)).float())

    if not level:
        return model(x).float()
    logits = with_mirror(x)
    if level == 1:
        return logits
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = 0.5 * (with_mirror(padded[..., :h, :w]) + with_mirror(padded[..., 2:, 2:]))
    return 0.5 * logits + 0.5 * shifted


@torch.no_grad()
def evaluate(accelerator, model, loader, transform, num_classes: int, tta: int = 0) -> dict | None:
    """Loss, accuracy (and top-5 accuracy with more than ``TOP_K`` classes), per-class accuracy and the confusion
    matrix over the whole split, exactly once per image on any number of processes; a damaged photo is left out
    (``damaged``: how many). ``loader`` None (no such split) gives None."""
    if loader is None:
        return None
    t0 = time.perf_counter()
    share_buffers(accelerator, model)  # FSDP2: every process evaluates the same BatchNorm statistics
    was_training = model.training
    model.eval()
    preds, labels_all, losses, in_top = [], [], [], []
    top = num_classes > TOP_K
    for batch in tqdm(loader, desc="eval", disable=not on_terminal(accelerator), leave=False):
        images, labels = unpack(loader, batch)  # a damaged photo's row: label SKIPPED (common.data.damaged)
        x = transform.eval(images)
        with accelerator.autocast():  # the run's precision also for a model prepare() did not wrap
            logits = tta_logits(model, x, tta)
        loss = F.cross_entropy(logits, labels, reduction="none")
        hits = ((logits.topk(TOP_K, dim=1).indices == labels[:, None]).any(1),) if top else ()
        pred, labels, loss, *hits = accelerator.gather_for_metrics((logits.argmax(1), labels, loss, *hits))
        preds.append(pred)  # kept on the device: one copy to the host at the end, not three per batch
        labels_all.append(labels)
        losses.append(loss)
        in_top.extend(hits)
    model.train(was_training)
    labels = torch.cat(labels_all).cpu() if labels_all else torch.zeros(0, dtype=torch.int64)
    scored = labels != SKIPPED
    if not scored.any():  # the same on every rank (gathered): every rank says it
        raise DataError(
            f"None of the {labels.numel()} photos of this evaluation could be read: every one is damaged (the "
            "warnings above name them), so there is nothing to score. Replace those files, or remove them and start "
            "a new run (a resume refuses a folder whose files changed)."
        )
    preds = torch.cat(preds).cpu()
    metrics = summarize(preds[scored], labels[scored], torch.cat(losses).cpu()[scored], num_classes)
    if top:
        metrics["top5_accuracy"] = torch.cat(in_top).cpu()[scored].double().mean().item()
    if not scored.all():  # the rows stay in place (positions in the split): labels SKIPPED where not scored
        metrics.update(damaged=int((~scored).sum()), preds=preds, labels=labels)
    return {**metrics, "seconds": time.perf_counter() - t0}


TOP_K = 5  # top-5 accuracy, reported (and selectable by --monitor) where there are more classes than this
CONFUSION_MAX_CLASSES = 100  # a heatmap with more rows than this is no longer readable, and costs C^2


def summarize(preds: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor, num_classes: int) -> dict:
    """Per-class accuracy in time and memory linear in the classes; the confusion matrix only up to
    ``CONFUSION_MAX_CLASSES`` (None beyond: 100,000 classes would be an 80 GB matrix)."""
    labels, preds = labels.long(), preds.long()
    per_class_total = torch.bincount(labels, minlength=num_classes)
    per_class_correct = torch.bincount(labels[preds == labels], minlength=num_classes)
    per_class_acc = per_class_correct.double() / per_class_total.clamp_min(1)
    confusion = confusion_matrix(preds, labels, num_classes) if num_classes <= CONFUSION_MAX_CLASSES else None
    return {
        "loss": losses.double().mean().item(),
        "accuracy": (preds == labels).double().mean().item(),
        "count": labels.numel(),
        "per_class_accuracy": per_class_acc.tolist(),
        "confusion": confusion,
        "preds": preds,
        "labels": labels,
    }


def confusion_matrix(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Rows: true class, columns: predicted class."""
    idx = labels.long() * num_classes + preds.long()
    return torch.bincount(idx, minlength=num_classes * num_classes).view(num_classes, num_classes)
