"""Exact distributed evaluation and the metrics derived from it.

Every rank evaluates its shard; ``gather_for_metrics`` collects per-sample predictions, labels and
losses and drops the samples Accelerate duplicated to even out the last batch, so the count equals
the size of the eval set on any number of processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(accelerator, model, loader, transform, num_classes: int, tta_flip: bool = False,
             desc: str = "eval") -> dict | None:
    """Loss, accuracy, per-class accuracy and the confusion matrix over the whole split, exactly once per
    image on any number of processes. ``loader`` None (no such split) gives None."""
    if loader is None:
        return None
    from tqdm.auto import tqdm

    from common.tracking import on_terminal

    import time

    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    preds, labels_all, losses = [], [], []
    for images, labels in tqdm(loader, desc=desc, disable=not on_terminal(accelerator), leave=False):
        x = transform.eval(images)
        with accelerator.autocast():  # the run's precision also for a model prepare() did not wrap (the EMA)
            logits = model(x).float()
            if tta_flip:  # average the logits of the image and its mirror image
                logits = 0.5 * (logits + model(x.flip(3)).float())
        loss = F.cross_entropy(logits, labels, reduction="none")
        pred, labels, loss = accelerator.gather_for_metrics((logits.argmax(1), labels, loss))
        preds.append(pred.cpu())
        labels_all.append(labels.cpu())
        losses.append(loss.cpu())
    model.train(was_training)
    if not labels_all:
        return {"loss": float("nan"), "accuracy": float("nan"), "count": 0}
    metrics = summarize(torch.cat(preds), torch.cat(labels_all), torch.cat(losses), num_classes)
    return {**metrics, "seconds": time.perf_counter() - t0}


def summarize(preds: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor, num_classes: int) -> dict:
    confusion = confusion_matrix(preds, labels, num_classes)
    per_class_total = confusion.sum(1)
    per_class_acc = confusion.diag().double() / per_class_total.clamp_min(1)
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
