"""common.train.plots: image dtypes/shapes, the no-mistakes case, curves from a metrics.jsonl, a confusion
matrix that names its split, evaluation points that stay visible."""

from __future__ import annotations

import json

import numpy as np
import torch
from matplotlib.colors import to_rgb

from common.train.metrics import confusion_matrix
from common.train.plots import (
    confusion_matrix_figure,
    confusion_matrix_image,
    confusion_matrix_title,
    curves_figure,
    misclassified_grid,
    read_metrics,
    save_curves_png,
    save_image_png,
)


def is_rgb_image(img) -> bool:
    return (
        isinstance(img, np.ndarray)
        and img.dtype == np.uint8
        and img.ndim == 3
        and img.shape[2] == 3
        and img.shape[0] > 20
        and img.shape[1] > 20
    )


def test_confusion_matrix_image(tmp_path):
    preds = torch.tensor([0, 1, 2, 2, 1, 0, 2])
    labels = torch.tensor([0, 1, 2, 1, 1, 2, 2])
    img = confusion_matrix_image(confusion_matrix(preds, labels, 3), ["cat", "dog", "bird"])
    assert is_rgb_image(img)
    assert img.std() > 0  # not a blank canvas
    assert save_image_png(img, tmp_path / "cm.png").stat().st_size > 0


def test_confusion_matrix_names_its_split():
    preds = torch.tensor([0, 1, 2, 2, 1, 0, 2])
    labels = torch.tensor([0, 1, 2, 1, 1, 2, 2])
    conf = confusion_matrix(preds, labels, 3)
    title = confusion_matrix_title("test", 7)
    assert title == "confusion matrix, test split (7 images)"
    heading = confusion_matrix_figure(conf, ["cat", "dog", "bird"], title=title).axes[0].get_title()
    assert heading == "confusion matrix, test split (7 images)\naccuracy 0.7143"
    # the default heading is unchanged for callers that pass no title
    assert (
        confusion_matrix_figure(conf, ["cat", "dog", "bird"]).axes[0].get_title()
        == "confusion matrix: 7 images, accuracy 0.7143"
    )
    titled = confusion_matrix_image(conf, ["cat", "dog", "bird"], title=title)
    assert is_rgb_image(titled)
    assert not np.array_equal(titled, confusion_matrix_image(conf, ["cat", "dog", "bird"]))


def test_confusion_matrix_image_many_classes():
    conf = torch.randint(0, 50, (40, 40))
    assert is_rgb_image(confusion_matrix_image(conf, [f"class_{i}" for i in range(40)]))


def test_misclassified_grid_gray_and_rgb():
    labels = torch.tensor([0, 1, 2, 1, 0])
    preds = torch.tensor([0, 2, 2, 0, 1])
    gray = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    rgb = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    names = ["cat", "dog", "bird"]
    for images in (gray, rgb, rgb.numpy()):
        img = misclassified_grid(images, labels, preds, names)
        assert is_rgb_image(img)
    small = misclassified_grid(rgb, labels, preds, names, max_images=1)
    assert small.shape[0] * small.shape[1] < img.shape[0] * img.shape[1]
    # the images themselves are in the grid, enlarged with their aspect ratio kept: a flat 20x10 image
    # of one colour becomes a 2:1 block of that colour
    flat = torch.zeros(5, 3, 20, 10, dtype=torch.uint8)
    flat[1] = torch.tensor([10, 200, 30], dtype=torch.uint8).view(3, 1, 1)
    block = np.argwhere((misclassified_grid(flat, labels, preds, names) == [10, 200, 30]).all(axis=2))
    (top, left), (bottom, right) = block.min(0), block.max(0)
    assert bottom - top + 1 == 2 * (right - left + 1) >= 40 and len(block) == (bottom - top + 1) * (right - left + 1)


def test_misclassified_grid_none_wrong():
    labels = torch.tensor([0, 1, 2])
    img = misclassified_grid(torch.zeros(3, 1, 8, 8, dtype=torch.uint8), labels, labels.clone(), ["a", "b", "c"])
    assert is_rgb_image(img)


def test_save_curves_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "time": 1.0 + s, "train/loss": 2.0 / s, "train/lr": 0.01} for s in range(10, 410, 10)]
    lines += [
        {"step": 200, "eval/loss": 0.4, "eval/accuracy": 0.9},
        {"step": 400, "eval/loss": 0.3, "eval/accuracy": 0.95},
        {"step": 400, "test/loss": 0.31, "test/accuracy": 0.94},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 41')  # a line cut short by a crash
    assert len(read_metrics(path)) == len(lines)
    out = save_curves_png(path, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_curves_png_missing_keys(tmp_path):
    only_train = tmp_path / "a.jsonl"
    only_train.write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    assert save_curves_png(only_train, tmp_path / "a.png").is_file()
    empty = tmp_path / "b.jsonl"
    empty.write_text("")
    assert save_curves_png(empty, tmp_path / "b.png").is_file()


def pixels_of(fig, ax, color: str) -> int:
    """Pixels of ``color`` inside ``ax``'s plotting area, leaving out its legend."""
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    height = img.shape[0]
    ys, xs = np.nonzero(np.abs(img - np.array(to_rgb(color)) * 255).max(-1) < 40)
    ys = height - ys  # display coordinates start at the bottom
    box, legend = ax.get_window_extent(), ax.get_legend().get_window_extent()
    inside = (xs > box.x0) & (xs < box.x1) & (ys > box.y0) & (ys < box.y1)
    in_legend = (xs >= legend.x0) & (xs <= legend.x1) & (ys >= legend.y0) & (ys <= legend.y1)
    return int((inside & ~in_legend).sum())


def test_single_evaluation_point_stays_visible():
    """A one-evaluation run: the eval point and the test point share the last step and must both show."""
    records = [{"step": s, "train/loss": 2.0 / s} for s in range(5, 105, 5)]
    records += [
        {"step": 100, "eval/loss": 0.5, "eval/accuracy": 0.9},
        {"step": 100, "test/loss": 0.5, "test/accuracy": 0.9},
    ]
    fig = curves_figure(records)
    loss_ax, acc_ax = fig.axes
    lines = {line.get_label(): line for line in acc_ax.get_lines()}
    eval_line, test_line = lines["eval/accuracy"], lines["test/accuracy"]
    for line in (eval_line, test_line):
        assert line.get_marker() not in (None, "None", "", " ") and line.get_markersize() >= 6
    assert (eval_line.get_marker(), eval_line.get_markersize()) != (test_line.get_marker(), test_line.get_markersize())
    # drawn, not only declared: each colour is on the canvas at the shared point, outside the legend
    for ax in (loss_ax, acc_ax):
        assert pixels_of(fig, ax, eval_line.get_color()) >= 15
        assert pixels_of(fig, ax, test_line.get_color()) >= 15


def test_single_train_point_has_a_marker():
    fig = curves_figure([{"step": 1, "train/loss": 1.0}])
    (line,) = fig.axes[0].get_lines()
    assert line.get_marker() not in (None, "None", "", " ")


def test_many_classes_cost_an_evaluation_time_and_memory_linear_in_the_classes():
    """100,000 classes: per-class accuracy from two bincounts, no confusion matrix (it would be 10^10 counts, 80 GB;
    not drawn past CONFUSION_MAX_CLASSES, where a heatmap stops being readable); a few classes keep theirs."""
    import time

    from common.train.metrics import CONFUSION_MAX_CLASSES, summarize

    preds, labels = torch.tensor([0, 5, 99_999, 7]), torch.tensor([0, 6, 99_999, 7])
    t0 = time.perf_counter()
    m = summarize(preds, labels, torch.zeros(4), 100_000)
    assert time.perf_counter() - t0 < 5 and m["confusion"] is None
    acc = m["per_class_accuracy"]
    assert len(acc) == 100_000 and (acc[0], acc[6], acc[7], acc[99_999]) == (1.0, 0.0, 1.0, 1.0)
    small = summarize(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 2]), torch.zeros(3), 3)
    assert small["confusion"].tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 0]] and small["per_class_accuracy"] == [1, 1, 0]
    assert CONFUSION_MAX_CLASSES >= 10
