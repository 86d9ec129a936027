"""The LR follows the batch: each recipe's default --lr is tuned at one global batch (its default) and, when
--batch-size is changed and --lr is not given, follows it by the recipe's rule (linear for SGD, square root for
AdamW). An --lr the user gives, on the command line or in a --config file, is taken as given; a run's saved
config.json, fed back with --config, already holds the scaled lr and is not scaled twice. The rule is in the
--lr help and the startup line says which lr the run uses and why."""

from __future__ import annotations

import json
import math

import pytest

from common.config import build_parser, parse_config, save_config

from helpers import import_recipe, recipe_path, run_in_process

# recipe -> (default lr, the global batch it was tuned at, rule); a changed default must change this table
RULES = {
    "cifar_cnn": (1.5, 1024, "linear"),
    "mnist_convnet": (1e-2, 256, "sqrt"),
    "fashion_mnist_mlp": (4e-3, 1024, "sqrt"),
}


def config(recipe, argv):
    """The recipe's Config as its own command line makes it."""
    return parse_config(import_recipe(recipe_path(recipe)).Config, [str(a) for a in argv])


def ruled(recipe, batch):
    lr, tuned, kind = RULES[recipe]
    return lr * (batch / tuned if kind == "linear" else math.sqrt(batch / tuned))


@pytest.mark.parametrize("recipe", sorted(RULES))
@pytest.mark.parametrize("batch", [32, 4096])
def test_changed_batch_gives_the_rules_lr(recipe, batch):
    cfg = config(recipe, ["--batch-size", batch])
    assert cfg.batch_size == batch and cfg.lr == pytest.approx(ruled(recipe, batch), rel=1e-12)
    lr, tuned, kind = RULES[recipe]
    assert f"{batch}/{tuned}" in cfg.lr_note and f"{kind} rule" in cfg.lr_note, cfg.lr_note


def test_cifar_at_batch_32_is_scaled_linearly():
    """The reported divergence: cifar_cnn at --batch-size 32 kept lr 1.5; the rule gives 1.5 x 32/1024."""
    cfg = config("cifar_cnn", ["--batch-size", 32])
    assert cfg.lr == 0.046875 and cfg.lr_note == "1.5 x 32/1024, linear rule"


@pytest.mark.parametrize("recipe", sorted(RULES))
def test_default_batch_keeps_the_default_lr(recipe):
    lr, tuned, _ = RULES[recipe]
    for argv in ([], ["--batch-size", tuned]):  # the default batch, implied or given
        cfg = config(recipe, argv)
        assert cfg.batch_size == tuned and cfg.lr == lr
        assert cfg.lr_note == f"the default, tuned at batch {tuned}", cfg.lr_note


@pytest.mark.parametrize("recipe", sorted(RULES))
def test_explicit_lr_on_the_command_line_is_kept(recipe):
    cfg = config(recipe, ["--batch-size", 64, "--lr", "0.3"])
    assert cfg.lr == 0.3 and cfg.lr_note == "as given"
    lr, _, _ = RULES[recipe]
    cfg = config(recipe, ["--batch-size", 64, "--lr", lr])  # the default's value, but said: the user's word
    assert cfg.lr == lr and cfg.lr_note == "as given"


@pytest.mark.parametrize("recipe", sorted(RULES))
def test_explicit_lr_in_a_config_file_is_kept(recipe, tmp_path):
    given = tmp_path / "given.yaml"
    given.write_text("batch_size: 64\nlr: 0.3\n")
    cfg = config(recipe, ["--config", given])
    assert cfg.batch_size == 64 and cfg.lr == 0.3 and cfg.lr_note == f"as given in {given}"
    # a batch from the file without an lr follows the rule, as the same batch on the command line does
    batch_only = tmp_path / "batch.yaml"
    batch_only.write_text("batch_size: 64\n")
    assert config(recipe, ["--config", batch_only]).lr == pytest.approx(ruled(recipe, 64), rel=1e-12)
    # the command line's --batch-size over the file's --lr: still the file's lr, not scaled
    assert config(recipe, ["--config", given, "--batch-size", 128]).lr == 0.3


@pytest.mark.parametrize("recipe", sorted(RULES))
def test_saved_config_is_not_scaled_twice(recipe, tmp_path):
    """A run's config.json (common.config.save_config, as the run writes it) holds the scaled lr and its batch:
    `--config runs/x/config.json` repeats the run with that lr, and the note is not a saved setting. The same
    command (as `--resume-from latest` repeats it) gives the same lr."""
    argv = ["--batch-size", 32, "--output-dir", tmp_path / "run", "--resume-from", "latest"]
    first = config(recipe, argv)
    assert first.lr == pytest.approx(ruled(recipe, 32), rel=1e-12)
    assert config(recipe, argv).lr == first.lr  # resuming: the same command, the same lr, to the bit
    saved = tmp_path / "config.json"
    save_config(first, saved)
    assert "lr_note" not in json.loads(saved.read_text()) and "explicit" not in json.loads(saved.read_text())
    again = config(recipe, ["--config", saved])
    assert again.batch_size == 32 and again.lr == first.lr, (again.lr, first.lr)


@pytest.mark.parametrize("recipe", sorted(RULES))
def test_help_states_the_rule(recipe):
    help_text = " ".join(build_parser(import_recipe(recipe_path(recipe)).Config).format_help().split())
    _, tuned, kind = RULES[recipe]
    assert f"at --batch-size {tuned}; follows the batch" in help_text, help_text
    assert ("linearly" if kind == "linear" else "square root") in help_text
    assert "when --batch-size is changed and --lr is not given" in help_text


def test_startup_line_shows_the_scaled_lr(tmp_path, env, mnist_like):
    """A real run at a batch the LR was not tuned at says which lr it trains with and why, and trains with it."""
    run = tmp_path / "run"
    proc = run_in_process(
        "mnist_convnet",
        [
            "--dataset",
            mnist_like,
            "--width",
            8,
            "--epochs",
            1,
            "--batch-size",
            32,
            "--max-steps",
            2,
            "--log-every",
            1,
            "--report-to",
            "none",
            "--output-dir",
            run,
        ],
        env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    startup = next(line for line in proc.stdout.splitlines() if line.startswith("startup:"))
    lr = ruled("mnist_convnet", 32)  # 0.01 x sqrt(32/256)
    assert f"lr={lr:g} (0.01 x sqrt(32/256), sqrt rule)" in startup, startup
    assert json.loads((run / "config.json").read_text())["lr"] == pytest.approx(lr, rel=1e-12)


def test_batch_larger_than_the_split_names_the_rule(tmp_path, env, mnist_like):
    proc = run_in_process(
        "mnist_convnet",
        ["--dataset", mnist_like, "--width", 8, "--batch-size", 1024, "--output-dir", tmp_path / "r"],
        env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "smaller --batch-size" in proc.stderr and "by the recipe's rule" in proc.stderr
    assert "unless --lr is given" in proc.stderr, proc.stderr
