"""Bad input: each case exits non-zero with one paragraph naming the problem and the fix, no traceback,
and nothing the user had is overwritten. The recipes' main() runs in this process (an escaping exception
shows up as a traceback in the captured stderr); one case runs as a real `python recipe.py` process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, run_in_process, write_image_folder, write_parquet_dataset


def run_recipe(recipe, args, env, cwd):
    return run_in_process(recipe, args, env, cwd=cwd)


def assert_clear_error(proc, *needles):
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def write_plain_parquet(root, columns: dict, split="train"):
    from datasets import Dataset

    (root / "data").mkdir(parents=True, exist_ok=True)
    Dataset.from_dict(columns).to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--lr", "-1"], ["--lr must be positive"]),
        (["--epochs", "0"], ["--epochs must be at least 1"]),
        (["--batch-size", "2", "--grad-accum", "4"], ["must split evenly", "--batch-size"]),
        (["--lrr", "0.1"], ["unrecognized arguments: --lrr", "--help"]),
        (["--val-fraction", "1.5"], ["--val-fraction must be in [0, 1)"]),
        (["--batch-size", "1024"], ["larger than the training split", "smaller --batch-size"]),
        (["--profile", "-2"], ["--profile takes a number of optimizer steps"]),
    ],
)
def test_invalid_config(args, needles, tmp_path, env, mnist_like):
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", mnist_like, "--output-dir", tmp_path / "r", *args], env, tmp_path),
        *needles,
    )
    assert not (tmp_path / "r").exists()  # nothing written


def test_invalid_lookahead_every(tmp_path, env, cifar_like):
    """--lookahead-every lives in cifar_cnn, the recipe that averages weights."""
    assert_clear_error(
        run_recipe(
            "cifar_cnn",
            ["--dataset", cifar_like, "--output-dir", tmp_path / "r", "--lookahead-every", "-1"],
            env,
            tmp_path,
        ),
        "--lookahead-every must be >= 0",
    )


def test_bad_flag_in_a_real_process(tmp_path, env, mnist_like):
    """The exit code and stderr of `python recipe.py` itself."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "mnist_convnet.py"),
            "--dataset",
            str(mnist_like),
            "--output-dir",
            str(tmp_path / "r"),
            "--lr",
            "-1",
        ],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert_clear_error(proc, "--lr must be positive")
    assert not (tmp_path / "r").exists()


def test_technique_flag_of_another_recipe_names_it(tmp_path, env, mnist_like):
    proc = run_recipe(
        "fashion_mnist_mlp", ["--dataset", mnist_like, "--output-dir", tmp_path / "r", "--flip"], env, tmp_path
    )
    assert_clear_error(proc, "unrecognized arguments: --flip", "--flip is a knob of cifar_cnn, not of this recipe")


def test_missing_dataset_path(tmp_path, env):
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", tmp_path / "nope"], env, tmp_path), "does not exist", "--dataset"
    )


def test_dataset_without_image_column(tmp_path, env):
    root = write_plain_parquet(tmp_path / "d", {"pixels": [[0] * 4] * 8, "label": [0, 1] * 4})
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", root, "--output-dir", tmp_path / "r"], env, tmp_path),
        "no image column",
        "--image-column",
    )


def test_labels_outside_the_training_classes(tmp_path, env):
    from datasets import Dataset, Features, Image, Value
    from PIL import Image as PILImage

    root = tmp_path / "d"
    (root / "data").mkdir(parents=True)
    img = PILImage.new("L", (28, 28))
    feats = Features({"image": Image(), "label": Value("int64")})
    Dataset.from_dict({"image": [img] * 12, "label": [0, 1, 2] * 4}, features=feats).to_parquet(
        str(root / "data" / "train-00000-of-00001.parquet")
    )
    Dataset.from_dict({"image": [img] * 4, "label": [0, 1, 2, 7]}, features=feats).to_parquet(
        str(root / "data" / "test-00000-of-00001.parquet")
    )
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", root, "--output-dir", tmp_path / "r"], env, tmp_path),
        "label 7",
        "outside the 3 classes",
    )


def test_images_too_small_for_the_model(tmp_path, env):
    root = write_parquet_dataset(tmp_path / "d", {"train": 16}, shape=(1, 2, 2))
    args = ["--dataset", root, "--batch-size", 8, "--output-dir", tmp_path / "r"]  # a batch the split holds
    assert_clear_error(
        run_recipe("mnist_convnet", args, env, tmp_path),
        "at least 14x14",
        "--image-size",
    )


def test_empty_split(tmp_path, env):
    from datasets import ClassLabel, Dataset, Features, Image

    root = write_parquet_dataset(tmp_path / "d", {"train": 16})
    feats = Features({"image": Image(), "label": ClassLabel(names=[f"class_{k}" for k in range(4)])})
    Dataset.from_dict({"image": [], "label": []}, features=feats).to_parquet(
        str(root / "data" / "test-00000-of-00001.parquet")
    )
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", root, "--output-dir", tmp_path / "r"], env, tmp_path),
        "test split of",
        "is empty",
    )


def test_corrupt_image_in_image_folder_is_named(tmp_path, env):
    root = write_image_folder(tmp_path / "imgs", n_per_class=4)
    bad = root / "dog" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    assert_clear_error(
        run_recipe("cifar_cnn", ["--dataset", root, "--output-dir", tmp_path / "r"], env, tmp_path),
        "broken.png",
        "Remove or replace",
    )


def test_output_dir_of_another_run_is_not_overwritten(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"mine": true}')
    assert_clear_error(
        run_recipe("mnist_convnet", ["--dataset", mnist_like, "--output-dir", run], env, tmp_path),
        "already holds a run",
        "--resume-from latest",
    )
    assert (run / "config.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


# --- said once in a job of several processes ---------------------------------------------------------


def error_paragraphs(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error: " in line and not line.startswith(" ")]


@pytest.mark.parametrize("case", ["flag", "data", "photo"])
def test_bad_input_on_two_processes_is_said_once(tmp_path, env, case):
    """The same bad input stops both processes; the job says it once (the main process), not once per rank. A
    damaged photo (past --max-damaged) is met by one rank's loader: both stop at the same step and end with the same
    paragraph, naming it, said by the main process."""
    from helpers import launch

    root = tmp_path / "d"
    write_image_folder(root / "train", n_per_class=4, classes=("cat", "dog"))
    if case == "photo":
        sorted((root / "train" / "dog").glob("*.png"))[0].write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    else:
        write_image_folder(root / "test", n_per_class=2, classes=("cat", "dog", "horse"))
    args = ["--dataset", root, "--output-dir", tmp_path / "r"] + (["--epochs", "0"] if case == "flag" else [])
    args += ["--image-size", "32", "--workers", "0", "--batch-size", "4", "--epochs", "3"] if case == "photo" else []
    proc = launch("finetune_folder" if case == "photo" else "fashion_mnist_mlp", args, env, nproc=2)
    said = error_paragraphs(proc.stderr)
    needle = {
        "flag": "--epochs must be at least 1",
        "data": "which train does not have",
        "photo": "1 damaged photo met, more than --max-damaged 0.01 of the 4 photos each of the 2 processes reads",
    }[case]
    # the launcher adds its own traceback (torchrun's ChildFailedError); none comes from the recipe's processes
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith('File "')]
    assert proc.returncode != 0 and not [f for f in frames if "/common/" in f or "/recipes/" in f], proc.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith("[rank 0] error: ") and needle in said[0], proc.stderr[-3000:]
    if case != "photo":  # a damaged photo is met in training: the run's folder holds its checkpoint
        assert not (tmp_path / "r").exists()  # nothing left behind either


SAY_PER_RANK = """
import os, sys, time
import common.errors as errors
from common.errors import DataError, report

errors.SAID_ONCE_WAIT_S = 3.0
rank = int(os.environ["RANK"])
if sys.argv[1] == "differ":      # each process meets its own bad input
    sys.exit(report(DataError(f"bad file number {rank}")))
if rank == 1:                    # only rank 1 meets bad input; rank 0 runs on
    sys.exit(report(DataError("bad file only rank 1 reads")))
time.sleep(60)
"""


@pytest.mark.parametrize("case", ["differ", "only_rank_1"])
def test_bad_input_that_differs_by_process_is_said_by_each(tmp_path, env, case):
    """The false positive: a message the main process did not say (another one, or none at all) is printed."""
    from machine import free_port

    from helpers import ACCELERATE, CONFIGS, REPO

    script = tmp_path / "say.py"
    script.write_text(SAY_PER_RANK)
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(CONFIGS / "cpu_2proc.yaml"),
        "--main_process_port",
        str(free_port()),
        str(script),
        case,
    ]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    said = sorted(error_paragraphs(proc.stderr))
    if case == "differ":
        assert said == ["[rank 0] error: bad file number 0", "[rank 1] error: bad file number 1"], proc.stderr[-3000:]
    else:
        assert said == ["[rank 1] error: bad file only rank 1 reads"], proc.stderr[-3000:]
    assert proc.returncode != 0


def test_a_batch_larger_than_the_split_is_refused_on_two_processes_too(tmp_path, env, mnist_like):
    """--batch-size 512 over a 288-image training split: refused at 1 process, and before, trained at 2 (each process
    took a per-process batch of 256, the second padded with repeated images). The rule is the global batch's now."""
    from helpers import launch

    args = ["--dataset", mnist_like, "--batch-size", 512, "--output-dir", tmp_path / "r"]
    proc = launch("mnist_convnet", args, env, nproc=2, timeout=180)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "larger than the training split (288 images)" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "r" / "checkpoints").exists()  # (the launcher adds its own traceback for a failed rank)


@pytest.mark.parametrize(
    "labels,needle",
    [
        ([0, 3] * 20, "would make 4 classes, 2 of them with no training row"),
        ([0, 999999] * 20, "1,000,000 classes"),
        ([0] * 40, "single class"),
    ],
)
def test_a_decoded_recipes_table_labels_follow_the_folder_rules(labels, needle, tmp_path, env):
    """The MNIST, Fashion-MNIST and CIFAR recipes read tables too: integer labels {0, 3} made 4 classes there, a label
    of 999999 a million, one class trained alone. Refused in one paragraph, as the photo recipe's tables and every
    image folder are."""
    import io

    from PIL import Image

    def png(i):
        buf = io.BytesIO()
        Image.new("L", (28, 28), i * 5).save(buf, format="PNG")
        return {"bytes": buf.getvalue(), "path": None}

    root = write_plain_parquet(tmp_path / "d", {"image": [png(i) for i in range(len(labels))], "label": labels})
    proc = run_recipe("mnist_convnet", ["--dataset", root, "--output-dir", tmp_path / "r"], env, tmp_path)
    assert_clear_error(proc, needle)
