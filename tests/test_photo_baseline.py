"""benchmarks/photo_baseline.py (torchvision's reference recipe, written fresh), run as a user runs it on a tiny
image folder."""

import json
import statistics
import subprocess
import sys

import numpy as np
import torch
from PIL import Image

from common.data.splits import ImageSplit, hold_out

from helpers import REPO, check_ok, recipe_env


def test_photo_baseline_trains_on_the_recipes_split_and_measures_windows(tmp_path):
    data = tmp_path / "photos"
    rng = np.random.default_rng(0)
    for k, cls in enumerate(("ants", "bees")):  # mixed sizes and formats, as users' photos are
        (data / cls).mkdir(parents=True)
        for i in range(20):
            h, w = (30, 40) if i % 2 else (50, 30)
            arr = rng.integers(0, 80, size=(h, w, 3), dtype=np.uint8)
            arr[:, : w // 2 if k else None] += 150
            Image.fromarray(arr).save(data / cls / (f"{i}.png" if i % 3 else f"{i}.jpg"))
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "benchmarks/photo_baseline.py",
        "--data",
        str(data),
        "--epochs",
        "2",
        "--crop",
        "32",
        "--batch-size",
        "8",
        "--workers",
        "1",
        "--persistent-workers",
        "--window",
        "3",
        "--seed",
        "3",
        "--out",
        str(out),
    ]
    proc = check_ok(
        subprocess.run(cmd, cwd=str(REPO), env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300)
    )
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    _, val = hold_out(ImageSplit(torch.zeros(40, 1, 1, 1, dtype=torch.uint8), torch.zeros(40)), 0.15, 3)
    assert line["val_count"] == len(val) == 6 and line["train_count"] == 34
    assert 0.0 <= line["val_accuracy"] <= 1.0 and line["processes"] == 1 and line["epochs"] == 2
    assert line["model"] == "resnet18" and line["crop"] == 32 and line["batch"] == 8 and line["lr"] == 0.1 * 8 / 64
    assert line["wall_s"] >= line["train_s"] > 0 and line["images_per_s"] > 0
    assert "rank 0 of world size 1" in proc.stdout and "epoch 2/2:" in proc.stdout
    # 10 steps (5 an epoch, the last batch of each 2 images): windows of 3 steps end at steps 3, 6 and 9, across the
    # epoch boundary; the first is left out of the median
    assert line["persistent_workers"] and line["window"] == 3 and len(line["windows"]) == 2
    # the median of the windows (each rounded to 0.01 in the file, the median from the unrounded ones)
    assert abs(line["steady_images_per_s"] - statistics.median(line["windows"])) <= 0.01 and line["windows"][1] > 0
