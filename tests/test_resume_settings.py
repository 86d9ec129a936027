"""A resume is the run it continues: README's short command (`--output-dir RUN --resume-from latest`, nothing else)
on a run started with non-default settings takes the run's own settings from its checkpoint before anything is built
from them (the Accelerator's data seed and accumulation, the data, the model, the schedule), and ends with the
weights and per-step losses of the uninterrupted run, at 1 and 2 processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import check_ok, launch, read_jsonl, run_in_process, stopped_at

# Every case's run also differs from the recipe's defaults in these, which the short command takes from the checkpoint
# too: the data, the length, the batch, the model's size, the LR, the logging and checkpoint cadence.
BASE = ["--epochs", 2, "--batch-size", 32, "--hidden", "32", "--lr", "4e-3", "--log-every", 1]
CHECKPOINTS = ["--checkpoint-every", 3, "--keep-checkpoints", 10]

CASES = {  # one setting a resume adopts, at a value other than the recipe's default
    "seed": ["--seed", 7],  # the Accelerator's seedable sampler shuffles with it
    "grad_accum": ["--grad-accum", 2],  # the Accelerator's accumulation plugin counts micro-batches with it
    "val_fraction": ["--val-fraction", 0.2],  # the held-out images
    "model_and_schedule": ["--hidden", "48", "--epochs", 3, "--warmup-fraction", 0.3, "--label-smoothing", 0.1],
}


def losses(run: Path) -> list:
    return [(r["step"], r["train/loss"]) for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]


def same_weights(a: Path, b: Path) -> bool:
    x, y = (load_file(str(run / "final" / "model.safetensors")) for run in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def short_resume_matches(full: Path, part: Path, proc) -> None:
    state = json.loads((part / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and 0 < state["batches_in_epoch"], state  # stopped mid-epoch
    assert "resumed from" in proc.stdout and "resuming with the run's own" in proc.stdout, proc.stdout[-3000:]
    assert losses(part) == losses(full), (losses(full), losses(part))
    assert same_weights(full, part)
    a, b = (json.loads((run / "summary.json").read_text()) for run in (full, part))
    assert (
        (a["status"], a["global_step"], a["final"])
        == (b["status"], b["global_step"], b["final"])
        == (
            "completed",
            a["global_step"],
            a["final"],
        )
    )


@pytest.mark.parametrize("case", CASES)
def test_the_short_resume_command_continues_the_run_it_resumes(case, tmp_path, env, mnist_like):
    """Started with the case's setting (and BASE), stopped mid-epoch at step 3, resumed with the short command."""
    args = ["--dataset", mnist_like, *BASE, *CASES[case], *CHECKPOINTS]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--output-dir", full], env))
    stopped_at(full, 3, part)
    proc = check_ok(run_in_process("fashion_mnist_mlp", ["--output-dir", part, "--resume-from", "latest"], env))
    short_resume_matches(full, part, proc)
    flag = str(CASES[case][0])
    assert f"{flag} " in proc.stdout.split("resuming with the run's own", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("case", ["seed", "grad_accum", "val_fraction"])
def test_the_run_command_without_one_setting_continues_the_run(case, tmp_path, env, mnist_like):
    """The start's command again with --resume-from latest, less the case's flag: the run's own value, said so and used
    by everything built from it (the Accelerator was once built with the default, and a resume with --seed left out
    shuffled its epoch with seed 42)."""
    args = ["--dataset", mnist_like, *BASE, *CHECKPOINTS]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("fashion_mnist_mlp", [*args, *CASES[case], "--output-dir", full], env))
    stopped_at(full, 3, part)
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--output-dir", part, "--resume-from", "latest"], env))
    short_resume_matches(full, part, proc)
    assert f"resuming with the run's own {CASES[case][0]} {CASES[case][1]!r}" in proc.stdout, proc.stdout[-3000:]


def test_accumulation_asked_of_the_launcher_is_the_runs_own_on_resume(tmp_path, env, mnist_like):
    """`accelerate launch --gradient_accumulation_steps 2` (ACCELERATE_GRADIENT_ACCUMULATION_STEPS) at the start,
    not at the resume: the run resumes with its own accumulation, as the Accelerator that steps the optimizer counts
    it. Given again at the resume, the same; another value is refused."""
    args = ["--dataset", mnist_like, *BASE, "--seed", 5, *CHECKPOINTS]
    full, part = tmp_path / "full", tmp_path / "part"
    asked = {**env, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--output-dir", full], asked))
    assert "grad_accum=2" in proc.stdout
    assert json.loads((full / "config.json").read_text())["grad_accum"] == 2
    stopped_at(full, 3, part)
    refused = run_in_process(
        "fashion_mnist_mlp",
        ["--output-dir", part, "--resume-from", "latest"],
        {**env, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3"},
    )
    assert refused.returncode == 2 and "Refusing to resume" in refused.stderr and "--grad-accum 3" in refused.stderr
    proc = check_ok(run_in_process("fashion_mnist_mlp", ["--output-dir", part, "--resume-from", "latest"], env))
    assert "grad_accum=2" in proc.stdout, proc.stdout[-3000:]
    short_resume_matches(full, part, proc)


def test_two_processes_resume_with_the_runs_seed_and_the_launchers_accumulation(tmp_path, env, mnist_like):
    """2 gloo processes through `accelerate launch`: a run started with --seed 7 and the launcher's
    --gradient_accumulation_steps 2, stopped mid-epoch, resumed with the short command and neither: the same weights
    and losses as the uninterrupted run."""
    args = ["--dataset", mnist_like, *BASE, "--seed", 7, "--dropout", 0, *CHECKPOINTS]
    full, part = tmp_path / "full", tmp_path / "part"
    proc = check_ok(
        launch(
            "fashion_mnist_mlp",
            [*args, "--output-dir", full],
            env,
            nproc=2,
            extra_launch=["--gradient_accumulation_steps", 2],
        )
    )
    assert "processes=2" in proc.stdout and "grad_accum=2" in proc.stdout, proc.stdout[-3000:]
    stopped_at(full, 3, part)
    proc = check_ok(launch("fashion_mnist_mlp", ["--output-dir", part, "--resume-from", "latest"], env, nproc=2))
    assert "processes=2" in proc.stdout and "grad_accum=2" in proc.stdout, proc.stdout[-3000:]
    short_resume_matches(full, part, proc)


def test_the_photo_recipe_resumes_with_its_own_crops_and_seed(tmp_path, env, photos_like):
    """The photo recipe's own adopted settings (--image-size, --start-image-size: the crops of every epoch) with
    --seed, resumed mid-epoch with the short command: the uninterrupted run's weights and losses."""
    args = ["--dataset", photos_like, "--epochs", 2, "--batch-size", 32, "--log-every", 1, "--eval-every", 1]
    args += ["--image-size", 48, "--start-image-size", 32, "--seed", 3, "--workers", 0, *CHECKPOINTS]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("finetune_folder", [*args, "--output-dir", full], env))
    stopped_at(full, 3, part)
    proc = check_ok(
        run_in_process("finetune_folder", ["--output-dir", part, "--resume-from", "latest", "--workers", 0], env)
    )
    short_resume_matches(full, part, proc)
    assert "--image-size 48" in proc.stdout and "--start-image-size 32" in proc.stdout, proc.stdout[-3000:]


def test_a_resume_that_changes_the_monitor_starts_the_best_over(tmp_path, env, mnist_like):
    """A run kept best/ by eval/loss (mode min); resumed with --monitor eval/accuracy, the loss it kept is never
    compared as an accuracy (a min-mode loss would keep the worst accuracy): one NOTE says the best starts over, the
    run's best/ is kept aside under its metric's name, and best/ and summary.json then hold the best accuracy of this
    launch's evaluations."""
    run = tmp_path / "run"
    flags = ["--dataset", mnist_like, *BASE, "--eval-every-steps", 2, "--output-dir", run]
    check_ok(run_in_process("fashion_mnist_mlp", [*flags, "--monitor", "eval/loss", "--max-steps", 4], env))
    first = json.loads((run / "best" / "model.json").read_text())
    assert list(first["metrics"]) == ["eval/loss"]
    proc = check_ok(
        run_in_process("fashion_mnist_mlp", [*flags, "--monitor", "eval/accuracy", "--resume-from", "latest"], env)
    )
    assert "the best value starts over with this launch's evaluations" in proc.stdout, proc.stdout
    assert "renamed best-eval_loss-min" in proc.stdout
    kept = json.loads((run / "best-eval_loss-min" / "model.json").read_text())
    assert kept["metrics"] == first["metrics"]
    accuracies = [(r["step"], r["eval/accuracy"]) for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r]
    after = [a for step, a in accuracies if step > 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"] == {"eval/accuracy": max(after)}, (summary["best"], accuracies)
    assert json.loads((run / "best" / "model.json").read_text())["metrics"] == {"eval/accuracy": max(after)}
