"""Pinned per-step losses: the first steps of each recipe on CPU, fp32, seed 42, on the generated
dataset of conftest. An accidental change to training behaviour (data order, init, augmentation, loss,
optimizer, schedule) changes these numbers and fails here. If you change training on purpose, re-pin."""

from __future__ import annotations

import pytest

from conftest import check_ok, launch, read_jsonl

GOLDEN = {
    "fashion_mnist_mlp": (["--hidden", "32"], [1.3252904415130615, 1.0271222591400146, 0.8174426555633545,
                                                0.5995411276817322]),
    "mnist_convnet": (["--width", "8"], [1.611971139907837, 1.0036983489990234, 0.778074324131012,
                                         0.5063005089759827]),
    "cifar_cnn": (["--widths", "8,16,16"], [1.3381787538528442, 1.3157883882522583, 1.2802329063415527,
                                            1.2562949657440186]),
}


@pytest.mark.parametrize("recipe", sorted(GOLDEN))
def test_first_steps_match_pinned_losses(recipe, tmp_path, env, mnist_like, cifar_like):
    small, expected = GOLDEN[recipe]
    data = cifar_like if recipe == "cifar_cnn" else mnist_like
    run = tmp_path / "run"
    check_ok(launch(recipe, ["--dataset", data, "--epochs", 2, "--batch-size", 32, "--log-every", 1,
                             "--max-steps", 4, "--output-dir", run, *small], env))
    got = [r["train/loss"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
