"""The user's path to their own data, end to end: a folder of class sub-folders with images that are not
CIFAR- or MNIST-sized, `cp recipes/<recipe>.py`, then the copy trained from outside the
repository with only --dataset and run-length flags (main() of the copy in this process, cwd outside the
repository; the printed `accelerate launch <copy>` of a copy from outside the repository, without PYTHONPATH, is run
for real by tests/test_user_commands.py::test_copied_recipe_with_its_own_model_is_served_by_every_tool).
Classes and image shape must come from the data, and the copy must learn; predict serves the copy."""

from __future__ import annotations

import json
import random
from pathlib import Path

from helpers import REPO, check_ok, copy_recipe, run_in_process

SHAPES = ("circle", "square", "triangle")
SIZE = 20  # neither 28 (MNIST) nor 32 (CIFAR)


def draw_shapes(root: Path, n_per_class: int, mode: str, seed: int) -> Path:
    """<root>/<shape>/<i>.png: a light filled circle, square or triangle of random size, place and colour on
    a dark background, SIZE x SIZE pixels, RGB or grayscale ('L')."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    for name in SHAPES:
        (root / name).mkdir(parents=True)
        for i in range(n_per_class):
            bg = tuple(rng.randrange(0, 60) for _ in range(3))
            fg = tuple(rng.randrange(150, 256) for _ in range(3))
            img = Image.new(mode, (SIZE, SIZE), bg if mode == "RGB" else bg[0])
            draw = ImageDraw.Draw(img)
            r = rng.randint(5, 8)
            cx, cy = rng.randint(r + 1, SIZE - r - 2), rng.randint(r + 1, SIZE - r - 2)
            fill = fg if mode == "RGB" else fg[0]
            if name == "circle":
                draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
            elif name == "square":
                draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
            img.save(root / name / f"{i:03d}.png")
    return root


def copy_and_train(tmp_path: Path, env: dict, recipe: str, mode: str, run_flags: list, capsys) -> tuple[Path, Path]:
    data = draw_shapes(tmp_path / "my_shapes", 30, mode, seed=1)
    dest = tmp_path / "my_recipe.py"
    copy_recipe(recipe, dest)  # cp: the copy lies outside the repository and imports the installed common
    run = tmp_path / "runs" / "shapes"
    args = ["--dataset", str(data), *map(str, run_flags), "--output-dir", str(run)]
    check_ok(run_in_process(dest, args, env, cwd=tmp_path))
    return data, run


def check_trained(run: Path, channels: int, min_accuracy: float = 0.75):
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["recipe"] == "my_recipe" and card["recipe_file"] == str(run.parents[1] / "my_recipe.py")
    assert card["class_names"] == list(SHAPES)  # the folder names, in order
    assert card["input_shape"] == [channels, SIZE, SIZE]  # taken from the images, not the recipe's dataset
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recipe"] == "my_recipe" and summary["global_step"] > 0
    # no test split in a flat class folder: the final eval is on the held-out 10% (9 images); chance is 1/3
    assert summary["final"]["val/count"] == 9
    assert summary["final"]["val/accuracy"] >= min_accuracy, summary["final"]


def predict_accuracy(run: Path, images: Path, monkeypatch, capsys) -> float:
    """Step 4 of the printed next steps: common.tools.predict (its main(), in this process; the command line
    runs in tests/test_predict.py) on freshly drawn images the run never saw, from a folder outside the
    repository (the model is rebuilt from the copied recipe file)."""
    from common.tools.predict import main as predict

    monkeypatch.chdir(run.parents[1])
    capsys.readouterr()
    # the user's own copy: named with --recipe, as the next steps say
    recipe = next(p / "my_recipe.py" for p in run.parents if (p / "my_recipe.py").is_file())
    assert predict([str(run), str(images), "--format", "json", "--top-k", "1", "--recipe", str(recipe)]) == 0, (
        capsys.readouterr().err
    )
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 3 * 10
    return sum(Path(r["file"]).parent.name == r["predictions"][0]["label"] for r in results) / len(results)


def test_cifar_cnn_copy_on_20x20_rgb_shapes(tmp_path, env, capsys, monkeypatch):
    # --batch-size: the recipe's 512 is more than this folder holds (81 training images)
    data, run = copy_and_train(tmp_path, env, "cifar_cnn", "RGB", ["--epochs", 5, "--batch-size", 16], capsys)
    check_trained(run, channels=3)
    # final/, not the run dir: the run dir means best/, the first epoch to score 9/9 on validation, less trained
    unseen = draw_shapes(tmp_path / "unseen", 10, "RGB", seed=2)
    assert predict_accuracy(run / "final", unseen, monkeypatch, capsys) >= 0.8


def test_mnist_convnet_copy_on_20x20_grayscale_shapes(tmp_path, env, capsys):
    data, run = copy_and_train(tmp_path, env, "mnist_convnet", "L", ["--epochs", 5, "--batch-size", 16], capsys)
    check_trained(run, channels=1)


def test_a_package_named_common_beside_a_copy_stops_it_at_its_first_import(tmp_path, env):
    """docs/data.md: a folder `common/` of the user's beside a copy hides the library (Python looks in the script's
    folder first, and the editable install would load the library's modules under it); the copy stops at its first
    import in one paragraph naming both folders, before anything runs, and the user's package is left as it was."""
    import subprocess
    import sys

    copy = copy_recipe("mnist_convnet", tmp_path / "mine" / "my_digits.py")
    own = tmp_path / "mine" / "common"
    own.mkdir()
    (own / "__init__.py").write_text("VALUE = 1\n")
    proc = subprocess.run(
        [sys.executable, str(copy), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"`import common` found {own}, a package of your own" in proc.stderr and str(REPO / "common") in proc.stderr
    assert (own / "__init__.py").read_text() == "VALUE = 1\n" and sorted(p.name for p in own.iterdir()) == [
        "__init__.py"
    ]
