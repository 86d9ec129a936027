"""End to end: each recipe launched as users launch it, at 1 and 2 processes, on tiny on-disk data."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ACCELERATE, CONFIGS, REPO, check_ok, launch, read_jsonl, read_scalars,
                      write_parquet_dataset)

RECIPES = ["fashion_mnist_mlp", "mnist_convnet", "cifar_cnn"]
SMALL = {  # keep the models tiny so a CPU test takes seconds
    "fashion_mnist_mlp": ["--hidden", "32"],
    "mnist_convnet": ["--width", "8"],
    "cifar_cnn": ["--widths", "8,16,16"],
}
EXPECTED_TAGS = {"train/loss", "train/lr", "train/samples_per_sec", "eval/loss", "eval/accuracy",
                 "test/loss", "test/accuracy"}


def startup(proc) -> dict:
    line = next(l for l in proc.stdout.splitlines() if l.startswith("startup:"))
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("nproc", [1, 2])
def test_recipe_end_to_end(recipe, nproc, mnist_like, cifar_like, env, tmp_path):
    data = cifar_like if recipe == "cifar_cnn" else mnist_like
    run = tmp_path / "run"
    proc = check_ok(launch(recipe, ["--dataset", data, "--epochs", 2, "--batch-size", 32, "--log-every", 2,
                                    "--output-dir", run, *SMALL[recipe]], env, nproc=nproc))
    info = startup(proc)
    assert info["processes"] == str(nproc)
    if nproc == 2:  # really two gloo processes, not two independent single-process runs
        assert info["backend"] == "gloo" and info["distributed"] == "MULTI_CPU"
        assert info["per_process_batch"] == "16"
    # exactly one TensorBoard writer, the expected tags, monotonic steps
    event_files = list(run.rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    scalars = read_scalars(run)
    assert EXPECTED_TAGS <= set(scalars), set(scalars)
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    # metrics.jsonl carries the same numbers
    rows = read_jsonl(run / "metrics.jsonl")
    tb_loss = dict(scalars["train/loss"])
    for row in rows:
        if "train/loss" in row:
            assert row["train/loss"] == pytest.approx(tb_loss[row["step"]], rel=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["test/count"] == 64 if recipe == "cifar_cnn" else 99
    assert summary["processes"] == nproc
    assert (run / "curves.png").stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_files[0].parent), size_guidance={"images": 0})
    acc.Reload()
    assert {"test/confusion_matrix", "test/misclassified"} <= set(acc.Tags()["images"])
    weights = load_file(str(run / "final" / "model.safetensors"))
    assert weights and all(torch.isfinite(v.float()).all() for v in weights.values())
    assert json.loads((run / "config.json").read_text())["epochs"] == 2
    if recipe == "mnist_convnet" and nproc == 2:  # --eval-only on the finished run, also on 2 processes
        check_ok(launch(recipe, ["--dataset", data, "--eval-only", "--checkpoint", run, *SMALL[recipe]], env,
                        nproc=2))
        result = json.loads((run / "best" / "eval-test.json").read_text())
        assert result["count"] == 99 and 0.0 <= result["accuracy"] <= 1.0


def test_eval_counts_awkward_sizes_exactly_on_two_processes(tmp_path, env):
    """99 validation images, eval batch 10 per process x 2 processes: every image counted once."""
    data = write_parquet_dataset(tmp_path / "d", {"train": 64, "validation": 99, "test": 82})
    run = tmp_path / "run"
    proc = check_ok(launch("fashion_mnist_mlp", ["--dataset", data, "--epochs", 1, "--batch-size", 16,
                                                 "--eval-batch-size", 20, "--hidden", "16", "--output-dir", run],
                           env, nproc=2))
    assert "(99 images)" in proc.stdout
    assert json.loads((run / "summary.json").read_text())["final"]["test/count"] == 82


def test_ddp_equals_single_process_with_double_batch(tmp_path, env, mnist_like):
    """MLP (no BatchNorm, no dropout): 2 processes x batch 16 == 1 process x batch 32, weights allclose."""
    common = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--hidden", "32", "--dropout", 0,
              "--max-steps", 5, "--val-fraction", 0.2, "--log-every", 1]
    runs = {}
    for nproc in (1, 2):
        runs[nproc] = tmp_path / f"run{nproc}"
        check_ok(launch("fashion_mnist_mlp", [*common, "--output-dir", runs[nproc]], env, nproc=nproc))
    a = load_file(str(runs[1] / "final" / "model.safetensors"))
    b = load_file(str(runs[2] / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    lr1 = [r["train/lr"] for r in read_jsonl(runs[1] / "metrics.jsonl") if "train/lr" in r]
    lr2 = [r["train/lr"] for r in read_jsonl(runs[2] / "metrics.jsonl") if "train/lr" in r]
    assert lr1 == lr2 and len(lr1) > 0  # the same LR trace at 1 and 2 processes


def test_resume_after_epoch_one_matches_uninterrupted(tmp_path, env, mnist_like):
    common = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, "--width", "8", "--log-every", 1]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(launch("mnist_convnet", [*common, "--output-dir", full], env))
    check_ok(launch("mnist_convnet", [*common, "--output-dir", part, "--max-steps", 9], env))  # 9 steps = 1 epoch
    assert json.loads((part / "summary.json").read_text())["epochs_completed"] == 1
    proc = check_ok(launch("mnist_convnet", [*common, "--output-dir", part, "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(part / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda run: [(r["step"], r["train/loss"]) for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert losses(full) == losses(part)


def test_learns_far_above_chance(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    check_ok(launch("mnist_convnet", ["--dataset", mnist_like, "--epochs", 3, "--batch-size", 32, "--width", "8",
                                      "--output-dir", run, "--target-accuracy", 0.9], env))
    assert json.loads((run / "summary.json").read_text())["final"]["test/accuracy"] >= 0.9  # chance is 0.25


def test_every_shipped_config_loads():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted(CONFIGS.glob("*.yaml"))
    assert len(files) >= 6
    for f in files:
        cfg = load_config_from_file(str(f))
        assert cfg.num_processes >= 1, f
        assert f.read_text().startswith("#"), f"{f.name} must start with a comment saying when to use it"
        assert "accelerate launch" in f.read_text(), f"{f.name} must give the exact command"


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_every_knob(recipe):
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--dataset", "--epochs", "--batch-size", "--lr", "--resume-from", "--output-dir", "--seed"):
        assert flag in proc.stdout
    assert "(default:" in proc.stdout


def test_accelerate_config_default_path(tmp_path, env, mnist_like):
    """What a user gets from `accelerate config`: Accelerate's own default config launches a recipe."""
    cfg = tmp_path / "default_config.yaml"
    subprocess.run([ACCELERATE, "config", "default", "--config_file", str(cfg)], check=True, env=env,
                   capture_output=True, timeout=120)
    proc = check_ok(launch("mnist_convnet", ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32,
                                             "--width", "8", "--max-steps", 2, "--output-dir", tmp_path / "run"],
                           env, config=str(cfg)))
    assert startup(proc)["processes"] == "1"


def test_offline_hub_id_fails_fast_with_one_paragraph(tmp_path, env):
    env = {**env}
    env.pop("HF_HUB_OFFLINE"), env.pop("HF_DATASETS_OFFLINE")
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "mnist_convnet.py"), "--dataset",
                           "someone/not-cached-dataset", "--output-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert time.time() - t0 < 30
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "someone/not-cached-dataset" in proc.stderr and "--dataset" in proc.stderr


def test_decoded_cache_is_reused(tmp_path, env, mnist_like):
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--width", "8", "--max-steps", 1]
    first = check_ok(launch("mnist_convnet", [*args, "--output-dir", tmp_path / "a"], env))
    assert "decoding train split" in first.stdout
    assert list((tmp_path / "decoded-cache").glob("*.safetensors"))
    second = check_ok(launch("mnist_convnet", [*args, "--output-dir", tmp_path / "b"], env))
    assert "decoding" not in second.stdout
