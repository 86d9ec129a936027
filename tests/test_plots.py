"""common.plots: image dtypes/shapes, the no-mistakes case, curves from a metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.metrics import confusion_matrix  # noqa: E402
from common.plots import (confusion_matrix_image, misclassified_grid, read_metrics, save_curves_png,  # noqa: E402
                          save_image_png)


def is_rgb_image(img) -> bool:
    return isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 \
        and img.shape[0] > 20 and img.shape[1] > 20


def test_confusion_matrix_image(tmp_path):
    preds = torch.tensor([0, 1, 2, 2, 1, 0, 2])
    labels = torch.tensor([0, 1, 2, 1, 1, 2, 2])
    img = confusion_matrix_image(confusion_matrix(preds, labels, 3), ["cat", "dog", "bird"])
    assert is_rgb_image(img)
    assert img.std() > 0  # not a blank canvas
    assert save_image_png(img, tmp_path / "cm.png").stat().st_size > 0


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


def test_misclassified_grid_none_wrong():
    labels = torch.tensor([0, 1, 2])
    img = misclassified_grid(torch.zeros(3, 1, 8, 8, dtype=torch.uint8), labels, labels.clone(), ["a", "b", "c"])
    assert is_rgb_image(img)


def test_save_curves_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "time": 1.0 + s, "train/loss": 2.0 / s, "train/lr": 0.01} for s in range(10, 410, 10)]
    lines += [{"step": 200, "eval/loss": 0.4, "eval/accuracy": 0.9}, {"step": 400, "eval/loss": 0.3, "eval/accuracy": 0.95},
              {"step": 400, "test/loss": 0.31, "test/accuracy": 0.94}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n{\"step\": 41")  # a line cut short by a crash
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
