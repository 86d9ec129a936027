"""Every command does what its user expects: the best model by the right direction, --eval-only on the
run's own split, no run written into a folder that is not one, logs a cluster user can read, a clear
word when the launcher gave fewer processes, and a copied recipe with a model of its own that predict,
export and --eval-only serve without any change to common/."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import (
    ACCELERATE,
    REPO,
    check_ok,
    copy_recipe,
    read_jsonl,
    recipe_env,
    run_in_process,
    write_image_folder,
)

MLP = ["--hidden", "32"]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory, mnist_like):
    """One short 3-epoch MLP run that several tests read: best/ chosen by eval/loss, a progress line at
    every log step (as in a log file), and --max-steps below --log-every on the last epoch."""
    root = tmp_path_factory.mktemp("user-commands")
    env = recipe_env(root)
    run = root / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        3,
        "--batch-size",
        32,
        *MLP,
        "--lr",
        "3e-2",
        "--monitor",
        "eval/loss",
        "--progress-every-s",
        0,
        "--log-every",
        2,
        "--output-dir",
        run,
    ]
    proc = check_ok(run_in_process("fashion_mnist_mlp", args, env))
    return run, proc, env


def test_best_model_by_loss_keeps_the_lowest_loss(mlp_run):
    run, _, _ = mlp_run
    evals = [(r["step"], r["eval/loss"]) for r in read_jsonl(run / "metrics.jsonl") if "eval/loss" in r]
    assert len(evals) == 3 and len({v for _, v in evals}) == 3
    card = json.loads((run / "best" / "model.json").read_text())
    assert card["metrics"]["eval/loss"] == min(v for _, v in evals)  # not the highest, as "max" would keep
    assert card["config"]["mode"] == "min"  # inferred from the metric


def test_unknown_monitor_is_refused_before_anything_runs(tmp_path, mnist_like):
    proc = run_in_process(
        "fashion_mnist_mlp",
        ["--dataset", mnist_like, "--monitor", "eval/acc", "--output-dir", tmp_path / "run"],
        recipe_env(tmp_path),
    )
    assert proc.returncode == 2 and "--monitor" in proc.stderr and "eval/accuracy" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_logs_read_in_a_file(mlp_run):
    """Output to a file (not a terminal): progress lines with step/total, loss, samples/s and ETA, and one
    epoch line per epoch with train loss, eval metrics and time."""
    _, proc, _ = mlp_run
    lines = proc.stdout.splitlines()
    progress = [l for l in lines if l.startswith("step ")]
    assert progress and all("/27 (epoch" in l and " loss " in l and "samples/s" in l and "ETA" in l for l in progress)
    epochs = [l for l in lines if l.startswith("epoch ")]
    assert [l.split(":")[0] for l in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("train loss" in l and "eval loss" in l and "accuracy" in l and l.endswith(" s") for l in epochs)


def test_max_steps_below_log_every_still_logs_train_scalars(tmp_path, mnist_like):
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                *MLP,
                "--batch-size",
                32,
                "--max-steps",
                3,
                "--log-every",
                10,
                "--output-dir",
                run,
            ],
            recipe_env(tmp_path),
        )
    )
    train = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in train] == [3] and train[0]["train/lr"] > 0


def test_eval_only_uses_the_runs_split_and_keeps_earlier_results(mlp_run):
    """--eval-only without --dataset reads the run's recorded dataset and hold-out; a --seed that would
    redraw the validation split from train is refused; a second evaluation does not overwrite the first."""
    run, _, env = mlp_run
    first = check_ok(run_in_process("fashion_mnist_mlp", ["--eval-only", "--checkpoint", run], env))
    written = sorted((run / "best").glob("eval-test*.json"))
    assert len(written) == 1 and "wrote" in first.stdout
    result = json.loads(written[0].read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert result["count"] == 99 and result["dataset"] == json.loads((run / "config.json").read_text())["dataset"]
    leak = run_in_process("fashion_mnist_mlp", ["--eval-only", "--checkpoint", run, "--seed", 7], env)
    assert leak.returncode == 2 and "--seed 7 differs from the run's 42" in leak.stderr
    check_ok(run_in_process("fashion_mnist_mlp", ["--eval-only", "--checkpoint", run / "final"], env))
    final_eval = json.loads((run / "final" / "eval-test.json").read_text())
    assert final_eval["accuracy"] == summary["final"]["test/accuracy"]  # the same images as the run's final eval
    check_ok(run_in_process("fashion_mnist_mlp", ["--eval-only", "--checkpoint", run], env))
    assert len(sorted((run / "best").glob("eval-test*.json"))) == 2
    assert json.loads(written[0].read_text()) == result  # the earlier result is untouched


def test_output_dir_that_holds_something_else_is_refused(tmp_path, mnist_like):
    before = sorted(p.relative_to(mnist_like) for p in mnist_like.rglob("*"))
    proc = run_in_process(
        "fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, "--output-dir", mnist_like], recipe_env(tmp_path)
    )
    assert proc.returncode == 2 and "not a run" in proc.stderr and "Nothing was written" in proc.stderr
    assert sorted(p.relative_to(mnist_like) for p in mnist_like.rglob("*")) == before


def test_malformed_list_flag_names_the_flag(tmp_path, cifar_like):
    proc = run_in_process("cifar_cnn", ["--dataset", cifar_like, "--widths", "64,abc"], recipe_env(tmp_path))
    assert proc.returncode == 2 and "--widths '64,abc' is not a comma-separated list" in proc.stderr


def test_technique_flag_of_another_recipe_is_explained(tmp_path, mnist_like):
    proc = run_in_process(
        "fashion_mnist_mlp", ["--dataset", mnist_like, "--lookahead-every", "5"], recipe_env(tmp_path)
    )
    assert proc.returncode == 2 and "--lookahead-every is a knob of cifar_cnn, not of this recipe" in proc.stderr
    # which recipes have a flag is read from the recipes' Config classes, not from a list kept by hand
    proc = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, "--sync_bn", "true"], recipe_env(tmp_path))
    assert proc.returncode == 2 and "--sync_bn is a knob of cifar_cnn and mnist_convnet" in proc.stderr


def test_snake_case_flags_and_a_config_file_work_and_hf_flags_are_translated(tmp_path, mnist_like):
    """An Accelerate user's habits: --output_dir works like --output-dir; --config takes a YAML or JSON file
    (a run's own config.json repeats it) with the command line on top, and the merged settings are saved;
    flags of HF example scripts that are spelled differently here name this repository's flag; a config
    file with a setting the recipe does not know is refused, naming it."""
    env = recipe_env(tmp_path)
    first = tmp_path / "first"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            ["--dataset", mnist_like, "--epochs", 1, "--batch_size", 32, *MLP, "--max_steps", 2, "--output_dir", first],
            env,
        )
    )
    saved = json.loads((first / "config.json").read_text())
    assert saved["batch_size"] == 32 and saved["max_steps"] == 2
    again = tmp_path / "again"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp", ["--config", first / "config.json", "--max-steps", 3, "--output-dir", again], env
        )
    )
    merged = json.loads((again / "config.json").read_text())
    assert {**saved, "max_steps": 3, "output_dir": str(again)} == merged
    (tmp_path / "c.yaml").write_text(f"dataset: {mnist_like}\nlr: 0.01\nlearning_rate: 0.02\n")
    proc = run_in_process("fashion_mnist_mlp", ["--config", tmp_path / "c.yaml"], env)
    assert proc.returncode == 2 and "does not know: learning_rate" in proc.stderr, proc.stderr
    proc = run_in_process(
        "fashion_mnist_mlp",
        [
            "--dataset",
            mnist_like,
            "--learning_rate",
            0.1,
            "--per_device_train_batch_size",
            8,
            "--mixed_precision",
            "bf16",
        ],
        env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for said in (  # each named here, from docs/flags.md's table
        "--learning_rate is Hugging Face's Trainer's flag; here: --lr",
        "--per_device_train_batch_size is Hugging Face's Trainer's flag; here: --batch-size (the GLOBAL batch",
        "--mixed_precision is Hugging Face's Trainer's flag; here: the launcher's: put it before the script",
    ):
        assert said in proc.stderr, proc.stderr
    flags_page = (REPO / "docs" / "flags.md").read_text()
    for row in (
        "| `--learning_rate` | `--lr` |",
        "| `--per_device_train_batch_size` | `--batch-size` (the GLOBAL batch",
        "| `--mixed_precision` | the launcher's: put it before the script, `accelerate launch --mixed_precision bf16",
    ):
        assert row in flags_page, row


def test_cpu_config_that_starts_one_process_says_so(tmp_path, mnist_like):
    """`accelerate launch --cpu --num_processes 2` without MPI starts one process: the recipe sees it and
    names the config that really gives two."""
    proc = subprocess.run(
        [
            ACCELERATE,
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO / "recipes" / "fashion_mnist_mlp.py"),
            "--dataset",
            str(mnist_like),
            *MLP,
            "--batch-size",
            "32",
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env=recipe_env(tmp_path),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
    )
    check_ok(proc)
    startup = next(l for l in proc.stdout.splitlines() if l.startswith("startup:"))
    assert "processes=1" in startup and "accelerate_configs/cpu_2proc.yaml" in startup


NEW_MODEL = '''
class TinyNet(torch.nn.Module):
    """A model of the copy's own: one conv, global average pool, linear."""

    def __init__(self, in_shape, num_classes: int, width: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_shape[0], width, 3, padding=1)
        self.head = torch.nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here."""
    return TinyNet(in_shape, num_classes, width=cfg.width)
'''


def test_copied_recipe_with_its_own_model_is_served_by_every_tool(tmp_path, monkeypatch, capsys):
    """Copy a recipe anywhere, replace its model by a class defined in the copy, train it from another folder
    with the printed `accelerate launch` command and the config `accelerate config default` writes; then
    predict, export (checked with onnxruntime) and --eval-only it: no edit to common/."""
    from accelerate.commands.config.default import write_basic_config  # what `accelerate config default` runs

    from common.tools import export, predict

    env = recipe_env(tmp_path)
    data = write_image_folder(tmp_path / "shapes", n_per_class=16, shape=(1, 20, 20))
    dest = tmp_path / "elsewhere" / "my_digits.py"
    copy_recipe("mnist_convnet", dest)  # cp
    text = dest.read_text()
    start, end = text.index("def build_model("), text.index("def build_optimizer(")
    dest.write_text(text[:start] + textwrap.dedent(NEW_MODEL).lstrip() + "\n\n" + text[end:])
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = workdir / "run"
    # Accelerate's default config, where `accelerate launch` looks for it (under HF_HOME)
    default_config = Path(env["HF_HOME"]) / "accelerate" / "default_config.yaml"
    write_basic_config(save_location=str(default_config))
    # trained as README says: `accelerate launch <copy>` from a folder outside the repository,
    # no --config_file, no PYTHONPATH (common is installed, the copy imports it from anywhere)
    launch_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    trained = check_ok(
        subprocess.run(
            [
                ACCELERATE,
                "launch",
                str(dest),
                "--dataset",
                str(data),
                "--width",
                "8",
                "--batch-size",
                "16",
                "--epochs",
                "2",
                "--output-dir",
                str(run),
            ],
            env=launch_env,
            cwd=str(workdir),
            capture_output=True,
            text=True,
            timeout=180,
        )
    )
    assert "startup: processes=1 " in trained.stdout, trained.stdout
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["model"] == "TinyNet" and card["recipe"] == "my_digits"
    # the tools' main() in this process (their command lines run in tests/test_predict.py and test_export.py)
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    # the copy defines the model: the user names it (--recipe), as docs/data.md says
    assert predict.main([str(run), str(data / "cat"), "--format", "json", "--recipe", str(dest)]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 16 and results[0]["predictions"][0]["label"] in ("cat", "dog", "frog")
    assert export.main([str(run), "--onnx", str(workdir / "m.onnx"), "--recipe", str(dest)]) == 0, (
        capsys.readouterr().err
    )
    assert (workdir / "m.onnx").stat().st_size > 0
    check_ok(run_in_process(dest, ["--eval-only", "--checkpoint", run], env, cwd=workdir))
    result = json.loads((run / "best" / "eval-val.json").read_text())
    assert result["count"] == json.loads((run / "summary.json").read_text())["final"]["val/count"]


def test_model_files_follow_the_umask(mlp_run):
    """safetensors writes 0600; the run's weights get the mode the rest of the run has (a teammate can read them)."""
    import os

    run, _, _ = mlp_run
    mask = os.umask(0)
    os.umask(mask)
    for path in (
        run / "final" / "model.safetensors",
        run / "best" / "model.safetensors",
        next((run / "checkpoints").glob("step-*/model.safetensors")),
    ):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path
