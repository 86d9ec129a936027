"""The loop's calls: an evaluation is not repeated for the same weights, and a run without a validation split
still checkpoints where the loop asks."""

from __future__ import annotations

from helpers import check_ok, import_recipe, read_jsonl, run_in_process

MLP = ["--hidden", "32", "--lr", "4e-3"]


def test_an_eval_every_steps_evaluation_that_ends_an_epoch_is_the_epochs_own(tmp_path, env, mnist_like, monkeypatch):
    """9 optimizer steps per epoch, --eval-every-steps 3: evaluations at steps 3, 6, 9 of each epoch, the one
    at step 9 also the epoch's (not a second evaluation of the same weights), and the final one."""
    recipe = import_recipe("fashion_mnist_mlp")
    calls, real = [], recipe.evaluate

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(recipe, "evaluate", counted)
    run = tmp_path / "run"
    proc = check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                "--epochs",
                2,
                "--batch-size",
                32,
                *MLP,
                "--eval-every-steps",
                3,
                "--output-dir",
                run,
            ],
            env,
        )
    )
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r]
    assert steps == [3, 6, 9, 12, 15, 18] and len(calls) == 6 + 1  # + the final evaluation (test split)
    assert [l.split(":")[0] for l in proc.stdout.splitlines() if l.startswith("eval at step")] == [
        "eval at step 3",
        "eval at step 6",
        "eval at step 12",
        "eval at step 15",
    ]
    assert all("| eval loss" in l for l in proc.stdout.splitlines() if l.startswith("epoch "))


def test_without_validation_a_checkpoint_step_that_is_also_an_eval_step_still_checkpoints(tmp_path, env, mnist_like):
    """--val-fraction 0 (nothing to validate on) with --eval-every-steps and --checkpoint-every on the same steps:
    nothing is evaluated, and the checkpoints are written."""
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                "--epochs",
                1,
                "--batch-size",
                32,
                *MLP,
                "--val-fraction",
                0,
                "--eval-every-steps",
                3,
                "--checkpoint-every",
                3,
                "--keep-checkpoints",
                10,
                "--output-dir",
                run,
            ],
            env,
        )
    )
    written = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert written[:2] == [3, 6], written
