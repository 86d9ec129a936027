"""Shared fixtures: tiny datasets written to disk in the layouts users have, and a launcher that
runs the recipes the way users do (`accelerate launch` with a shipped config, a free port)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learnable_images(n: int, num_classes: int, shape, seed: int = 0):
    """uint8 images whose class is a bright block at a class-specific place, plus noise."""
    c, h, w = shape
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % num_classes
    rng.shuffle(labels)
    images = rng.integers(0, 60, size=(n, h, w, c), dtype=np.uint8)
    cells = int(np.ceil(np.sqrt(num_classes)))
    bh, bw = h // cells, w // cells
    for i, k in enumerate(labels):
        r, q = divmod(int(k), cells)
        images[i, r * bh:(r + 1) * bh, q * bw:(q + 1) * bw, :] = 200 + rng.integers(0, 55)
    return images, labels


def _pil(arr):
    from PIL import Image

    return Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)


def write_parquet_dataset(root: Path, splits: dict, num_classes: int = 4, shape=(1, 28, 28),
                          image_col: str = "image", label_col: str = "label", seed: int = 0) -> Path:
    """A folder laid out like a Hub dataset repo: data/<split>-00000-of-00001.parquet."""
    from datasets import ClassLabel, Dataset, Features, Image

    (root / "data").mkdir(parents=True, exist_ok=True)
    names = [f"class_{k}" for k in range(num_classes)]
    for i, (split, n) in enumerate(splits.items()):
        images, labels = learnable_images(n, num_classes, shape, seed + i)
        ds = Dataset.from_dict({image_col: [_pil(a) for a in images], label_col: labels.tolist()},
                               features=Features({image_col: Image(), label_col: ClassLabel(names=names)}))
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def write_image_folder(root: Path, n_per_class: int = 20, classes=("cat", "dog", "frog"), shape=(3, 32, 32),
                       seed: int = 0) -> Path:
    """<root>/<class>/<i>.png, the layout of a user's own data."""
    images, labels = learnable_images(n_per_class * len(classes), len(classes), shape, seed)
    for i, (arr, k) in enumerate(zip(images, labels)):
        d = root / classes[k]
        d.mkdir(parents=True, exist_ok=True)
        _pil(arr).save(d / f"{i}.png")
    return root


def recipe_env(root: Path) -> dict:
    """Environment for recipe subprocesses: private caches under ``root``, no network, 1 thread per process."""
    e = dict(os.environ)
    e.update(ACCELERATE_RECIPES_CACHE=str(root / "decoded-cache"), HF_HOME=str(root / "hf-home"),
             HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
             TOKENIZERS_PARALLELISM="false")
    e.pop("ACCELERATE_MIXED_PRECISION", None)
    return e


@pytest.fixture
def env(tmp_path):
    return recipe_env(tmp_path)


def launch(recipe: str, args, env, nproc: int = 1, config: str | None = None, timeout: int = 240,
           extra_launch=()) -> subprocess.CompletedProcess:
    """`accelerate launch` a recipe with a shipped config on a free port; returns the finished process."""
    config = config or ("cpu.yaml" if nproc == 1 else "cpu_2proc.yaml")
    cfg_path = config if os.path.isabs(config) else str(CONFIGS / config)
    cmd = [ACCELERATE, "launch", "--config_file", cfg_path, "--main_process_port", str(free_port()),
           *extra_launch, str(REPO / "recipes" / f"{recipe}.py"), *map(str, args)]
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from the run's TensorBoard event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events_dir in sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


@pytest.fixture(scope="session")
def mnist_like(tmp_path_factory):
    """Hub-layout parquet, 1x28x28, 4 classes: train 320 (no validation split), test 99."""
    return write_parquet_dataset(tmp_path_factory.mktemp("mnist_like"), {"train": 320, "test": 99})


@pytest.fixture(scope="session")
def cifar_like(tmp_path_factory):
    """Hub-layout parquet with CIFAR's column name `img`, 3x32x32, 4 classes."""
    return write_parquet_dataset(tmp_path_factory.mktemp("cifar_like"), {"train": 256, "test": 64},
                                 shape=(3, 32, 32), image_col="img")
