"""The loop a user copies stays right when they edit it. Each test edits a copied recipe's text as a user would
(``common.tools.copy_recipe``, then a string replaced in the copy), runs the copy, and reads what the run left:
steps, epochs, evaluations, the LR trace in metrics.jsonl, checkpoints and summary.json.

Runs: 1 process (``main()`` in this process), --batch-size 32: mnist_like holds 288 training images after the 10%
held out, so 9 batches an epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.schedules import lr_multiplier

from helpers import SMALL, check_ok, launch, read_jsonl, run_in_process

RECIPES = {
    "fashion_mnist_mlp": "mnist_like",
    "mnist_convnet": "mnist_like",
    "cifar_cnn": "cifar_like",
    "finetune_folder": "photos_like",
}
TOP = "            with accelerator.accumulate(model):\n"  # the first line of the batch loop's body
STEP = "                run.step(loss)"  # the line after accelerator.backward(loss)
OPT_STEP = "                optimizer.step()\n"
END = "\n\n    run.finish("  # after the loop (both bodies end before it)
FOR_BATCHES = "        for images, labels in run.batches(train_loader):"


def edited(tmp_path: Path, recipe: str, *edits, name: str = "") -> Path:
    """A copy of ``recipe`` (as `python -m common.tools.copy_recipe` makes it) with each (old, new) applied once;
    ``name``: the copy's file name (one per edited text: a test process imports each file once)."""
    from common.tools.copy_recipe import copy_recipe

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
        if run.global_step + 1 == step:
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
@pytest.mark.parametrize("where", ["top", "bottom"])
def test_break_from_the_batch_loop_ends_that_epoch(recipe, where, tmp_path, env, request):
    """`break` after 3 batches, at the top of the body (before batch 4 trains) or at its bottom (after batch 3
    trained): each epoch ends after 3 batches, is counted, evaluated, checkpointed and said to be ended by the loop;
    the scheduler stepped once per update. Before: epoch 1's first batches ran again until the step count reached
    the planned total, each round printed as --max-steps, and summary.json said 0 epochs."""
    data = request.getfixturevalue(RECIPES[recipe])
    enumerate_ = (FOR_BATCHES, "        for i, (images, labels) in enumerate(run.batches(train_loader)):")
    cut = (
        (TOP, f"            if i == 3:\n                break\n{TOP}")
        if where == "top"
        else (END, f"\n            if i == 2:\n                break{END}")
    )
    # the train loader left mid-iteration is off Accelerate's list of active loaders (gather_for_metrics and
    # --grad-accum read the newest one)
    no_stale_loader = (
        "    run.finish(",
        "    from accelerate.state import GradientState\n    assert not GradientState().in_dataloader\n    run.finish(",
    )
    run = tmp_path / "run"
    proc = check_ok(
        run_in_process(edited(tmp_path, recipe, enumerate_, cut, no_stale_loader), args(recipe, data, run), env)
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and all("ended by the loop after 3 of " in line for line in lines), proc.stdout
    assert "--max-steps" not in proc.stdout
    per_epoch = int(lines[0].split("ended by the loop after 3 of ")[1].split()[0])
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 2, 6), s
    assert [step for step, _ in rows(run, "eval/accuracy")] == [3, 6]
    assert checkpoint_steps(run)[-2:] == [3, 6] and (run / "final" / "model.safetensors").is_file()
    assert [step for step, _ in rows(run, "train/loss")] == [1, 2, 3, 4, 5, 6]
    lr_follows_the_schedule(run, per_epoch)


def test_break_and_continue_on_two_processes_through_the_launcher(tmp_path, env, awkward):
    """2 gloo processes under `accelerate launch`: a copy that skips every third batch and leaves each epoch after 5
    batches counts the same steps on both ranks, and its evaluations count the 99 validation images exactly once."""
    copy = edited(
        tmp_path,
        "fashion_mnist_mlp",
        (
            TOP,
            "            if run.batch == 5:\n                break\n"
            "            if run.batch % 3 == 1:\n                continue\n"
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
    assert len(lines) == 2 and all(
        "ended by the loop after 5 of 8 batches (2 skipped by the loop)" in line for line in lines
    ), proc.stdout
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"], s["processes"]) == ("completed", 2, 6, 2), s
    assert [r["eval/accuracy"] is not None for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r] == [
        True,
        True,
    ]
    assert "99 images" in lines[0] and s["final"]["test/count"] == 82


def test_break_by_the_run_position_resumes_exactly(tmp_path, env, mnist_like, monkeypatch):
    """`if run.batch == 4: break` (the epoch's batch, counted across a resume, where enumerate() would restart at 0):
    stopped mid-epoch at step 6 and resumed, the run ends with the uninterrupted run's weights and losses."""
    copy = edited(tmp_path, "mnist_convnet", (TOP, f"            if run.batch == 4:\n                break\n{TOP}"))
    base = args("mnist_convnet", mnist_like, tmp_path / "unused")[:-2] + ["--epochs", 3]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process(copy, [*base, "--output-dir", full], env))
    assert summary(full)["global_step"] == 12 and summary(full)["epochs_completed"] == 3
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=6)
    same_weights(full, part)
    same_losses(full, part)
    assert summary(part)["global_step"] == 12 and summary(part)["epochs_completed"] == 3


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_break_from_the_epoch_loop_ends_the_run(recipe, tmp_path, env, request):
    """`break` at the end of epoch 1's body with --epochs 3: the epoch ends (its line, evaluation, checkpoint), then
    the run does (final evaluation, final/, summary.json saying the loop ended it). Before: epoch 1 was neither
    evaluated nor checkpointed and summary.json said 0 epochs completed."""
    copy = edited(tmp_path, recipe, (END, f"\n        if epoch == 0:\n            break{END}"))
    run = tmp_path / "run"
    proc = check_ok(
        run_in_process(copy, args(recipe, request.getfixturevalue(RECIPES[recipe]), run, "--epochs", 3), env)
    )
    per_epoch = int(proc.stdout.split("steps_per_epoch=")[1].split()[0])
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("epoch ")] == ["epoch 1/3"]
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 1, per_epoch), s
    assert s["ended_early"] == "the loop left run.epochs() after epoch 1 of 3"
    assert s["final"]["test/count"] > 0 and (run / "final" / "model.safetensors").is_file()
    assert [step for step, _ in rows(run, "eval/accuracy")] == [per_epoch] and checkpoint_steps(run)[-1] == per_epoch
    assert json.loads((run / "final" / "model.json").read_text())["epoch"] == 1


# --- continue ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_continue_before_the_step_skips_the_batch(recipe, tmp_path, env, request, monkeypatch):
    """`continue` past every third batch before it trains: no optimizer step, no scheduler step, no logged loss for
    it; the epochs still end at the loader's end, and a run stopped in its second epoch resumes exactly. Before: the
    run stopped at the first skipped batch, saying run.step was never called."""
    skip = (TOP, f"            if run.batch % 3 == 1:\n                continue\n{TOP}")
    copy = edited(tmp_path, recipe, skip)
    base = args(recipe, request.getfixturevalue(RECIPES[recipe]), tmp_path / "unused")[:-2]
    run, part = tmp_path / "run", tmp_path / "part"
    proc = check_ok(run_in_process(copy, [*base, "--output-dir", run], env))
    per_epoch = int(proc.stdout.split("steps_per_epoch=")[1].split()[0])
    skipped = sum(b % 3 == 1 for b in range(per_epoch))
    trained = 2 * (per_epoch - skipped)
    s = summary(run)
    assert (s["status"], s["epochs_completed"], s["global_step"]) == ("completed", 2, trained), s
    assert [step for step, _ in rows(run, "train/loss")] == list(range(1, trained + 1))
    assert sum(f"({skipped} skipped by the loop)" in line for line in proc.stdout.splitlines()) == 2, proc.stdout
    lr_follows_the_schedule(run, per_epoch)
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=per_epoch - skipped + 2)
    same_weights(run, part)
    same_losses(run, part)


@pytest.mark.parametrize("how", ["continue", "break"])
def test_leaving_a_batch_between_run_step_and_the_optimizer_step_is_refused(how, tmp_path, env, mnist_like):
    """`continue` (or `break`) after run.step(loss) and before optimizer.step(): the batch's loss was counted and its
    gradients left for the next update, but nothing updated. Before, each such batch was counted as a step (40 steps
    for 27 updates, the LR schedule left far from its end, exit 0). Now the run stops at that batch in one
    paragraph naming the fix, exit 2, with the steps that did update counted."""
    edit = (STEP, f"{STEP}\n                if run.batch == 4:\n                    {how}")
    copy = edited(tmp_path, "mnist_convnet", edit, name=f"left_{how}.py")
    run = tmp_path / "run"
    proc = run_in_process(copy, args("mnist_convnet", mnist_like, run), env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "without calling optimizer.step()" in proc.stderr and "before run.step(loss)" in proc.stderr
    assert "Traceback" not in proc.stderr
    s = summary(run)
    assert s["global_step"] == 4 and s["status"] == "bad_input", s
    assert [step for step, _ in rows(run, "train/loss")] == [1, 2, 3, 4]


def test_a_loop_that_skips_every_batch_stops_at_the_epoch_end(tmp_path, env, mnist_like):
    copy = edited(tmp_path, "fashion_mnist_mlp", (TOP, f"            continue\n{TOP}"))
    proc = run_in_process(copy, args("fashion_mnist_mlp", mnist_like, tmp_path / "run"), env)
    assert proc.returncode == 2 and "without calling run.step(loss)" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# --- return and errors ---------------------------------------------------------------------------------------


def test_return_without_finish_is_recorded_and_resumes_exactly(tmp_path, env, mnist_like, reference_run):
    """`return` from train() after 5 steps, mid-epoch: summary.json says the run is unfinished at step 5, the
    position is checkpointed, and the unedited recipe resumes from it to the uninterrupted run's weights. Before:
    exit 0 with summary.json still saying "running" and the steps since the last checkpoint lost."""
    ref = reference_run("fashion_mnist_mlp", 1)
    early = (TOP, f"            if run.global_step == 5:\n                return\n{TOP}")
    copy = edited(tmp_path, "fashion_mnist_mlp", early)
    run = tmp_path / "run"
    proc = run_in_process(copy, [*ref.train_args, "--output-dir", run], env)
    assert proc.returncode == 1 and "returned without calling run.finish" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    s = summary(run)
    assert (s["status"], s["global_step"], s["epochs_completed"]) == ("unfinished", 5, 0), s
    assert checkpoint_steps(run)[-1] == 5 and not (run / "final").exists()
    check_ok(
        run_in_process("fashion_mnist_mlp", [*ref.train_args, "--output-dir", run, "--resume-from", "latest"], env)
    )
    same_weights(ref.run, run)
    same_losses(ref.run, run)


@pytest.mark.parametrize("where", ["before the step", "after the step"])
def test_an_error_raised_in_the_loop_is_recorded_with_the_steps_taken(where, tmp_path, env, mnist_like):
    """An exception from the user's own code in the loop: summary.json says crashed, names it, and counts the
    updates applied (raised after optimizer.step of the 5th batch: 5; before the 5th batch trains: 4). Before: an
    update applied just before the error was not counted."""
    edit = (
        (TOP, f"            if run.global_step == 4:\n                raise ValueError('my check failed')\n{TOP}")
        if where == "before the step"
        else (END, f"\n            if run.batch == 4:\n                raise ValueError('my check failed'){END}")
    )
    run = tmp_path / "run"
    proc = run_in_process(edited(tmp_path, "fashion_mnist_mlp", edit), args("fashion_mnist_mlp", mnist_like, run), env)
    assert proc.returncode == 1 and "ValueError: my check failed" in proc.stderr
    s = summary(run)
    assert s["status"] == "crashed" and s["error"] == "ValueError: my check failed", s
    assert s["global_step"] == (4 if where == "before the step" else 5), s


def test_a_second_pass_over_the_batches_in_one_epoch_is_refused(tmp_path, env, mnist_like):
    second = (END, f"\n        for images, labels in run.batches(train_loader):\n            pass{END}")
    run = tmp_path / "run"
    proc = run_in_process(
        edited(tmp_path, "fashion_mnist_mlp", second), args("fashion_mnist_mlp", mnist_like, run), env
    )
    assert proc.returncode == 2 and "run.batches() was called a second time in one epoch" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert "Traceback" not in proc.stderr


# --- what follows a step -------------------------------------------------------------------------------------

PRINT_NORM = (
    "                norm = torch.linalg.vector_norm(\n"
    "                    torch.stack([p.grad.norm() for p in model.parameters()]))\n"
    "                print(f'norm before the update {float(norm):.6f}', flush=True)\n"
)


@pytest.mark.parametrize("how", ["--max-grad-norm", "the user's own line"])
def test_gradient_clipping_is_what_reaches_the_update(how, tmp_path, env, mnist_like):
    """Clipping to 0.05 by the recipe's visible --max-grad-norm line, or by a line of the user's own in its place:
    every update sees gradients of norm <= 0.05, while train/grad_norm logs the norm before clipping."""
    clip = (
        []
        if how == "--max-grad-norm"
        else [
            (
                "                if cfg.max_grad_norm and accelerator.sync_gradients:  # --max-grad-norm\n"
                "                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)\n",
                "                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # mine\n",
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
            "    run.finish(validate(final_loader))",
            "    assert all(not torch.equal(a, b) for a, b in zip(initial_bias, biases))\n"
            "    run.finish(validate(final_loader))",
        ),
    )
    base = args("fashion_mnist_mlp", mnist_like, tmp_path / "unused")[:-2]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process(copy, [*base, "--output-dir", full], env))
    assert summary(full)["global_step"] == 18
    stop_and_resume(tmp_path, monkeypatch, env, copy, base, part, step=7)
    same_weights(full, part)
    same_losses(full, part)


def test_fp16_skipped_steps_leave_the_lr_and_the_averages_alone():
    """What the loop's `if run.step_taken():` reads: with fp16 loss scaling (GradScaler, fused AdamW, as on a
    GPU) an overflowing step is skipped, and the scheduler and the EMA under that line stay put; a step taken moves
    both. A --grad-accum micro-batch (no sync) is no step either."""
    from common.averaging import EMA
    from common.train.guard import StepChecks

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")

    class OneProcess:  # what StepChecks and EMA read of an Accelerator
        device, mixed_precision, num_processes, is_main_process = torch.device("cpu"), "fp16", 1, True

        def __init__(self):
            self.scaler = scaler

        def unwrap_model(self, m, keep_torch_compile=True):
            return m

        def register_save_state_pre_hook(self, hook):
            pass

        register_load_state_pre_hook = register_save_state_pre_hook

    acc = OneProcess()
    checks = StepChecks(acc, opt, Path("."))
    checks.watch_updates(opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    ema = EMA(acc, model, 0.5)

    def batch(overflow: bool, sync: bool = True) -> bool:
        loss = model(torch.ones(3, 4)).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        checks.track(loss.detach())  # what run.step does for the loss
        if sync:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        taken = checks.step_taken(sync)
        if taken:  # the recipe's lines
            scheduler.step()
            ema.update()
        checks.next_batch()
        return taken

    lr, averaged = opt.param_groups[0]["lr"], [p.clone() for p in ema.module.parameters()]
    assert not batch(overflow=True)
    assert opt.param_groups[0]["lr"] == lr and all(torch.equal(a, b) for a, b in zip(averaged, ema.module.parameters()))
    assert checks.skipped == 1
    assert not batch(overflow=False, sync=False)
    assert batch(overflow=False)
    assert opt.param_groups[0]["lr"] < lr and not all(
        torch.equal(a, b) for a, b in zip(averaged, ema.module.parameters())
    )


def test_optimizer_step_without_run_step_stops_before_the_update(tmp_path, env, mnist_like):
    """The recipe's run.step line deleted: the first optimizer.step() stops the run before it updates anything."""
    copy = edited(tmp_path, "fashion_mnist_mlp", (STEP, "                pass  #"))
    run = tmp_path / "run"
    proc = run_in_process(copy, args("fashion_mnist_mlp", mnist_like, run), env)
    assert proc.returncode == 2 and "did not call run.step(loss) before optimizer.step()" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "checkpoints").exists()
    assert summary(run)["global_step"] == 0


def test_a_photo_augmentation_of_your_own_is_an_edit_of_the_copy(tmp_path, env, photos_like):
    """The photo recipe's per-image augmentation is its train_view: adding torchvision's ColorJitter is one line in
    the copy (no library edit), and it trains; a train_view that no longer ends at --image-size is named in one
    paragraph at the first batch."""
    crop = "v2.RandomResizedCrop(side, scale=(cfg.min_crop_scale, 1.0), antialias=True), "
    jitter = edited(
        tmp_path,
        "finetune_folder",
        (
            "    if cfg.auto_augment:\n",
            "    steps.append(v2.ColorJitter(0.4, 0.4, 0.4))  # mine\n    if cfg.auto_augment:\n",
        ),
    )
    run = tmp_path / "run"
    check_ok(run_in_process(jitter, args("finetune_folder", photos_like, run), env))
    assert summary(run)["status"] == "completed"
    uncropped = edited(tmp_path, "finetune_folder", (crop, ""), name="uncropped.py")
    proc = run_in_process(uncropped, args("finetune_folder", photos_like, tmp_path / "run2"), env)
    assert proc.returncode == 2 and "train_view made a (3," in proc.stderr and "Traceback" not in proc.stderr, (
        proc.stderr[-2000:]
    )
