"""--patience N: N evaluations in a row without a --monitor improvement end the run the way the loop's `break` does
(run.finish: the final evaluation, final/, ended_early naming the patience), at the same step on 1 and 2 processes;
the count is kept in checkpoints, so a run resumed between two evaluations stops where the uninterrupted run stopped;
a loop whose break lines no longer ask run.no_improvement() is refused instead of training on."""

from __future__ import annotations

import json

from helpers import check_ok, copy_recipe, launch, run_in_process, stopped_at

# a learning rate too small to move the predictions: every evaluation after the first scores the same, no improvement;
# 288 training images (32 held out) in batches of 32: 9 steps an epoch, evaluated after each
ARGS = ["--epochs", 6, "--eval-every", 1, "--batch-size", 32, "--hidden", 32, "--lr", 1e-9, "--patience", 2]


def summary(run):
    return json.loads((run / "summary.json").read_text())


def test_patience_ends_the_run_at_the_same_step_on_1_and_2_processes_and_a_resume_continues_the_count(
    tmp_path, env, mnist_like
):
    one = tmp_path / "one"
    args = ["--dataset", mnist_like, *ARGS, "--checkpoint-every", 21]
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--output-dir", one], env))
    s = summary(one)
    assert s["status"] == "completed" and s["global_step"] == 27, s  # evaluations 2 and 3 did not improve
    assert "--patience 2, 2 evaluations in a row without a eval/accuracy improvement" in s["ended_early"], s
    assert "the loop ended the run at step 27 of 54" in proc.stdout and s["final"]["test/count"] == 99
    two = tmp_path / "two"
    check_ok(launch("fashion_mnist_mlp", [*args, "--output-dir", two], env, nproc=2))
    s2 = summary(two)
    assert s2["processes"] == 2 and s2["global_step"] == 27 and s2["ended_early"] == s["ended_early"]
    # stopped at step 21 (after the second evaluation: one without improvement), resumed: the count goes on from 1
    resumed = stopped_at(one, 21, tmp_path / "resumed")
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--output-dir", resumed, "--resume-from", "latest"], env))
    assert summary(resumed)["global_step"] == 27  # from 0 it would have trained to step 36


def test_a_loop_that_no_longer_asks_is_refused_when_the_patience_runs_out(tmp_path, env, mnist_like):
    recipe = copy_recipe("fashion_mnist_mlp", tmp_path / "my_mlp.py")
    text = recipe.read_text()
    assert text.count(" or run.no_improvement()") == 2
    recipe.write_text(text.replace(" or run.no_improvement()", ""))  # the user's edit: --max-steps only
    run = tmp_path / "run"
    proc = run_in_process(recipe, ["--dataset", mnist_like, *ARGS, "--output-dir", run], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "--patience 2" in paragraph and "at step 27" in paragraph and "run.no_improvement()" in paragraph
    assert summary(run)["global_step"] == 27  # not a step trained past the patience
