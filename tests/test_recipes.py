"""End to end: each recipe run at 1 process (in this process) and at 2 real gloo processes
(`accelerate launch`), on tiny on-disk data; the 2-process equivalence and eval-count promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import CONFIGS, REPO, check_ok, launch, read_jsonl, read_scalars, run_in_process

RECIPES = ["fashion_mnist_mlp", "mnist_convnet", "cifar_cnn"]
EXPECTED_TAGS = {
    "train/loss",
    "train/lr",
    "train/samples_per_sec",
    "eval/loss",
    "eval/accuracy",
    "test/loss",
    "test/accuracy",
}


def startup(proc) -> dict:
    line = next(l for l in proc.stdout.splitlines() if l.startswith("startup:"))
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("nproc", [1, 2])
def test_recipe_end_to_end(recipe, nproc, reference_run):
    ref = reference_run(recipe, nproc)
    proc, run = ref.proc, ref.run
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
    # metrics.jsonl carries the same numbers, one line per step
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    tb_loss = dict(scalars["train/loss"])
    logged = [row for row in rows if "train/loss" in row]
    assert len(logged) == len(tb_loss) > 0
    for row in logged:
        assert row["train/loss"] == pytest.approx(tb_loss[row["step"]], rel=1e-6)
    epoch_lines = [l for l in proc.stdout.splitlines() if l.startswith("epoch ")]
    assert len(epoch_lines) == 2, proc.stdout
    for i, line in enumerate(epoch_lines, 1):
        assert re.fullmatch(
            rf"epoch {i}/2: train loss \d+\.\d{{4}} \| eval loss \d+\.\d{{4}} accuracy \d\.\d{{4}} "
            rf"\(\d+ images\) \| \d+\.\d s",
            line,
        ), line
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    # every test image counted exactly once (fashion_mnist_mlp at 2 processes reads the 82-image test split)
    expected = 64 if recipe == "cifar_cnn" else 82 if (recipe, nproc) == ("fashion_mnist_mlp", 2) else 99
    assert summary["final"]["test/count"] == expected
    assert summary["processes"] == nproc
    assert (run / "curves.png").stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_files[0].parent), size_guidance={"images": 0})
    acc.Reload()
    assert {"test/confusion_matrix", "test/misclassified"} <= set(acc.Tags()["images"])
    weights = load_file(str(run / "final" / "model.safetensors"))
    assert weights and all(torch.isfinite(v.float()).all() for v in weights.values())
    assert json.loads((run / "config.json").read_text())["epochs"] == 2
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["recipe"] == recipe and card["recipe_file"] == str(REPO / "recipes" / f"{recipe}.py")


def test_eval_only_on_two_processes(reference_run, env):
    """--eval-only on a finished run, at 2 processes: every test image counted once."""
    ref = reference_run("mnist_convnet", 2)
    proc = check_ok(
        launch(
            "mnist_convnet",
            ["--dataset", ref.dataset, "--eval-only", "--checkpoint", ref.run, "--width", "8"],
            env,
            nproc=2,
        )
    )
    assert "eval-only: test accuracy" in proc.stdout
    result = json.loads((ref.run / "best" / "eval-test.json").read_text())
    assert result["count"] == 99 and result["processes"] == 2 and 0.0 <= result["accuracy"] <= 1.0


def test_eval_counts_awkward_sizes_exactly_on_two_processes(reference_run):
    """99 validation images, eval batch 10 per process x 2 processes: every image counted once; 82 test images."""
    ref = reference_run("fashion_mnist_mlp", 2)
    epoch_lines = [l for l in ref.proc.stdout.splitlines() if l.startswith("epoch ")]
    assert len(epoch_lines) == 2 and all("(99 images)" in l for l in epoch_lines), ref.proc.stdout
    assert json.loads((ref.run / "summary.json").read_text())["final"]["test/count"] == 82


def test_ddp_equals_single_process_with_double_batch(tmp_path, env, reference_run):
    """MLP (no BatchNorm, no dropout): 2 processes x batch 16 == 1 process x batch 32, weights allclose."""
    ref = reference_run("fashion_mnist_mlp", 2)
    one = tmp_path / "one"
    check_ok(run_in_process("fashion_mnist_mlp", [*ref.train_args, "--output-dir", one], env))
    a = load_file(str(one / "final" / "model.safetensors"))
    b = load_file(str(ref.run / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        # fp32 sums in another order (the all-reduce; on a CPU with AMX, other matmul blocking) move a weight by
        # ~1e-5 after 16 Adam steps; a wrong gradient average moves them by the LR's order (1e-3)
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=5e-5)
    lr1 = [r["train/lr"] for r in read_jsonl(one / "metrics.jsonl") if "train/lr" in r]
    lr2 = [r["train/lr"] for r in read_jsonl(ref.run / "metrics.jsonl") if "train/lr" in r]
    assert lr1 == lr2 and len(lr1) == 16  # the same LR trace at 1 and 2 processes


def test_progress_lines_when_stdout_is_not_a_terminal(reference_run):
    """--progress-every-s 0: a progress line at every --log-every step (1 here) of the 18 steps."""
    ref = reference_run("fashion_mnist_mlp", 1)
    lines = [l for l in ref.proc.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 18, ref.proc.stdout
    for step, line in enumerate(lines, 1):
        epoch = 1 if step <= 9 else 2
        assert re.match(rf"step {step}/18 \(epoch {epoch}/2\) loss \d+\.\d{{4}} .*samples/s ETA ", line), line


def test_learns_far_above_chance(reference_run):
    ref = reference_run("mnist_convnet", 1)  # run with --target-accuracy 0.9
    assert "target reached: final test accuracy" in ref.proc.stdout
    summary = json.loads((ref.run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final"]["test/accuracy"] >= 0.9  # chance is 0.25


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
def test_help_lists_every_knob(recipe, env):
    proc = run_in_process(recipe, ["--help"], env)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--dataset", "--epochs", "--batch-size", "--lr", "--resume-from", "--output-dir", "--seed"):
        assert flag in proc.stdout
    assert "(default:" in proc.stdout


def test_a_field_given_only_a_new_default_keeps_its_help_and_choices(tmp_path):
    """A recipe states its own defaults (``epochs: int = 3``); --help and --config still describe and check them."""
    from dataclasses import dataclass

    from common.config import CommonConfig, build_parser, parse_config

    @dataclass
    class Mine(CommonConfig):
        epochs: int = 7
        schedule: str = "linear"

    text = build_parser(Mine).format_help()
    assert "number of passes over the training split (default: 7)" in " ".join(text.split())
    assert "LR schedule after warm-up" in " ".join(text.split("--schedule STR")[-1].split())
    for argv in (["--schedule", "sideways"], ["--config", str(tmp_path / "bad.json")]):  # choices: flag and file
        (tmp_path / "bad.json").write_text('{"schedule": "sideways"}')
        with pytest.raises(SystemExit) as ended:
            parse_config(Mine, argv)
        assert ended.value.code == 2


def test_offline_hub_id_fails_fast_with_one_paragraph(tmp_path, env):
    """No network and no offline flags set: a clear error, not minutes of retries (a hang times out here)."""
    env = {**env}
    env.pop("HF_HUB_OFFLINE"), env.pop("HF_DATASETS_OFFLINE")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "mnist_convnet.py"),
            "--dataset",
            "someone/not-cached-dataset",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "someone/not-cached-dataset" in proc.stderr and "--dataset" in proc.stderr


def test_decoded_cache_is_reused(tmp_path, env, mnist_like):
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--width", "8", "--max-steps", 1]
    first = check_ok(run_in_process("mnist_convnet", [*args, "--output-dir", tmp_path / "a"], env))
    assert "decoding the train split" in first.stdout
    assert list((tmp_path / "decoded-cache").glob("*.safetensors"))
    second = check_ok(run_in_process("mnist_convnet", [*args, "--output-dir", tmp_path / "b"], env))
    assert "decoding" not in second.stdout


def test_a_small_split_keeps_its_last_batch_and_resumes_exactly(tmp_path, env, mnist_like):
    """288 training images at batch 100: dropping the last incomplete batch lost 88 of them (31%) every epoch,
    unsaid. It is kept (said on the startup line: 3 steps an epoch, not 2), and a run stopped at step 4 and resumed
    ends with the uninterrupted run's weights and losses."""
    from helpers import stopped_at

    base = [
        "--dataset",
        mnist_like,
        "--epochs",
        2,
        "--batch-size",
        100,
        "--hidden",
        32,
        "--lr",
        4e-3,
        "--log-every",
        1,
        "--checkpoint-every",
        4,
        "--keep-checkpoints",
        10,
    ]
    full = tmp_path / "full"
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", full], env))
    assert "the last training batch of each epoch is kept (88 of 288 images" in proc.stdout, proc.stdout
    assert "steps_per_epoch=3" in proc.stdout
    assert json.loads((full / "summary.json").read_text())["global_step"] == 6
    part = stopped_at(full, 4, tmp_path / "part")
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", part, "--resume-from", "latest"], env))
    losses = lambda r: [(x["step"], x["train/loss"]) for x in read_jsonl(r / "metrics.jsonl") if "train/loss" in x]
    assert losses(part) == losses(full)
    a, b = load_file(str(full / "final" / "model.safetensors")), load_file(str(part / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_recipe_process_freezes_what_is_alive_before_the_interpreter_exits(tmp_path, env, mnist_like):
    """The interpreter's garbage collections at shutdown walked every object torch, Accelerate and the rest left
    (about 1 s of every recipe process's exit on 2 cores): importing the run registers gc.freeze at exit, so they skip
    it. An exit handler registered before the recipe is imported runs after it and sees the frozen objects; the run
    still ends well."""
    probe = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count(), flush=True))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--width", "8", "--max-steps", 2]
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(REPO / "recipes" / "mnist_convnet.py"), *map(str, args),
         "--output-dir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen = int(re.search(r"frozen at exit: (\d+)", proc.stdout).group(1))
    assert frozen > 10_000, proc.stdout[-2000:]  # torch's modules and the rest, not a handful
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
