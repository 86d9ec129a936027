"""Pinned per-step losses: the first steps of each recipe on CPU, fp32, seed 42, on the generated
dataset of conftest. An accidental change to training behaviour (data order, init, augmentation, loss,
optimizer, schedule) changes these numbers and fails here. If you change training on purpose, re-pin.

The losses are read from the 1-process reference runs of conftest (the recipe's small settings, 2
epochs, batch 32, one log line per step); their other flags (checkpoint cadence, target
check) do not touch the training math."""

from __future__ import annotations

import pytest

from helpers import SMALL, read_jsonl

GOLDEN = {
    "fashion_mnist_mlp": [1.3453906774520874, 0.6219051480293274, 0.4301536977291107, 0.4629329741001129],
    "mnist_convnet": [1.3515788316726685, 0.7109315991401672, 0.372056245803833, 0.44997888803482056],
    "cifar_cnn": [1.3956594467163086, 1.3290314674377441, 1.245980978012085, 1.1574066877365112],
    "finetune_folder": [1.0703052282333374, 1.044615626335144, 1.1069858074188232, 0.9116474986076355],
}


@pytest.mark.parametrize("recipe", sorted(GOLDEN))
def test_first_steps_match_pinned_losses(recipe, reference_run):
    ref = reference_run(recipe, 1)
    args = [str(a) for a in ref.train_args]
    assert args[args.index("--batch-size") + 1] == "32" and args[args.index("--log-every") + 1] == "1"
    assert all(str(a) in args for a in SMALL[recipe])
    rows = read_jsonl(ref.run / "metrics.jsonl")
    got = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r][:4]
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx(GOLDEN[recipe], rel=1e-4, abs=1e-5)
