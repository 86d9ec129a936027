"""Pictures of a run: a confusion-matrix heatmap, a grid of misclassified images, training curves.

The image builders return numpy ``(H, W, 3)`` uint8 arrays (``SummaryWriter.add_image(..., dataformats="HWC")``,
:func:`png_bytes`, :func:`save_image_png`). The heatmap and the curves are matplotlib figures (its Agg canvas, no
pyplot global state; imported inside the functions so ``import common.train.plots`` stays cheap); the grid is
torchvision's ``make_grid`` with Pillow's captions, about a fifth of a figure's time on the main process while the
other processes wait.

What the pictures promise: the confusion matrix's heading names the split and its image count when the caller
passes ``title`` (``confusion_matrix_title(split, n)``); in the curves every evaluation point is drawn as a marker,
so a run with a single evaluation still shows it, and evaluations of different splits at the same step do not hide
each other.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import torch

from common.files import write_atomic


def _figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _text_image(text: str) -> np.ndarray:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (300, 100), "white")
    ImageDraw.Draw(image).text((20, 45), text, fill="black")
    return np.asarray(image).copy()


def confusion_matrix_title(split: str, n_images: int) -> str:
    """The heading that names the split, for :func:`confusion_matrix_image`'s ``title``."""
    return f"confusion matrix, {split} split ({n_images} images)"


def confusion_matrix_image(confusion, class_names, title: str | None = None) -> np.ndarray:
    """:func:`confusion_matrix_figure` drawn, as an ``(H, W, 3)`` array."""
    fig = confusion_matrix_figure(confusion, class_names, title)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def confusion_matrix_figure(confusion, class_names, title: str | None = None):
    """Heatmap of a ``(C, C)`` confusion matrix (rows: true class, columns: predicted). Cell colour is the
    row-normalised fraction (every class readable whatever its size), the text the count (left out past 30 classes,
    where it would not fit). ``title`` is the heading's first line (:func:`confusion_matrix_title`), the accuracy its
    second; without it the heading is ``"confusion matrix: N images, accuracy A"``."""
    counts = torch.as_tensor(confusion).cpu().numpy().astype(np.int64)
    c = len(counts)
    names = [str(n) for n in class_names]
    if counts.shape != (c, c) or len(names) != c:
        raise ValueError(f"a square confusion matrix with a name per class, got {counts.shape} and {len(names)} names")
    fractions = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    total = int(counts.sum())
    accuracy = f"accuracy {np.trace(counts) / total:.4f}" if total else "no images"
    side = min(max(4.0, 0.45 * c + 2.0), 24.0)
    fig = _figure(side + 1.0, side)
    ax = fig.add_subplot()
    im = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    small = 8 if c <= 20 else 6
    ax.set_xticks(range(c), labels=names, rotation=90 if c > 6 else 45, ha="center" if c > 6 else "right")
    ax.set_yticks(range(c), labels=names)
    ax.tick_params(labelsize=small)
    ax.set(xlabel="predicted", ylabel="true")
    ax.set_title(f"{title}\n{accuracy}" if title else f"confusion matrix: {total} images, {accuracy}")
    for i, j in np.ndindex(c, c) if c <= 30 else ():
        white = fractions[i, j] > 0.5
        ax.text(j, i, counts[i, j], ha="center", va="center", fontsize=small, color="white" if white else "black")
    fig.tight_layout()
    return fig


def misclassified_grid(images, labels, preds, class_names, max_images: int = 36) -> np.ndarray:
    """A grid of up to ``max_images`` images whose prediction is wrong, captioned "true: X / pred: Y" with class
    names. ``images``: uint8 ``(N, C, H, W)``, C = 1 or 3 (tensor or array), enlarged without smoothing to 120 pixels
    on their longer side (pixels stay visible, the aspect ratio is kept). Nothing wrong: a small image that says so."""
    from PIL import Image, ImageDraw
    from torchvision.utils import make_grid

    images, labels, preds = (torch.as_tensor(x).cpu() for x in (images, labels, preds))
    labels, preds = labels.reshape(-1), preds.reshape(-1)
    if images.ndim != 4 or not len(images) == len(labels) == len(preds):
        raise ValueError(f"(N, C, H, W) images with a label and prediction each, got {tuple(images.shape)}")
    wrong = (labels != preds).nonzero().flatten()[: max(0, max_images)]
    if not len(wrong):
        return _text_image("no misclassified images")
    band, side, cell_w = 44, 120, 160  # pixels: the caption above the image, the image's square, a cell's width
    h, w = (max(1, round(s * side / max(images.shape[-2:]))) for s in images.shape[-2:])
    cells = torch.full((len(wrong), 3, band + side, cell_w), 255, dtype=torch.uint8)
    top, left = band + (side - h) // 2, (cell_w - w) // 2
    cells[..., top : top + h, left : left + w] = torch.nn.functional.interpolate(
        images[wrong, :3].float(), size=(h, w), mode="nearest"
    ).to(torch.uint8)  # a grey image's one channel fills all three
    cols = math.ceil(math.sqrt(len(wrong)))
    grid = Image.fromarray(make_grid(cells, nrow=cols, padding=0, pad_value=255).permute(1, 2, 0).numpy())
    draw, names = ImageDraw.Draw(grid), [str(n) for n in class_names]
    name = lambda i: names[i] if 0 <= i < len(names) else str(i)
    for k, i in enumerate(wrong.tolist()):
        r, q = divmod(k, cols)
        caption = f"true: {name(int(labels[i]))}\npred: {name(int(preds[i]))}"
        draw.multiline_text((q * cell_w + 8, r * (band + side) + 6), caption, fill="black")
    return np.asarray(grid).copy()


def png_bytes(image: np.ndarray) -> bytes:
    """An ``(H, W, 3)`` uint8 array as PNG bytes: Pillow's encoding, as ``SummaryWriter.add_image``'s."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def save_image_png(image, path) -> Path:
    """An ``(H, W, 3)`` uint8 array, or PNG bytes, written to ``path`` whole or not at all (a killed run leaves no
    cut-off picture); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, image if isinstance(image, bytes) else png_bytes(image))
    return path


def read_metrics(metrics_jsonl_path) -> list[dict]:
    """The records of a metrics.jsonl by step, skipping blank and unreadable lines (a line cut short by a crash)."""
    records = []
    for line in Path(metrics_jsonl_path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            records.append(rec)
    return sorted(records, key=lambda r: r["step"])


# what the run logs of its own beyond loss and accuracy (the LR, throughput, memory, timing, per-class accuracy):
# left out of curves.png's third panel, which shows the scalars the loop logs (the gradient norm, metrics of its own)
RUN_OWN = ("train/lr", "train/samples_per_sec", "train/data_wait_fraction", "train/peak_memory_mb")
# Series with at most this many points get a marker at every point: a line through one point draws nothing.
FEW_POINTS = 20
# Marker shapes per evaluated split (eval, then test/val/... alphabetically), hollow and shrinking, so that points of
# different splits at the same step (the last evaluation and the test one usually share it) stay visible.
MARKERS = ("o", "s", "D", "^", "v", "P")


def _series(records: list[dict], suffix: str | None) -> dict[str, tuple[list, list]]:
    """{key: (steps, values)} of the finite numbers whose key ends in ``suffix``; None: the loop's own scalars."""
    out: dict[str, tuple[list, list]] = {}
    for rec in records:
        for key, value in rec.items():
            if suffix is None:
                wanted = key not in ("step", "time", *RUN_OWN) and "/accuracy_class/" not in key
                wanted = wanted and not key.endswith(("/loss", "/accuracy", "_time", "_seconds"))
            else:
                wanted = key.endswith(suffix)
            if wanted and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps, values = out.setdefault(key, ([], []))
                steps.append(rec["step"])
                values.append(value)
    return out


def curves_figure(records: list[dict], title: str = ""):
    """Loss and accuracy against the optimizer step from metrics records (``read_metrics``): every key ending in
    ``/loss`` on one panel, in ``/accuracy`` on the other (a panel with no data says so), the loop's own scalars
    (``train/grad_norm``, ...) on a third, one colour each. Evaluation series always have markers, train series when
    they have at most ``FEW_POINTS`` points."""
    panels = [("loss", _series(records, "/loss")), ("accuracy", _series(records, "/accuracy"))]
    if own := _series(records, None):
        panels.append(("logged by the loop", own))
    fig = _figure(5.5 * len(panels), 4)
    prefixes = sorted(
        {key.split("/", 1)[0] for _, series in panels[:2] for key in series},
        key=lambda p: (p != "train", p != "eval", p),
    )
    colors = {p: f"C{i % 10}" for i, p in enumerate(prefixes)}  # eval/loss and eval/accuracy share a colour
    evals = [p for p in prefixes if p != "train"]
    for k, (name, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        ax.set(title=name, xlabel="optimizer step")
        if not series:
            ax.text(0.5, 0.5, f"no {name} logged", ha="center", va="center", transform=ax.transAxes)
            continue
        for j, key in enumerate(sorted(series, key=lambda s: (not s.startswith("train/"), s))):
            steps, values = series[key]
            prefix = key.split("/", 1)[0]
            color = colors.get(prefix, "C0") if k < 2 else f"C{j % 10}"
            style = dict(label=key, color=color, linewidth=1.0 if prefix == "train" else 1.5)
            if prefix == "train" and len(steps) <= FEW_POINTS:
                style.update(marker="o", markersize=4)
            elif prefix in evals:
                rank = evals.index(prefix)
                style.update(marker=MARKERS[rank % len(MARKERS)], markersize=max(4.0, 10.0 - 2.5 * rank))
                many = len(steps) > FEW_POINTS
                style.update(markerfacecolor=colors[prefix] if many else "none", markeredgewidth=0.5 if many else 1.5)
                if many:
                    style.update(markersize=3.0)
            ax.plot(steps, values, **style)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def curves_png(metrics_jsonl_path) -> bytes:
    """curves.png of a run's metrics.jsonl, as PNG bytes (:func:`curves_figure`)."""
    run = Path(metrics_jsonl_path).resolve().parent.name
    fig = curves_figure(
        read_metrics(metrics_jsonl_path), f"run {run} (train loss includes label smoothing, eval loss does not)"
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_curves_png(metrics_jsonl_path, out_png) -> Path:
    """:func:`curves_png` written to ``out_png``; returns its path."""
    return save_image_png(curves_png(metrics_jsonl_path), out_png)
