"""benchmarks/gpu_report.py without a GPU: the dry run lists every row's command (the recipes, baselines and flags
issue 30 names) and exits 0; a real run refuses in one paragraph (exit 2, no traceback); a missing data folder is
exit 2 naming it. Nothing trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = str(REPO / "benchmarks" / "gpu_report.py")


@pytest.fixture
def data_root(tmp_path):
    for name in ("mnist", "fashion_mnist", "cifar10", "flowers"):
        (tmp_path / "data" / name).mkdir(parents=True)
    return tmp_path / "data"


def run(*args, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a machine that has one
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_lists_every_row_with_its_budget(data_root, tmp_path):
    proc = run("--data-root", data_root, "--work-dir", tmp_path / "work", "--seed", 7, "--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = dict(re.findall(r"^\[(\S+)\] budget \d+ s, seed 7[^\n]*\n  (.+)$", proc.stdout, re.M))
    assert list(rows) == [
        "mnist_convnet",
        "cifar_cnn_vs_airbench94",
        "photo/recipe",
        "photo/baseline",
        *(f"hot_path/{r}" for r in ("mnist_convnet", "fashion_mnist_mlp", "cifar_cnn", "finetune_folder")),
        *(
            f"throughput/{r}/{lever}"
            for lever in ("host", "device", "device+compile")
            for r in ("mnist_convnet", "cifar_cnn")
        ),
    ]
    assert "time_to_accuracy.py --recipe mnist_convnet" in rows["mnist_convnet"]
    assert "--target 0.993" in rows["mnist_convnet"] and f"{data_root}/mnist " in rows["mnist_convnet"]
    cifar = rows["cifar_cnn_vs_airbench94"]
    assert "--recipe cifar_cnn" in cifar and "--baseline-kind airbench94" in cifar and "--target baseline" in cifar
    assert "single_gpu_fp16.yaml" in cifar and f"{data_root}/cifar10 " in cifar
    assert "recipes/finetune_folder.py" in rows["photo/recipe"] and "--image-size 224" in rows["photo/recipe"]
    assert "benchmarks/photo_baseline.py" in rows["photo/baseline"] and "--crop 224" in rows["photo/baseline"]
    for recipe in ("mnist_convnet", "fashion_mnist_mlp", "cifar_cnn", "finetune_folder"):
        assert f"gpu_report.py --sync-check {recipe} " in rows[f"hot_path/{recipe}"]
    for name, cmd in rows.items():
        if name.startswith(("hot_path", "throughput", "photo/recipe")):
            assert "accelerate launch" in cmd and "single_gpu.yaml" in cmd and "--mixed_precision bf16" in cmd
        if name.startswith("throughput"):
            assert ("--data-on-device" in cmd) == ("device" in name.rsplit("/", 1)[1])
            assert ("--dynamo_backend inductor" in cmd) == name.endswith("+compile")
            assert ("TORCHINDUCTOR_CACHE_DIR=" in cmd) == name.endswith("+compile")
    assert not (tmp_path / "work").exists()  # a dry run makes nothing


def test_without_a_gpu_it_refuses_in_one_paragraph(data_root, tmp_path):
    proc = run("--data-root", data_root, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "needs a CUDA GPU" in err and "--dry-run" in err


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_missing_data_folder_is_exit_2_naming_it(data_root, tmp_path, dry_run):
    (data_root / "cifar10").rmdir()
    proc = run("--data-root", data_root, *(["--dry-run"] if dry_run else []), tmp_path=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{data_root / 'cifar10'}/" in proc.stderr and f"{data_root / 'mnist'}/" not in proc.stderr
    proc = run("--data-root", tmp_path / "nowhere", "--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 2 and f"{tmp_path / 'nowhere'}: the folder does not exist" in proc.stderr
