"""Files a user writes by hand or receives (a --config file, a run folder with its checkpoints and model.json)
are data: a bad value in one is a clear error, a checkpoint damaged twice is set aside twice, and the strings
in one never reach the terminal as escape sequences."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_predict import make_model_dir, write_images

from helpers import REPO, check_ok, run_in_process

MLP = ["--hidden", "32"]


# --- a --config file with an empty or wrongly typed value -----------------------------------------------


@pytest.mark.parametrize(
    "line,needles",
    [
        ("lr:", ["lr has no value", "Give it a number (e.g. `lr: 0.01`"]),
        ("epochs: [1, 2]", ["epochs = [1, 2] is not a whole number", "`epochs: 3`"]),
        ("lr: abc", ["lr = 'abc' is not a number"]),
        ("epochs: true", ["epochs = True is not a whole number"]),  # `--epochs true` is refused too
    ],
)
def test_config_file_value_of_the_wrong_type_is_one_paragraph(line, needles, tmp_path, env, mnist_like):
    """`python recipe.py --config FILE` where a key has no value (YAML null) or a value the same flag on the
    command line would refuse: exit 2, one paragraph naming the file, the key and the fix, no traceback,
    nothing written."""
    config = tmp_path / "settings.yaml"
    config.write_text(f"dataset: {mnist_like}\n{line}\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "mnist_convnet.py"),
            "--config",
            str(config),
            "--output-dir",
            str(tmp_path / "r"),
        ],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip()
    assert error.startswith(f"error: --config {config}") and "\n" not in error, proc.stderr
    assert "or delete the line to keep the default" in error, error
    for needle in needles:
        assert needle in error, error
    assert not (tmp_path / "r").exists()


# --- a received run folder whose recorded values have the wrong type or range --------------------------------


@pytest.mark.parametrize(
    "file,edit,needles",
    [
        ("state", {"config.grad_accum": 0}, ["settings recorded in the checkpoint", "--grad-accum must be at least 1"]),
        ("state", {"config.seed": "one"}, ["seed = 'one' is not a whole number"]),
        ("state", {"epoch": "1"}, ["holds values a run never writes", "epoch = '1'"]),
        ("config", {"grad_accum": 0}, ["settings recorded in", "--grad-accum must be at least 1"]),
    ],
)
def test_received_run_values_of_the_wrong_type_are_one_paragraph(file, edit, needles, tmp_path, env, mnist_like):
    """A run folder someone sent: its checkpoint's trainer_state.json (resumed) or its config.json (--eval-only)
    holds a value a run never writes. Before: grad_accum 0 was a ZeroDivisionError mid-start; now one paragraph
    naming the file and the value, exit 2."""
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, *MLP, "--output-dir", run],
            env,
        )
    )
    if file == "state":
        target = next((run / "checkpoints").glob("step-*")) / "trainer_state.json"
        command = [
            "--dataset",
            mnist_like,
            "--epochs",
            2,
            "--batch-size",
            32,
            *MLP,
            "--output-dir",
            run,
            "--resume-from",
            "latest",
        ]
    else:
        target = run / "config.json"
        command = ["--eval-only", "--checkpoint", run]
    data = json.loads(target.read_text())
    for key, value in edit.items():
        holder = data
        *parents, last = key.split(".")
        for p in parents:
            holder = holder[p]
        holder[last] = value
    target.write_text(json.dumps(data))
    proc = run_in_process("fashion_mnist_mlp", command, env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


# --- the same checkpoint damaged twice ----------------------------------------------------------------------


def damage(checkpoint):
    """What a power loss can leave of a file that was not fsynced: the end of the weights is gone."""
    weights = next(checkpoint.glob("model*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def test_a_checkpoint_damaged_again_after_the_fallback_is_set_aside_again(tmp_path, env, mnist_like):
    """step-4 is damaged, --resume-from latest falls back to step-2 and writes step-4 again; that one is
    damaged too: the second fallback works as well, and both damaged copies are kept under their own names."""
    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        2,
        "--batch-size",
        32,
        *MLP,
        "--checkpoint-every",
        2,
        "--keep-checkpoints",
        10,
        "--max-steps",
        4,
        "--output-dir",
        run,
    ]
    check_ok(run_in_process("fashion_mnist_mlp", args, env))
    step4, folder = run / "checkpoints" / "step-00000004", run / "checkpoints"
    for kept in ("damaged-step-00000004", "damaged-step-00000004.2"):
        damage(step4)
        proc = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--resume-from", "latest"], env))
        assert f"the newest checkpoint {step4} is damaged" in proc.stdout, proc.stdout
        assert f"renamed {kept} and the run resumes from the previous one, {folder / 'step-00000002'}" in proc.stdout
        assert "resumed from" in proc.stdout and (step4 / "COMPLETE").is_file()  # written again
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("damaged-")) == [
        "damaged-step-00000004",
        "damaged-step-00000004.2",
    ]
    assert all(  # kept whole, not merged
        len(list((folder / name).glob("model*.safetensors"))) == 1
        for name in ("damaged-step-00000004", "damaged-step-00000004.2")
    )
    assert json.loads((run / "summary.json").read_text())["global_step"] == 4


def test_superseding_the_same_step_twice_in_one_second_keeps_both(tmp_path, monkeypatch):
    """Resuming an older checkpoint twice within a second sets step-6 aside twice under the same timestamp:
    the second copy gets a name of its own instead of failing on the first ("Directory not empty")."""
    from common.train import checkpoint

    monkeypatch.setattr(checkpoint.time, "strftime", lambda fmt, *a: "20250101-120000")
    names = []
    for _ in range(2):
        step6 = tmp_path / "checkpoints" / "step-00000006"
        step6.mkdir(parents=True)
        (step6 / checkpoint.STATE_FILE).write_text(json.dumps({"global_step": 6}))
        (step6 / checkpoint.MARKER).write_text("ok\n")
        names += checkpoint.supersede_newer(tmp_path, 3)
    assert names == ["superseded-20250101-120000-step-00000006", "superseded-20250101-120000-step-00000006.2"]
    assert all((tmp_path / "checkpoints" / name / checkpoint.MARKER).is_file() for name in names)


# --- strings from model.json reach the terminal escaped -----------------------------------------------------

HOSTILE = ["\x1b]0;pwned\x07", "\x1b[2K\rcat", "café 猫"]


def test_printable_escapes_control_characters_only(capsys):
    """The helper every command prints received strings through, and the error report that quotes them."""
    from common.errors import RecipeError, printable, report

    assert printable("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert printable("a\x00b\tc\nd\x7fe\x9bf") == "a\\x00b\\x09c\\x0ad\\x7fe\\x9bf"  # C0, DEL and C1
    assert printable("café 猫 ü ß €") == "café 猫 ü ß €"
    assert report(RecipeError("model.json names the recipe \x1b[2K\rcat.")) == 2
    assert capsys.readouterr().err == "error: model.json names the recipe \\x1b[2K\\x0dcat.\n"


def test_a_dataset_folder_named_with_an_escape_sequence_reaches_the_terminal_as_text(tmp_path, env):
    """The startup lines quote the dataset's path and what was skipped in it: a name holding an escape sequence is
    printed as text (it retitled the terminal)."""
    from helpers import write_image_folder

    root = write_image_folder(tmp_path / "pets\x1b]0;pwned\x07", n_per_class=6, classes=("cat", "dog"), shape=(3, 8, 8))
    (root / "cat" / "notes\x1b[2K.txt").write_text("skipped, and counted")
    proc = check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            ["--dataset", root, "--epochs", 1, "--batch-size", 4, *MLP, "--output-dir", tmp_path / "run"],
            env,
        )
    )
    assert "\x1b" not in proc.stdout and "pets\\x1b]0;pwned\\x07" in proc.stdout, proc.stdout


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_predict_prints_class_names_of_a_received_model_escaped(fmt, tmp_path):
    """A received model.json whose class names (and model name) hold terminal escape sequences: predict's
    output shows them as text (\\x1b...), never raw; ordinary unicode is printed as it is."""
    run_dir, _, _ = make_model_dir(tmp_path, "MLP")
    card_file = run_dir / "best" / "model.json"
    card = json.loads(card_file.read_text())
    card.update(class_names=HOSTILE, model="MLP\x1b[31m")
    card_file.write_text(json.dumps(card))
    images = write_images(tmp_path / "imgs", 2, (12, 12), "L")
    # bytes, not text: text mode would turn a raw \r into \n before the check
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.tools.predict",
            str(run_dir),
            *map(str, images),
            "--top-k",
            "3",
            "--format",
            fmt,
        ],
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err
    for raw in ("\x1b", "\x07", "\r"):
        assert raw not in out and raw not in err, (out, err)
    for shown in ("\\x1b]0;pwned\\x07", "\\x1b[2K\\x0dcat", "café 猫"):
        assert shown in out, out
    assert "(MLP\\x1b[31m, recipe fashion_mnist_mlp" in err, err
