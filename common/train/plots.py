"""Pictures of a run: a confusion-matrix heatmap, a grid of misclassified images, training curves.

Pure functions. The image builders return numpy ``(H, W, 3)`` uint8 arrays (ready for
``SummaryWriter.add_image(..., dataformats="HWC")``, :func:`png_bytes` or :func:`save_image_png`);
``save_curves_png`` writes a PNG (files are written whole or not at all); ``confusion_matrix_figure`` and
``curves_figure`` return the matplotlib Figure behind them. The training run draws them for its final evaluation
and for evaluations its loop asks pictures of. matplotlib (Agg backend, no display needed) is imported inside the
functions, so ``import common.train.plots`` stays cheap. No pyplot global state is used: every figure is a
standalone ``matplotlib.figure.Figure``.

What the pictures promise: the confusion matrix's heading names the split and its image count when
the caller passes ``title`` (``confusion_matrix_title(split, n)``); in the curves every evaluation
point is drawn as a marker, so a run with a single evaluation still shows it, and evaluations of
different splits at the same step do not hide each other.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np

from common.files import write_atomic


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


def _text_figure(text: str, width_in: float = 3.0, height_in: float = 1.0):
    fig = _figure(width_in, height_in)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10)
    return fig


def _text_image(text: str) -> np.ndarray:
    return _to_array(_text_figure(text))


def confusion_matrix_image(confusion, class_names, title: str | None = None) -> np.ndarray:
    """Heatmap of a ``(C, C)`` confusion matrix (rows: true class, columns: predicted class).

    Cell colour is the row-normalised fraction (so every class is readable whatever its size);
    the text in each cell is the count (left out when C > 30, where it would not fit).
    ``title`` is the heading's first line, e.g. ``"confusion matrix, test split (10000 images)"``
    (see :func:`confusion_matrix_title`); the accuracy goes on a second line. Without it the heading
    is ``"confusion matrix: N images, accuracy A"``, which does not say which split it shows."""
    return _to_array(confusion_matrix_figure(confusion, class_names, title))


def confusion_matrix_title(split: str, n_images: int) -> str:
    """The heading that names the split, for :func:`confusion_matrix_image`'s ``title``."""
    return f"confusion matrix, {split} split ({n_images} images)"


def confusion_matrix_figure(confusion, class_names, title: str | None = None):
    """The matplotlib Figure behind :func:`confusion_matrix_image` (a text image when C == 0)."""
    counts = _as_numpy(confusion).astype(np.int64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"confusion must be a square (C, C) matrix, got shape {tuple(counts.shape)}")
    c = counts.shape[0]
    names = [str(n) for n in class_names] if class_names is not None else [str(i) for i in range(c)]
    if len(names) != c:
        raise ValueError(f"{len(names)} class names for a {c}x{c} confusion matrix")
    if c == 0:
        return _text_figure("empty confusion matrix")
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
    ax.set_xticks(
        ticks, labels=names, rotation=90 if c > 6 else 45, ha="center" if c > 6 else "right", fontsize=label_size
    )
    ax.set_yticks(ticks, labels=names, fontsize=label_size)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if title is None:
        ax.set_title(
            f"confusion matrix: {total} images, accuracy {accuracy:.4f}" if total else "confusion matrix: no images"
        )
    else:
        ax.set_title(f"{title}\naccuracy {accuracy:.4f}" if total else f"{title}\nno images")
    if c <= 30:
        size = 8 if c <= 12 else 6
        for i in range(c):
            for j in range(c):
                ax.text(
                    j,
                    i,
                    str(counts[i, j]),
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="white" if fractions[i, j] > 0.5 else "black",
                )
    fig.tight_layout()
    return fig


def misclassified_grid(images, labels, preds, class_names, max_images: int = 36) -> np.ndarray:
    """A grid of up to ``max_images`` images whose prediction is wrong, titled "true: X / pred: Y"
    with class names. ``images``: uint8 ``(N, C, H, W)`` with C = 1 or 3 (tensor or array).
    With nothing misclassified it returns a small image that says so."""
    images, labels, preds = _as_numpy(images), _as_numpy(labels).reshape(-1), _as_numpy(preds).reshape(-1)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
    if not len(images) == len(labels) == len(preds):
        raise ValueError(
            f"{len(images)} images, {len(labels)} labels and {len(preds)} predictions: the counts must match"
        )
    names = [str(n) for n in class_names]

    def name(i):
        return names[i] if 0 <= i < len(names) else str(i)

    wrong = np.flatnonzero(labels != preds)[: max(0, max_images)]
    if len(wrong) == 0:
        return _text_image("no misclassified images")
    # The titles are drawn as text on one figure and the images pasted into its pixels afterwards. (A
    # matplotlib subplot per image took about 1 s per evaluation for 36 images, on the main process while
    # the other processes waited; this takes about a fifth of that.)
    n = len(wrong)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    cell_w, cell_h, side, band = 160, 180, 120, 44  # pixels: cell, image side, title band above the image
    width, height = cols * cell_w, rows * cell_h
    fig = _figure(width / 100, height / 100)  # 100 dpi: one figure pixel per array pixel
    places = []
    for k, idx in enumerate(wrong):
        r, q = divmod(k, cols)
        y, x = r * cell_h + band, q * cell_w + (cell_w - side) // 2
        fig.text(
            (q + 0.5) * cell_w / width,
            1 - (y - 4) / height,
            f"true: {name(int(labels[idx]))}\npred: {name(int(preds[idx]))}",
            ha="center",
            va="bottom",
            fontsize=9,
        )
        places.append((y, x, idx))
    grid = _to_array(fig)
    for y, x, idx in places:
        cell = _cell_image(images[idx], side)
        h, w = cell.shape[:2]
        top, left = y + (side - h) // 2, x + (side - w) // 2
        grid[top : top + h, left : left + w] = cell
    return grid


def _cell_image(img: np.ndarray, side: int) -> np.ndarray:
    """A ``(C, H, W)`` uint8 image (C = 1 or 3) as RGB, its longer edge resized to ``side`` pixels without
    smoothing (pixels stay visible, the aspect ratio is kept)."""
    from PIL import Image

    hwc = np.ascontiguousarray(img[:3].transpose(1, 2, 0)).astype(np.uint8)
    if hwc.shape[2] == 1:
        hwc = np.repeat(hwc, 3, axis=2)
    h, w = hwc.shape[:2]
    scale = side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(hwc).resize(size, Image.NEAREST))


def png_bytes(image: np.ndarray) -> bytes:
    """An ``(H, W, 3)`` uint8 array (as returned above) as PNG bytes (what ``SummaryWriter.add_image`` writes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def save_image_png(image, path) -> Path:
    """Write an ``(H, W, 3)`` uint8 array (as returned above), or PNG bytes, to a PNG file, whole or not at all (a
    temp file renamed: a killed run leaves no cut-off picture); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, image if isinstance(image, bytes) else png_bytes(image))
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


# what the run logs of its own beyond loss and accuracy (the LR, throughput, memory, timing, per-class accuracy):
# left out of curves.png's third panel, which shows the scalars the loop logs (the gradient norm, metrics of its own)
RUN_OWN = ("train/lr", "train/samples_per_sec", "train/data_wait_fraction", "train/peak_memory_mb")


def _loops_own(key: str) -> bool:
    return (
        key not in ("step", "time")
        and key not in RUN_OWN
        and not key.endswith(("/loss", "/accuracy", "_time", "_seconds"))
        and "/accuracy_class/" not in key
    )


def _series(records: list[dict], suffix: str | None) -> dict[str, tuple[list, list]]:
    """{key: (steps, values)} for every numeric key ending in ``suffix`` ("/loss", "/accuracy"); None: the loop's own
    scalars (``_loops_own``)."""
    out: dict[str, tuple[list, list]] = {}
    for rec in records:
        for key, value in rec.items():
            if (
                (key.endswith(suffix) if suffix is not None else _loops_own(key))
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                steps, values = out.setdefault(key, ([], []))
                steps.append(rec["step"])
                values.append(value)
    return out


# Series with at most this many points get a marker at every point: a line through one point draws
# nothing, and a handful of evaluations are easier to read as points.
FEW_POINTS = 20
# Marker shapes per series prefix after "train" (eval, then test/val/... alphabetically). Hollow, in
# shrinking sizes, so that points of different series at the same step (the last evaluation and the
# test evaluation usually share it) stay visible inside each other instead of hiding each other.
MARKERS = ("o", "s", "D", "^", "v", "P")


def curves_figure(records: list[dict], title: str = ""):
    """The matplotlib Figure behind :func:`save_curves_png`, from metrics records (``read_metrics``)."""
    panels = [("loss", _series(records, "/loss")), ("accuracy", _series(records, "/accuracy"))]
    own = _series(records, None)
    if own:  # the scalars the loop logs besides loss and accuracy (train/grad_norm, yours)
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
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        if not series:
            ax.text(0.5, 0.5, f"no {name} logged", ha="center", va="center", transform=ax.transAxes)
            continue
        for j, key in enumerate(sorted(series, key=lambda s: (not s.startswith("train/"), s))):
            steps, values = series[key]
            prefix = key.split("/", 1)[0]
            color = colors.get(prefix, "C0") if k < 2 else f"C{j % 10}"  # the loop's own: one colour each
            style = dict(label=key, color=color, linewidth=1.0 if prefix == "train" else 1.5)
            if prefix == "train":
                if len(steps) <= FEW_POINTS:
                    style.update(marker="o", markersize=4)
            elif prefix in evals:
                rank = evals.index(prefix)
                style.update(
                    marker=MARKERS[rank % len(MARKERS)],
                    markersize=max(4.0, 10.0 - 2.5 * rank),
                    markerfacecolor="none",
                    markeredgewidth=1.5,
                )
                if len(steps) > FEW_POINTS:
                    style.update(markersize=3.0, markerfacecolor=colors[prefix], markeredgewidth=0.5)
            ax.plot(steps, values, **style)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def save_curves_png(metrics_jsonl_path, out_png) -> Path:
    """Plot loss (train/loss, eval/loss, ...) and accuracy (eval/accuracy, ...) against the optimizer
    step from a run's metrics.jsonl, write ``out_png`` and return its path.

    Every key ending in ``/loss`` goes on the loss panel and every key ending in ``/accuracy`` on the
    accuracy panel, so missing keys just mean missing lines; a panel with no data says so. The scalars the loop logs
    besides them (``train/grad_norm``, metrics of its own) get a third panel, one colour each. Evaluation
    series always have markers (a single evaluation is a visible point), train series when they have
    at most ``FEW_POINTS`` points."""
    return save_image_png(curves_png(metrics_jsonl_path), out_png)


def curves_png(metrics_jsonl_path) -> bytes:
    """The picture ``save_curves_png`` writes, as PNG bytes."""
    records = read_metrics(metrics_jsonl_path)
    fig = curves_figure(
        records,
        f"run {Path(metrics_jsonl_path).resolve().parent.name} (train loss includes "
        "label smoothing, eval loss does not)",
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
