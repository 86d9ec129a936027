"""The loop a user copies stays right when they edit it: every *when* is a line of it, so a `break`, a `continue`, a
`return`, a deleted line or an added one is plain Python. Each test edits a copied recipe's text as a user would
(``cp``, then a string replaced in the copy), runs the copy, and reads what the run left:
steps, epochs, evaluations, the LR trace in metrics.jsonl, checkpoints and summary.json.

Runs: 1 process (``main()`` in this process), --batch-size 32: mnist_like holds 288 training images after the 10%
held out, so 9 batches an epoch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.schedules import lr_multiplier

from helpers import SMALL, check_ok, copy_recipe, launch, read_jsonl, run_in_process

RECIPES = {
    "fashion_mnist_mlp": "mnist_like",
    "mnist_convnet": "mnist_like",
    "cifar_cnn": "cifar_like",
    "finetune_folder": "photos_like",
}
TOP = "            with accelerator.accumulate(model):\n"  # the first line of the batch loop's body
OPT_STEP = "                optimizer.step()\n"
AFTER_UPDATE = (  # the last line before the lines that run once per update
    "            if not accelerator.sync_gradients:  # a --grad-accum micro-batch: the update comes later\n"
    "                continue\n"
)
EPOCH_END = (
    "            run.evaluate(validate, val_loader)  # not twice for the same weights\n"  # the epoch loop's last
)
FOR_BATCHES = "        for images, labels in run.batches(train_loader, epoch):"
CHECKPOINT = (
    "            if run.checkpoint_due():  # --checkpoint-every-s (and --checkpoint-every)\n"
    "                run.checkpoint()\n"
)
EPOCH_EVAL = (
    "        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:\n"
    "            run.evaluate(validate, val_loader)  # not twice for the same weights\n"
)


def edited(tmp_path: Path, recipe: str, *edits, name: str = "") -> Path:
    """A copy of ``recipe`` (as `cp recipes/<recipe>.py` makes it) with each (old, new) applied once;
    ``name``: the copy's file name (one per edited text: a test process imports each file once)."""
    copy = copy_recipe(recipe, tmp_path / (name or f"my_{recipe}.py"))
    text = copy.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} is not once in {recipe}"
        text = text.replace(old, new)
    copy.write_text(text)
    return copy


def args(recipe: str, data, run: Path, *extra) -> list:
    return [
        "--dataset",
        data,
        "--epochs",
        2,
        "--batch-size",
        32,
        "--log-every",
        1,
        *SMALL[recipe],
        *extra,
        "--output-dir",
        run,
    ]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def rows(run: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_jsonl(run / "metrics.jsonl") if key in r]


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


def lr_follows_the_schedule(run: Path, steps_per_epoch: int) -> None:
    """train/lr at each logged step s is the schedule's value after s - 1 scheduler steps: the scheduler stepped
    exactly once per update, whatever the loop skipped or left."""
    cfg = json.loads((run / "config.json").read_text())
    total = steps_per_epoch * cfg["epochs"]
    warmup = int(round(cfg["warmup_fraction"] * total))

    def m(step):
        return lr_multiplier(step, total, warmup, cfg["schedule"], cfg["warmup_start"], cfg["final_lr"])

    lrs = rows(run, "train/lr")
    assert lrs and lrs[0][0] == 1
    peak = lrs[0][1] / m(0)
    for step, lr in lrs:
        assert lr == pytest.approx(peak * m(step - 1), rel=1e-5), (step, lrs)


def same_weights(a: Path, b: Path) -> None:
    x, y = (load_file(str(r / "final" / "model.safetensors")) for r in (a, b))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def same_losses(a: Path, b: Path) -> None:
    assert rows(a, "train/loss") == rows(b, "train/loss")


def stopped_at(monkeypatch, step: int):
    """A stop request (as a signal makes it) at optimizer step ``step``: the run checkpoints there and exits 75."""
    from common.train.run import WATCHERS

    def stop(run):
        if run.step + 1 == step:
            run.stop.reason = "a test's stop request"

    monkeypatch.setitem(WATCHERS, "before_update", [stop])


def stop_and_resume(tmp_path, monkeypatch, env, copy: Path, run_args: list, run: Path, step: int):
    """``copy`` stopped at ``step`` and resumed with the same command: the run its resume finishes."""
    with monkeypatch.context() as mp:
        stopped_at(mp, step)
        proc = run_in_process(copy, [*run_args, "--output-dir", run], env)
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-3000:]
    return check_ok(run_in_process(copy, [*run_args, "--output-dir", run, "--resume-from", "latest"], env))


# --- break ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_break_from_the_batch_loop_ends_that_epoch(recipe, tmp_path, env, request):
    """`break` at the end of the body of the 3rd batch: each epoch ends after 3 batches, is evaluated and said to be
    ended by the loop; the scheduler stepped once per update; the loader left part-way is off Accelerate's list of
    active loaders (gather_for_metrics and --grad-accum read the newest one)."""
    data = request.getfixturevalue(RECIPES[recipe])
    cut = (CHECKPOINT, f"{CHECKPOINT}            if run.batch == 3:\n                break\n")  # the body's end
    no_stale_loader = (  # the loop moved on (the next epoch, or the run's end): the loader it left is closed
        "    run.finish(validate, final_loader)",
        "    run.finish(validate, final_loader)\n    from accelerate.state import GradientState\n"
        "    assert not GradientState().in_dataloader",
    )
    run = tmp_path / "run"
    proc = check_ok(run_in_process(edited(tmp_path, recipe, cut, no_stale_loader), args(recipe, data, run), env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and all("ended by the loop after 3 of " in line for line in lines), proc.stdout
    assert "--max-steps" not in proc.stdout
    per_epoch = int(lines[0].split("ended by the loop after 3 of ")[1].split()[0])
    s = summary(run)
    # the first epoch is behind the loop once it moves on; the second was left part-way
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 1, 6), s
    assert [step for step, _ in rows(run, "eval/accuracy")] == [3, 6]
    assert checkpoint_steps(run) == [6] and (run / "final" / "model.safetensors").is_file()  # at the end only
    assert [step for step, _ in rows(run, "train/loss")] == [1, 2, 3, 4, 5, 6]
    lr_follows_the_schedule(run, per_epoch)


def test_break_and_continue_on_two_processes_through_the_launcher(tmp_path, env, awkward):
    """2 gloo processes under `accelerate launch`: a copy that skips the 2nd and 5th batch of each epoch and leaves it
    at the 6th counts the same steps on both ranks, and its evaluations count the 99 validation images exactly
    once."""
    copy = edited(
        tmp_path,
        "fashion_mnist_mlp",
        (
            TOP,
            "            if run.batch == 6:\n                break\n"
            "            if run.batch % 3 == 2:\n                continue\n"
            f"{TOP}",
        ),
    )
    run = tmp_path / "run"
    proc = check_ok(
        launch(
            copy,
            ["--dataset", awkward, "--epochs", 2, "--batch-size", 32, *SMALL["fashion_mnist_mlp"], "--output-dir", run],
            env,
            nproc=2,
        )
    )
    assert "processes=2" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and all("ended by the loop after 5 of 8 batches" in line for line in lines), proc.stdout
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"], s["processes"]) == ("completed", 1, 6, 2), s
    assert [r["eval/accuracy"] is not None for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r] == [
        True,
        True,
    ]
    assert "99 images" in lines[0] and s["final"]["test/count"] == 82


def test_break_by_the_run_position_resumes_exactly(tmp_path, env, mnist_like, monkeypatch):
    """`if run.batch == 5: break` at the top of the body (the number of the batch in hand, counted across a resume,
    where enumerate() would restart at 0): 4 batches trained an epoch; stopped mid-epoch at step 6 and resumed, the
    run ends with the uninterrupted run's weights and losses."""
    copy = edited(tmp_path, "mnist_convnet", (TOP, f"            if run.batch == 5:\n                break\n{TOP}"))
    base = args("mnist_convnet", mnist_like, tmp_path / "unused")[:-2] + ["--epochs", 3]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process(copy, [*base, "--output-dir", full], env))
    assert summary(full)["global_step"] == 12 and summary(full)["epochs_completed"] == 2  # the third left part-way
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=6)
    same_weights(full, part)
    same_losses(full, part)
    assert summary(part)["global_step"] == 12 and summary(part)["epochs_completed"] == 2


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_break_from_the_epoch_loop_ends_the_run(recipe, tmp_path, env, request):
    """`break` at the end of epoch 1's body with --epochs 3: the run ends there (final evaluation, a checkpoint,
    final/, summary.json saying the loop ended it)."""
    copy = edited(tmp_path, recipe, (EPOCH_END, f"{EPOCH_END}        if epoch == 0:\n            break\n"))
    run = tmp_path / "run"
    proc = check_ok(
        run_in_process(copy, args(recipe, request.getfixturevalue(RECIPES[recipe]), run, "--epochs", 3), env)
    )
    per_epoch = int(proc.stdout.split("steps_per_epoch=")[1].split()[0])
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("epoch ")] == ["epoch 1/3"]
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 1, per_epoch), s
    assert s["ended_early"] == f"the loop ended the run at step {per_epoch} of {3 * per_epoch}"
    assert s["final"]["test/count"] > 0 and (run / "final" / "model.safetensors").is_file()
    assert [step for step, _ in rows(run, "eval/accuracy")] == [per_epoch] and checkpoint_steps(run) == [per_epoch]
    assert json.loads((run / "final" / "model.json").read_text())["epoch"] == 1


# --- continue ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_continue_before_the_step_skips_the_batch(recipe, tmp_path, env, request, monkeypatch):
    """`continue` past every third batch (the 2nd, 5th, ...) before it trains: no optimizer step, no scheduler step,
    no logged loss for it; the epochs still end at the loader's end, and a run stopped in its second epoch resumes
    exactly."""
    skip = (TOP, f"            if run.batch % 3 == 2:\n                continue\n{TOP}")
    copy = edited(tmp_path, recipe, skip)
    base = args(recipe, request.getfixturevalue(RECIPES[recipe]), tmp_path / "unused")[:-2]
    run, part = tmp_path / "run", tmp_path / "part"
    proc = check_ok(run_in_process(copy, [*base, "--output-dir", run], env))
    per_epoch = int(proc.stdout.split("steps_per_epoch=")[1].split()[0])
    skipped = sum(b % 3 == 2 for b in range(1, per_epoch + 1))
    trained = 2 * (per_epoch - skipped)
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 2, trained), s
    assert [step for step, _ in rows(run, "train/loss")] == list(range(1, trained + 1))
    lr_follows_the_schedule(run, per_epoch)
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=per_epoch - skipped + 2)
    same_weights(run, part)
    same_losses(run, part)


# --- return and errors ---------------------------------------------------------------------------------------


def test_return_without_finish_is_recorded_and_resumes_exactly(tmp_path, env, mnist_like, reference_run):
    """`return` from train() at the top of the 6th batch, mid-epoch (5 updates): summary.json says the run is
    unfinished at step 5, the position is checkpointed without the batch in hand (it was not trained on), and the
    unedited recipe resumes from it to the uninterrupted run's weights."""
    ref = reference_run("fashion_mnist_mlp", 1)
    early = (TOP, f"            if run.step == 5:\n                return\n{TOP}")
    copy = edited(tmp_path, "fashion_mnist_mlp", early)
    run = tmp_path / "run"
    proc = run_in_process(copy, [*ref.train_args, "--output-dir", run], env)
    assert proc.returncode == 1 and "returned without calling run.finish" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    s = summary(run)
    assert (s["status"], s["global_step"], s["epochs_completed"]) == ("unfinished", 5, 0), s
    assert checkpoint_steps(run)[-1] == 5 and not (run / "final").exists()
    state = json.loads((run / "checkpoints" / "step-00000005" / "trainer_state.json").read_text())
    assert state["batches_in_epoch"] == 5, state
    check_ok(
        run_in_process("fashion_mnist_mlp", [*ref.train_args, "--output-dir", run, "--resume-from", "latest"], env)
    )
    same_weights(ref.run, run)
    same_losses(ref.run, run)


@pytest.mark.parametrize("where", ["before the step", "after the step"])
def test_an_error_raised_in_the_loop_is_recorded_with_the_steps_taken(where, tmp_path, env, mnist_like):
    """An exception from the user's own code in the loop: summary.json says crashed, names it, and counts the
    updates applied (raised after the 5th update: 5; before the 5th batch trains: 4)."""
    edit = (
        (TOP, f"            if run.step == 4:\n                raise ValueError('my check failed')\n{TOP}")
        if where == "before the step"
        else (
            AFTER_UPDATE,
            f"{AFTER_UPDATE}            if run.step == 5:\n                raise ValueError('my check failed')\n",
        )
    )
    run = tmp_path / "run"
    proc = run_in_process(edited(tmp_path, "fashion_mnist_mlp", edit), args("fashion_mnist_mlp", mnist_like, run), env)
    assert proc.returncode == 1 and "ValueError: my check failed" in proc.stderr
    s = summary(run)
    assert s["status"] == "crashed" and s["error"] == "ValueError: my check failed", s
    assert s["global_step"] == (4 if where == "before the step" else 5), s


# --- a line deleted, a line added ----------------------------------------------------------------------------


def test_a_deleted_line_no_longer_happens_and_an_added_one_does(tmp_path, env, mnist_like):
    """The checkpoint line deleted: --checkpoint-every 3 writes nothing mid-run (the end's checkpoint stays, in
    run.finish). The epoch-end evaluation deleted and an evaluation every 4 updates added by one line: the
    evaluations are at steps 4, 8, 12, 16 and nowhere else."""
    every_4 = f"{AFTER_UPDATE}            if run.step % 4 == 0:\n                run.evaluate(validate, val_loader)\n"
    copy = edited(tmp_path, "fashion_mnist_mlp", (CHECKPOINT, ""), (EPOCH_EVAL, ""), (AFTER_UPDATE, every_4))
    run = tmp_path / "run"
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run, "--checkpoint-every", 3), env))
    assert checkpoint_steps(run) == [18]
    assert [step for step, _ in rows(run, "eval/accuracy")] == [4, 8, 12, 16]
    assert summary(run)["status"] == "completed"


def test_main_is_parse_run_train_and_a_copy_names_its_runs(tmp_path, env, mnist_like):
    """main is three lines (parse, `with TrainingRun`, train): the launcher's answers and a resumed run's settings are
    taken in the constructor, so there is no order to get wrong. A copy's run folder takes the copy's file name."""
    main = copy_recipe("fashion_mnist_mlp", tmp_path / "look.py").read_text().split("def main(argv=None) -> int:")[1]
    calls = [line.strip() for line in main.split("def train(")[0].splitlines() if line.strip()]
    assert [c.split("#")[0].strip() for c in calls if not c.startswith("#")] == [
        "cfg = parse_config(Config, argv, __doc__)",
        "with TrainingRun(cfg, __file__) as run:",
        "train(cfg, run)",
        "return run.exit_code",
    ]
    whole = copy_recipe("fashion_mnist_mlp", tmp_path / "my_digits.py")
    small = ["--dataset", mnist_like, "--max-steps", 2, "--batch-size", 32, *SMALL["fashion_mnist_mlp"]]
    check_ok(run_in_process(whole, small, env, cwd=tmp_path))
    [folder] = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("my_digits-") and summary(folder)["status"] == "completed"
    assert json.loads((folder / "final" / "model.json").read_text())["recipe"] == "my_digits"


# --- the lines the bookkeeping must not hang on --------------------------------------------------------------

TRACK = "                run.track(loss)  # counts the update; the NaN/stop guard (no sync)\n"


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_loop_without_run_track_is_refused_at_its_first_step(nproc, tmp_path, env, mnist_like):
    """`run.track(loss)` deleted (it reads like logging): nothing would count the updates, so a checkpoint would record
    no position and a resume would train batches again. The loop is refused in one paragraph at its first update's
    lines, on every process, before anything is written: exit 2 (1 through the launcher), no traceback, summary.json
    says bad_input and no checkpoint exists."""
    copy = edited(tmp_path, "fashion_mnist_mlp", (TRACK, ""), name="no_track.py")
    run = tmp_path / "run"
    flags = args("fashion_mnist_mlp", mnist_like, run)
    proc = run_in_process(copy, flags, env) if nproc == 1 else launch(copy, flags, env, nproc=2)
    assert proc.returncode == (2 if nproc == 1 else 1), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "without a call of run.track(loss)" in proc.stderr and f'File "{copy}"' not in proc.stderr, proc.stderr
    assert summary(run)["status"] == "bad_input" and not checkpoint_steps(run)
    assert not rows(run, "train/loss")


def test_log_on_the_main_process_only_keeps_the_ranks_in_step(tmp_path, env, awkward):
    """`if accelerator.is_main_process: run.log(...)` (every DDP tutorial's habit), 2 processes, a wall-time checkpoint
    due at every step: rank 0 reads the step's flags early at its log line, and holds them until the all-reduce every
    rank makes, so both ranks answer checkpoint_due alike and write together (a rank alone would wait in save_state's
    collectives until --timeout-s). The run completes with the same checkpoints a 1-process run writes."""
    log = '                run.log({"train/grad_norm": grad_norm})'
    copy = edited(tmp_path, "fashion_mnist_mlp", (log, f"                if accelerator.is_main_process:\n    {log}"))
    flags = ["--dataset", awkward, "--epochs", 2, "--batch-size", 32, *SMALL["fashion_mnist_mlp"], "--log-every", 1]
    flags += ["--checkpoint-every-s", 1e-9, "--keep-checkpoints", 100, "--timeout-s", 60]
    run, one = tmp_path / "run", tmp_path / "one"
    proc = check_ok(launch(copy, [*flags, "--output-dir", run], env, nproc=2, timeout=200))
    assert "processes=2" in proc.stdout
    check_ok(run_in_process(copy, [*flags, "--output-dir", one], env))
    assert summary(run)["status"] == "completed" and summary(run)["global_step"] == 16
    assert checkpoint_steps(run) == checkpoint_steps(one) == list(range(2, 17, 2))
    assert [s for s, _ in rows(run, "train/loss")] == list(range(1, 17))


def test_log_inside_the_accumulation_block_logs_each_update_at_its_step(tmp_path, env, mnist_like):
    """`run.log` moved into the `accumulate` block (after run.track) with --grad-accum 2: run.track counted the
    update, so the line logs update k at step k with the loss of its two micro-batches, as the unedited recipe
    logs it after the block."""
    log = (
        "            if log_now:  # the mean loss since the last log, LR, throughput: one sync\n"
        '                run.log({"train/grad_norm": grad_norm})  # your own scalars go here too\n'
    )
    inside = (
        "                optimizer.zero_grad(set_to_none=True)\n",
        "                optimizer.zero_grad(set_to_none=True)\n"
        "                if log_now:\n"
        '                    run.log({"train/grad_norm": grad_norm})\n',
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", (log, ""), inside, name="log_inside.py")
    plain, moved = tmp_path / "plain", tmp_path / "moved"
    check_ok(run_in_process("fashion_mnist_mlp", args("fashion_mnist_mlp", mnist_like, plain, "--grad-accum", 2), env))
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, moved, "--grad-accum", 2), env))
    assert rows(moved, "train/loss") == rows(plain, "train/loss") and len(rows(plain, "train/loss")) == 18
    lr_follows_the_schedule(plain, 9)  # the scheduler moves at updates, not at micro-batches


def test_epochs_are_completed_by_their_batches_not_by_a_line(tmp_path, env, mnist_like, reference_run):
    """No line of the loop says an epoch ended: a checkpoint at an epoch's last update records the next epoch's start,
    and summary.json and model.json count the epochs whose batches were all trained, whatever the loop does after them
    (here: no epoch-end evaluation at all)."""
    copy = edited(tmp_path, "fashion_mnist_mlp", (EPOCH_EVAL, ""), name="no_epoch_eval.py")
    run = tmp_path / "run"
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run, "--checkpoint-every", 9), env))
    state = json.loads((run / "checkpoints" / "step-00000009" / "trainer_state.json").read_text())
    assert (state["epoch"], state["batches_in_epoch"], state["global_step"]) == (1, 0, 9), state
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 2, 18), s
    assert json.loads((run / "final" / "model.json").read_text())["epoch"] == 2


def test_a_call_before_run_start_is_refused_in_one_paragraph(tmp_path, env, mnist_like):
    """run.evaluate(...) moved above run.start(...): one paragraph naming both calls (exit 2), no traceback."""
    start = "    run.start(model, optimizer, scheduler, train_loader, data, transform)"
    early = (start, f"    run.evaluate(validate, val_loader)\n{start}")
    copy = edited(tmp_path, "fashion_mnist_mlp", early, name="early_eval.py")
    proc = run_in_process(copy, args("fashion_mnist_mlp", mnist_like, tmp_path / "run"), env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "run.evaluate was used before run.start(" in proc.stderr


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resume_that_prepares_another_optimizer_is_refused_naming_both(nproc, tmp_path, env, mnist_like):
    """A run stopped part-way, then resumed by a loop that prepares a second optimizer (e.g. for a head of its own):
    Accelerate would die on a missing optimizer_1.bin with a traceback. Refused in one paragraph naming both counts,
    before anything is loaded; summary.json says this launch's bad_input, not the earlier launch's status."""
    second = (
        "    scheduler = accelerator.prepare(",
        "    head_opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.0))\n"
        "    scheduler = accelerator.prepare(",
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", second, name="second_optimizer.py")
    run = tmp_path / "run"
    flags = args("fashion_mnist_mlp", mnist_like, run)
    check_ok(run_in_process("fashion_mnist_mlp", [*flags, "--max-steps", 4], env))
    assert summary(run)["status"] == "completed"
    flags += ["--resume-from", "latest"]
    proc = run_in_process(copy, flags, env) if nproc == 1 else launch(copy, flags, env, nproc=2)
    assert proc.returncode == (2 if nproc == 1 else 1) and f'File "{copy}"' not in proc.stderr, proc.stderr[-3000:]
    assert "2 optimizers prepared by this launch, 1 in the checkpoint" in proc.stderr, proc.stderr
    s = summary(run)
    assert (s["status"], s["global_step"]) == ("bad_input", 4), s


def test_a_metric_of_your_own_reaches_every_place_the_runs_scalars_go(tmp_path, env, mnist_like):
    """What an Accelerate user types first, `accelerator.log({...}, step=run.step)`, and `run.log({...})` at the
    loop's cadence: both reach metrics.jsonl, TensorBoard (read with its own reader) and curves.png."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mine = (
        "            if cfg.eval_every_steps",
        "            accelerator.log({'train/my_metric': float(run.step) / 2}, step=run.step)\n"
        "            if log_now:\n"
        "                run.log({'train/batch_share': run.batch / 9})\n"
        "            if cfg.eval_every_steps",
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", mine, name="my_metric.py")
    run = tmp_path / "run"
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run, "--log-every", 3), env))
    assert rows(run, "train/my_metric") == [(s, s / 2) for s in range(1, 19)]
    assert [s for s, _ in rows(run, "train/batch_share")] == [3, 6, 9, 12, 15, 18]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/my_metric")] == list(range(1, 19))
    assert [e.step for e in events.Scalars("train/batch_share")] == [3, 6, 9, 12, 15, 18]
    from common.train.plots import curves_figure, read_metrics

    figure = curves_figure(read_metrics(run / "metrics.jsonl"))
    labels = {line.get_label() for ax in figure.axes for line in ax.get_lines()}
    assert {"train/my_metric", "train/batch_share"} <= labels, labels


@pytest.mark.parametrize("recipe", ["fashion_mnist_mlp", "finetune_folder"])
def test_without_a_test_split_the_last_validation_is_the_final_evaluation(recipe, tmp_path, env, mnist_like):
    """A dataset without a test split: the final evaluation is of the validation split, which the epoch's evaluation
    scored at the same weights a moment before; it is not scored again (2 epochs: 2 validations, not 3), and the
    final result is that evaluation's. With a test split (mnist_like), the test split is scored at the end."""
    from helpers import write_image_folder

    counted = ("    def validate(loader):\n", "    def validate(loader):\n        print('validate', flush=True)\n")
    copy = edited(tmp_path, recipe, counted, name=f"counted_{recipe}.py")
    folder = write_image_folder(tmp_path / "no_test", n_per_class=24, shape=(3, 16, 16))
    small = ["--epochs", 2, "--batch-size", 16, *SMALL[recipe]] + (
        ["--image-size", 16] if recipe != "fashion_mnist_mlp" else []
    )
    run = tmp_path / "run"
    proc = check_ok(run_in_process(copy, ["--dataset", folder, *small, "--output-dir", run], env))
    assert proc.stdout.count("validate\n") == 2, proc.stdout
    [final] = [r["val/accuracy"] for r in read_jsonl(run / "metrics.jsonl") if "val/accuracy" in r]
    assert summary(run)["final"]["val/accuracy"] == final == [a for _, a in rows(run, "eval/accuracy")][-1]
    if recipe == "fashion_mnist_mlp":
        with_test = check_ok(run_in_process(copy, args(recipe, mnist_like, tmp_path / "run2"), env))
        assert with_test.stdout.count("validate\n") == 3


def test_checkpoints_follow_wall_time(tmp_path, env, mnist_like, monkeypatch):
    """--checkpoint-every-s: a run shorter than it writes no checkpoint until its end; one whose clock passes it at
    every step writes one at every step, on every rank at the same step (the ranks agree through the guard)."""
    run = tmp_path / "run"
    check_ok(run_in_process("fashion_mnist_mlp", args("fashion_mnist_mlp", mnist_like, run), env))
    assert checkpoint_steps(run) == [18]  # the default, 300 s: none mid-run
    often = tmp_path / "often"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            args("fashion_mnist_mlp", mnist_like, often, "--checkpoint-every-s", 1e-9, "--keep-checkpoints", 100),
            env,
        )
    )
    # asked at each step's all-reduce, answered at the next one (the same step on every rank, whatever the loop runs
    # on one rank only): a checkpoint every other step when the time has always passed
    assert checkpoint_steps(often) == list(range(2, 19, 2))


def test_two_processes_agree_on_the_time_to_checkpoint(tmp_path, env, awkward):
    """2 gloo processes, --checkpoint-every-s 0.3: each rank's clock passes the interval at its own moment, and the
    guard's all-reduce makes every rank write at the same step. Seen in what each rank wrote: a copy whose loop says
    the step at which its rank checkpoints gives the same steps on both ranks (read before the run's exit, so a run
    whose ranks disagreed and then hung in save_state's collectives fails here, naming the steps), and every
    complete checkpoint folder holds both ranks' own files (random_states_0.pkl and random_states_1.pkl: a rank
    writing at another step would put its file into another step's folder)."""
    said = (
        CHECKPOINT,
        "            if run.checkpoint_due():  # --checkpoint-every-s (and --checkpoint-every)\n"
        "                print(f'rank {accelerator.process_index} checkpoints at step {run.step}', flush=True)\n"
        "                run.checkpoint()\n",
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", said, name="said_checkpoints.py")
    run = tmp_path / "run"
    flags = ["--dataset", awkward, "--epochs", 4, "--batch-size", 16, *SMALL["fashion_mnist_mlp"], "--timeout-s", 60]
    flags += ["--checkpoint-every-s", 0.3, "--keep-checkpoints", 100, "--output-dir", run]
    proc = launch(copy, flags, env, nproc=2)
    by_rank = {0: [], 1: []}  # each line is one write, its newline another: they interleave in the launcher's output
    for rank, step in re.findall(r"rank (\d) checkpoints at step (\d+)", proc.stdout):
        by_rank[int(rank)].append(int(step))
    assert by_rank[0] == by_rank[1] and len(by_rank[0]) >= 1, by_rank  # mid-run ones (the end's is run.finish's)
    check_ok(proc)
    assert "processes=2" in proc.stdout
    s = summary(run)
    assert s["status"] == "completed" and checkpoint_steps(run) == sorted({*by_rank[0], s["global_step"]}), (by_rank, s)
    for folder in sorted((run / "checkpoints").glob("step-*")):
        assert {p.name for p in folder.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no rank's stray folder


# --- what follows a step -------------------------------------------------------------------------------------
PRINT_NORM = (
    "                norm = torch.linalg.vector_norm(\n"
    "                    torch.stack([p.grad.norm() for p in model.parameters()]))\n"
    "                print(f'norm before the update {float(norm):.6f}', flush=True)\n"
)


@pytest.mark.parametrize("how", ["--max-grad-norm", "the user's own line"])
def test_gradient_clipping_is_what_reaches_the_update(how, tmp_path, env, mnist_like):
    """Clipping to 0.05 by the recipe's visible --max-grad-norm line, or by a line of the user's own in its place:
    every update sees gradients of norm <= 0.05, while train/grad_norm logs the norm before clipping (what the clip
    returned, passed to run.log by the loop)."""
    clip = (
        []
        if how == "--max-grad-norm"
        else [
            (
                "                if accelerator.sync_gradients and (cfg.max_grad_norm or log_now):\n"
                "                    clip_to = cfg.max_grad_norm or math.inf  # --max-grad-norm 0: measured, "
                "not clipped\n"
                "                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_to)\n",
                "                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # mine\n",
            )
        ]
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", *clip, (OPT_STEP, PRINT_NORM + OPT_STEP))
    run = tmp_path / "run"
    flags = ["--max-grad-norm", 0.05] if how == "--max-grad-norm" else []
    proc = check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run, *flags), env))
    norms = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("norm before the update")]
    assert len(norms) == 18 and max(norms) <= 0.05 * (1 + 1e-4), norms
    logged = [v for _, v in rows(run, "train/grad_norm")]
    assert len(logged) == 18 and min(logged) > 0.05, logged  # measured before the clip


def test_a_scheduler_of_the_users_own_is_stepped_as_written(tmp_path, env, mnist_like):
    """The recipe's scheduler replaced by a StepLR (halve every 4 updates): the logged LR is the user's schedule."""
    copy = edited(
        tmp_path,
        "fashion_mnist_mlp",
        (
            "    scheduler = accelerator.prepare(build_scheduler(optimizer, cfg, math.ceil(len(train_loader) / "
            "cfg.grad_accum)))",
            "    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5))",
        ),
    )
    run = tmp_path / "run"
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run), env))
    lrs = rows(run, "train/lr")
    assert [s for s, _ in lrs] == list(range(1, 19))
    assert all(lr == pytest.approx(4e-3 * 0.5 ** ((s - 1) // 4)) for s, lr in lrs), lrs


def test_a_second_optimizer_steps_once_per_batch_and_resumes_exactly(tmp_path, env, mnist_like, monkeypatch):
    """The biases moved to an SGD optimizer of their own, prepared and stepped in the loop beside the recipe's
    AdamW: one optimizer step per batch is counted, both train, and a resume restores both."""
    copy = edited(
        tmp_path,
        "fashion_mnist_mlp",
        (
            "    optimizer = build_optimizer(cfg, model)\n",
            "    biases = [p for n, p in model.named_parameters() if n.endswith('bias')]\n"
            "    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.endswith('bias')],\n"
            "                                  lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)\n"
            "    bias_optimizer = accelerator.prepare(torch.optim.SGD(biases, lr=0.05, momentum=0.9))\n"
            "    initial_bias = [b.detach().clone() for b in biases]\n",
        ),
        (
            "                optimizer.zero_grad(set_to_none=True)\n",
            "                optimizer.zero_grad(set_to_none=True)\n"
            "                bias_optimizer.step()\n"
            "                bias_optimizer.zero_grad(set_to_none=True)\n",
        ),
        (
            "    run.finish(validate, final_loader)",
            "    assert all(not torch.equal(a, b) for a, b in zip(initial_bias, biases))\n"
            "    run.finish(validate, final_loader)",
        ),
    )
    base = args("fashion_mnist_mlp", mnist_like, tmp_path / "unused")[:-2]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process(copy, [*base, "--output-dir", full], env))
    assert summary(full)["global_step"] == 18
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=7)
    same_weights(full, part)
    same_losses(full, part)


def test_fp16_skipped_updates_are_counted_from_the_loss_scale():
    """With fp16 loss scaling (GradScaler, fused AdamW, as on a GPU) an overflowing update is skipped inside the fused
    kernel, where Accelerate cannot see it: the run reads the loss scale (what run.track does at the next update) and
    counts the skip; a taken update is not counted; 25 skips in a row stop the run in one paragraph."""
    from common.errors import NonFiniteLoss
    from common.train.guard import MAX_CONSECUTIVE_SKIPS, StepChecks

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")

    class OneProcess:  # what StepChecks reads of an Accelerator
        device, mixed_precision, num_processes, is_main_process = torch.device("cpu"), "fp16", 1, True

        def __init__(self):
            self.scaler = scaler

    checks = StepChecks(OneProcess(), opt, Path("."))

    def update(overflow: bool) -> bool:
        loss = model(torch.ones(3, 4)).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        checks.track(loss.detach())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return checks.update_taken()  # what run.track reads of the update before

    before = [p.clone() for p in model.parameters()]
    assert not update(overflow=True) and checks.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the fused kernel skipped it
    assert update(overflow=False) and checks.skipped == 1
    with pytest.raises(NonFiniteLoss, match="skipped the last 25 optimizer steps in a row"):
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            update(overflow=True)


def test_a_photo_augmentation_of_your_own_is_an_edit_of_the_copy(tmp_path, env, photos_like):
    """The photo recipe's per-image augmentation is its train_view: adding one of torchvision's transforms is one line
    in the copy (no library edit), and every training batch the loader's worker hands the loop carries it (here
    RandomGrayscale(p=1): the photos, colour ones among them, arrive with three equal channels, which the copy's loop
    counts in each batch); a train_view that no longer ends at --image-size is named in one paragraph at the first
    batch."""
    crop = "v2.RandomResizedCrop(side, scale=(cfg.min_crop_scale, 1.0), antialias=True), "
    grey = edited(
        tmp_path,
        "finetune_folder",
        (
            "    if cfg.auto_augment:\n",
            "    steps.append(v2.RandomGrayscale(p=1.0))  # mine\n    if cfg.auto_augment:\n",
        ),
        (
            TOP,
            "            grey = (images == images[:, :1]).flatten(1).all(1)  # 3 equal channels\n"
            "            print(f'grey images: {int(grey.sum())} of {len(grey)}', flush=True)\n" + TOP,
        ),
    )
    run = tmp_path / "run"
    proc = check_ok(run_in_process(grey, args("finetune_folder", photos_like, run, "--workers", 1), env))
    counts = [line.split(": ")[1].split(" of ") for line in proc.stdout.splitlines() if line.startswith("grey images")]
    per_epoch = int(proc.stdout.split("steps_per_epoch=")[1].split()[0])
    assert len(counts) == 2 * per_epoch and all(a == b for a, b in counts), counts  # every image of every batch
    assert summary(run)["status"] == "completed"
    uncropped = edited(tmp_path, "finetune_folder", (crop, ""), name="uncropped.py")
    proc = run_in_process(uncropped, args("finetune_folder", photos_like, tmp_path / "run2"), env)
    assert proc.returncode == 2 and "train_view made a (3," in proc.stderr and "Traceback" not in proc.stderr, (
        proc.stderr[-2000:]
    )


def test_a_loop_without_evaluations_says_best_is_not_written(tmp_path, env, mnist_like):
    """Both evaluation lines deleted: no best/, and the run says so (a NOTE naming final/ as what predict and export
    use, and the summary's best row), where it printed a bare '-' under a final accuracy."""
    every = (
        "            if cfg.eval_every_steps and run.step % cfg.eval_every_steps == 0:\n"
        "                run.evaluate(validate, val_loader)  # pictures=True: its pictures too\n"
    )
    copy = edited(tmp_path, "fashion_mnist_mlp", (EPOCH_EVAL, ""), (every, ""), name="no_evaluations.py")
    run = tmp_path / "run"
    proc = check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run), env))
    assert "the loop made no evaluation during the run, so best/ was not written" in proc.stdout, proc.stdout
    assert "(no evaluation during the run: no best/)" in proc.stdout
    assert not (run / "best").exists() and (run / "final" / "model.safetensors").is_file()


def test_a_log_line_moved_above_the_forward_is_not_taken_for_a_missing_track(tmp_path, env, mnist_like):
    """The log line moved to the top of the batch loop's body (before run.track of the first batch): it logs the
    window of the updates before it and the run completes; only a loop that goes a whole step without run.track is
    refused."""
    log = (
        "            if log_now:  # the mean loss since the last log, LR, throughput: one sync\n"
        '                run.log({"train/grad_norm": grad_norm})  # your own scalars go here too\n'
    )
    top = (TOP, f"            if run.step % cfg.log_every == 0:\n                run.log()\n{TOP}")
    copy = edited(tmp_path, "fashion_mnist_mlp", (log, ""), top, name="log_at_top.py")
    run = tmp_path / "run"
    check_ok(run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run), env))
    assert summary(run)["status"] == "completed" and [s for s, _ in rows(run, "train/loss")] == list(range(1, 19))
