"""Pictures of a run: a confusion-matrix heatmap, a grid of misclassified images, training curves.

Pure functions. The image builders return numpy ``(H, W, 3)`` uint8 arrays (ready for
``SummaryWriter.add_image(..., dataformats="HWC")`` or :func:`save_image_png`); ``save_curves_png``
writes a PNG. matplotlib (Agg backend, no display needed) is imported inside the functions, so
``import common.plots`` stays cheap. No pyplot global state is used: every figure is a standalone
``matplotlib.figure.Figure``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def _figure(width_in: float, height_in: float, dpi: int = 100):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _to_array(fig) -> np.ndarray:
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _text_image(text: str, width_in: float = 3.0, height_in: float = 1.0) -> np.ndarray:
    fig = _figure(width_in, height_in)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10)
    return _to_array(fig)


def confusion_matrix_image(confusion, class_names) -> np.ndarray:
    """Heatmap of a ``(C, C)`` confusion matrix (rows: true class, columns: predicted class).

    Cell colour is the row-normalised fraction (so every class is readable whatever its size);
    the text in each cell is the count (left out when C > 30, where it would not fit)."""
    counts = _as_numpy(confusion).astype(np.int64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"confusion must be a square (C, C) matrix, got shape {tuple(counts.shape)}")
    c = counts.shape[0]
    names = [str(n) for n in class_names] if class_names is not None else [str(i) for i in range(c)]
    if len(names) != c:
        raise ValueError(f"{len(names)} class names for a {c}x{c} confusion matrix")
    if c == 0:
        return _text_image("empty confusion matrix")
    fractions = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    total = int(counts.sum())
    accuracy = np.trace(counts) / total if total else float("nan")

    side = min(max(4.0, 0.45 * c + 2.0), 24.0)
    fig = _figure(side + 1.0, side)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    ticks = np.arange(c)
    label_size = 8 if c <= 20 else 6
    ax.set_xticks(ticks, labels=names, rotation=90 if c > 6 else 45, ha="center" if c > 6 else "right",
                  fontsize=label_size)
    ax.set_yticks(ticks, labels=names, fontsize=label_size)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix: {total} images, accuracy {accuracy:.4f}" if total
                 else "confusion matrix: no images")
    if c <= 30:
        size = 8 if c <= 12 else 6
        for i in range(c):
            for j in range(c):
                ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=size,
                        color="white" if fractions[i, j] > 0.5 else "black")
    fig.tight_layout()
    return _to_array(fig)


def misclassified_grid(images, labels, preds, class_names, max_images: int = 36) -> np.ndarray:
    """A grid of up to ``max_images`` images whose prediction is wrong, titled "true: X / pred: Y"
    with class names. ``images``: uint8 ``(N, C, H, W)`` with C = 1 or 3 (tensor or array).
    With nothing misclassified it returns a small image that says so."""
    images, labels, preds = _as_numpy(images), _as_numpy(labels).reshape(-1), _as_numpy(preds).reshape(-1)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
    if not len(images) == len(labels) == len(preds):
        raise ValueError(f"{len(images)} images, {len(labels)} labels and {len(preds)} predictions: "
                         "the counts must match")
    names = [str(n) for n in class_names]

    def name(i):
        return names[i] if 0 <= i < len(names) else str(i)

    wrong = np.flatnonzero(labels != preds)[:max(0, max_images)]
    if len(wrong) == 0:
        return _text_image("no misclassified images")
    n = len(wrong)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig = _figure(1.6 * cols, 1.8 * rows)
    for k, idx in enumerate(wrong):
        ax = fig.add_subplot(rows, cols, k + 1)
        img = images[idx]
        if img.shape[0] == 1:
            ax.imshow(img[0], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        else:
            ax.imshow(np.ascontiguousarray(img[:3].transpose(1, 2, 0)).astype(np.uint8), interpolation="nearest")
        ax.set_title(f"true: {name(int(labels[idx]))}\npred: {name(int(preds[idx]))}", fontsize=7)
        ax.axis("off")
    fig.tight_layout()
    return _to_array(fig)


def save_image_png(image: np.ndarray, path) -> Path:
    """Write an ``(H, W, 3)`` uint8 array (as returned above) to a PNG; returns the path."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(path)
    return path


def read_metrics(metrics_jsonl_path) -> list[dict]:
    """The records of a metrics.jsonl, skipping blank and unreadable lines (e.g. a line cut short by
    a crash), sorted by step."""
    records = []
    for line in Path(metrics_jsonl_path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            records.append(rec)
    return sorted(records, key=lambda r: r["step"])


def _series(records: list[dict], suffix: str) -> dict[str, tuple[list, list]]:
    """{key: (steps, values)} for every numeric key ending in ``suffix`` ("/loss", "/accuracy")."""
    out: dict[str, tuple[list, list]] = {}
    for rec in records:
        for key, value in rec.items():
            if key.endswith(suffix) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                steps, values = out.setdefault(key, ([], []))
                steps.append(rec["step"])
                values.append(value)
    return out


def save_curves_png(metrics_jsonl_path, out_png) -> Path:
    """Plot loss (train/loss, eval/loss, ...) and accuracy (eval/accuracy, ...) against the optimizer
    step from a run's metrics.jsonl, write ``out_png`` and return its path.

    Every key ending in ``/loss`` goes on the loss panel and every key ending in ``/accuracy`` on the
    accuracy panel, so missing keys just mean missing lines; a panel with no data says so."""
    records = read_metrics(metrics_jsonl_path)
    fig = _figure(11, 4)
    panels = (("loss", _series(records, "/loss")), ("accuracy", _series(records, "/accuracy")))
    prefixes = sorted({key.split("/", 1)[0] for _, series in panels for key in series},
                      key=lambda p: (p != "train", p != "eval", p))
    colors = {p: f"C{i % 10}" for i, p in enumerate(prefixes)}  # eval/loss and eval/accuracy share a colour
    for k, (title, series) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if not series:
            ax.text(0.5, 0.5, f"no {title} logged", ha="center", va="center", transform=ax.transAxes)
            continue
        for key in sorted(series, key=lambda s: (not s.startswith("train/"), s)):
            steps, values = series[key]
            few = len(steps) <= 20 or not key.startswith("train/")
            ax.plot(steps, values, label=key, color=colors[key.split("/", 1)[0]], marker="o" if few else None,
                    markersize=3, linewidth=1.0 if key.startswith("train/") else 1.5)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"run {Path(metrics_jsonl_path).resolve().parent.name} (train loss includes label smoothing, "
                 "eval loss does not)", fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png
