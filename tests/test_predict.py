"""common.tools.predict: rebuild a model from model.json through its recipe's build_model, preprocess like
eval, top-k output, clear errors.

Model folders are written with common.train.checkpoint.save_model_dir from untrained models (no training), with
the card a recipe writes (recipe, recipe_file, config, input shape, classes, mean/std); one of them comes
from a recipe file of the user's own with a model class of its own. The CLI runs as a subprocess, its
JSON is checked against the torch model run directly."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.data.augment import normalize
from common.tools.predict import build_model_from_card, collect_images, load_predictor, predict_files
from common.train import checkpoint

from helpers import REPO, import_recipe

STUB_ACCELERATOR = SimpleNamespace(is_main_process=True, unwrap_model=lambda m, keep_torch_compile=True: m)

# A recipe of the user's own (a copy of one, edited), defining a model class that
# common.models does not have: predict must build it from this file.
OWN_RECIPE = """
from dataclasses import dataclass

import torch
from torch import nn

from common.config import CommonConfig, knob

class TinyNet(nn.Module):
    def __init__(self, in_shape, num_classes, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_shape[0] * in_shape[1] * in_shape[2], hidden),
                                  nn.Tanh(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.body(x)


@dataclass
class Config(CommonConfig):
    hidden: int = knob(24, "hidden units")


def build_model(cfg, in_shape, num_classes):
    return TinyNet(in_shape, num_classes, cfg.hidden)
"""

SPECS = {  # model class -> the recipe that builds it, its settings, and the data it was "trained" on
    "ConvNet": dict(
        recipe="mnist_convnet",
        settings={"model": "deep", "width": 4, "dropout": 0.1},
        input_shape=[1, 28, 28],
        class_names=["zero", "one", "two", "three", "four"],
        mean=[0.13],
        std=[0.31],
    ),
    "LeanConvNet": dict(
        recipe="mnist_convnet",
        settings={"width": 4, "hidden": 8},
        input_shape=[1, 20, 20],
        class_names=["a", "b", "c"],
        mean=[0.13],
        std=[0.31],
    ),
    "CifarCNN": dict(
        recipe="cifar_cnn",
        settings={"widths": "8,16,16"},
        input_shape=[3, 32, 32],
        class_names=["cat", "dog", "bird", "fish"],
        mean=[0.49, 0.48, 0.45],
        std=[0.25, 0.24, 0.26],
    ),
    "MLP": dict(
        recipe="fashion_mnist_mlp",
        settings={"hidden": "16", "dropout": 0.0},
        input_shape=[1, 12, 12],
        class_names=["shirt", "shoe", "bag"],
        mean=[0.29],
        std=[0.35],
    ),
    "TinyNet": dict(
        recipe="my_tiny_net",
        settings={"hidden": 7},
        input_shape=[1, 10, 10],
        class_names=["left", "right"],
        mean=[0.5],
        std=[0.2],
    ),
}


def recipe_file(root: Path, kind: str) -> Path:
    if kind != "TinyNet":
        return REPO / "recipes" / f"{SPECS[kind]['recipe']}.py"
    path = root / "my_recipes" / "my_tiny_net.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OWN_RECIPE)
    return path


def make_model_dir(root: Path, kind: str, tta: int = 0, seed: int = 0):
    """Write <root>/run/best (model.safetensors + model.json) for an untrained model built by its recipe's
    build_model; returns (run_dir, card, model). The last layer is scaled up so the logits are well apart."""
    spec = SPECS[kind]
    path = recipe_file(root, kind)
    recipe = import_recipe(path)
    settings = {**spec["settings"], "seed": seed, **({"tta": tta} if kind == "CifarCNN" else {})}
    cfg = recipe.Config(**settings)
    torch.manual_seed(seed)
    model = recipe.build_model(cfg, tuple(spec["input_shape"]), len(spec["class_names"]))
    assert type(model).__name__ == kind
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.mul_(40.0)
    model.eval()
    card = {
        "recipe": spec["recipe"],
        "recipe_file": str(path),
        "model": kind,
        "input_shape": spec["input_shape"],
        "class_names": spec["class_names"],
        "mean": spec["mean"],
        "std": spec["std"],
        "config": dataclasses.asdict(cfg),
    }
    run_dir = root / "run"
    checkpoint.save_model_dir(STUB_ACCELERATOR, model, run_dir / "best", card)
    return run_dir, card, model


def write_images(folder: Path, count: int, size, mode: str, seed: int = 0) -> list[Path]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
        path = folder / f"img_{i}.png"
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
        paths.append(path)
    return paths


def reference_logits(model, card, path: Path) -> torch.Tensor:
    """Eval preprocessing written out independently: convert, bilinear resize, uint8 CHW, normalize."""
    from PIL import Image

    c, h, w = card["input_shape"]
    img = Image.open(path)
    img = img.convert("L" if c == 1 else "RGB")
    if img.size != (w, h):
        img = img.resize((w, h), Image.BILINEAR)
    arr = torch.from_numpy(np.array(img, dtype=np.uint8))
    arr = arr[None] if arr.ndim == 2 else arr.permute(2, 0, 1)
    x = normalize(arr[None], card["mean"], card["std"])
    with torch.no_grad():
        logits = six_view_logits(model, x) if card["config"].get("tta") == 2 else model(x).float()
    return logits[0]


def six_view_logits(model, x):
    """The level-2 test-time augmentation written out view by view: 1/4 each for the image and its mirror,
    1/8 each for the two 1-pixel shifts (reflected edges) and their mirrors."""
    h, w = x.shape[-2:]
    pad = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    views = [(x, 0.25), (x.flip(3), 0.25)]
    for shifted in (pad[..., :h, :w], pad[..., 2:, 2:]):
        views += [(shifted, 0.125), (shifted.flip(3), 0.125)]
    return sum(weight * model(v).float() for v, weight in views)


def run_cli(*args, timeout=120, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "common.tools.predict", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_build_model_from_card_matches_saved_weights(tmp_path, kind):
    run_dir, card, model = make_model_dir(tmp_path, kind)
    state, loaded_card = checkpoint.load_model_dir(run_dir)
    # the user's own recipe file is imported on their word (--recipe), never on model.json's
    rebuilt = build_model_from_card(loaded_card, card["recipe_file"] if kind == "TinyNet" else None)
    rebuilt.load_state_dict(state)  # strict: same architecture, settings from the card's config
    assert type(rebuilt).__name__ == kind == loaded_card["model"]
    rebuilt.eval()
    x = torch.randn(2, *card["input_shape"])
    with torch.no_grad():
        assert torch.equal(rebuilt(x), model(x))


def test_model_class_of_a_users_own_recipe_file(tmp_path, capsys):
    """A recipe file outside the repository with its own model class: model.json's word alone never imports
    it (a run folder is data); --recipe, the user's explicit word, does, wherever the file now lives. A
    recipe name that reaches outside recipes/ is refused too, and neither file runs."""
    run_dir, card, model = make_model_dir(tmp_path, "TinyNet")
    images = write_images(tmp_path / "imgs", 3, (10, 10), "L")
    marker = tmp_path / "recipe-ran"
    own = Path(card["recipe_file"])
    own.write_text(own.read_text() + f"\nfrom pathlib import Path\nPath({str(marker)!r}).touch()\n")
    proc = run_cli(run_dir, *images, "--format", "json", "--top-k", 1, cwd=tmp_path)
    assert proc.returncode == 2 and "--recipe path/to/that_recipe.py" in proc.stderr and str(own) in proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()
    payload = tmp_path / "payload.py"
    payload.write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    card_path = run_dir / "best" / "model.json"
    forged = {**card, "recipe": "../../" + str(payload.with_suffix("")).lstrip("/"), "recipe_file": str(payload)}
    card_path.write_text(json.dumps(forged))
    proc = run_cli(run_dir, *images, cwd=tmp_path)
    assert proc.returncode == 2 and "not one of this repository's recipes" in proc.stderr and not marker.exists()
    card_path.write_text(json.dumps(card))
    own.write_text(own.read_text().replace(f"Path({str(marker)!r}).touch()", ""))
    proc = run_cli(run_dir, *images, "--format", "json", "--top-k", 1, "--recipe", own, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["model"] == "TinyNet" and doc["recipe"] == "my_tiny_net"
    for path, result in zip(images, doc["results"]):
        ref = torch.softmax(reference_logits(model, card, path), 0)
        assert result["predictions"][0]["index"] == int(ref.argmax())
        assert result["predictions"][0]["probability"] == pytest.approx(float(ref.max()), abs=1e-5)

    from common.tools.predict import main

    moved = tmp_path / "elsewhere" / "renamed_recipe.py"
    moved.parent.mkdir()
    own.rename(moved)
    assert main([str(run_dir), *map(str, images), "--recipe", str(own)]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main([str(run_dir), *map(str, images), "--recipe", str(moved), "--format", "json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["predictions"][0]["index"] for r in again["results"]] == [
        r["predictions"][0]["index"] for r in doc["results"]
    ]


@pytest.mark.parametrize("kind,tta", [("ConvNet", 0), ("CifarCNN", 2)])
def test_cli_json_matches_torch(tmp_path, kind, tta):
    run_dir, card, model = make_model_dir(tmp_path, kind, tta=tta)
    c, h, w = card["input_shape"]
    mode = "L" if c == 1 else "RGB"
    images = write_images(tmp_path / "imgs", 4, (w, h), mode)
    # one image of another size and mode: resized and converted like eval
    images += write_images(tmp_path / "odd", 1, (w + 7, h + 3), "RGB" if c == 1 else "L", seed=1)

    proc = run_cli(run_dir, *images, "--format", "json", "--top-k", 3)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["tta"] == tta and doc["model"] == kind
    assert [r["file"] for r in doc["results"]] == [str(p) for p in images]
    names = card["class_names"]
    for path, result in zip(images, doc["results"]):
        preds = result["predictions"]
        assert len(preds) == 3
        probs = [p["probability"] for p in preds]
        assert sum(probs) <= 1.0 + 1e-6 and probs == sorted(probs, reverse=True)
        assert all(p["label"] == names[p["index"]] for p in preds)
        ref = torch.softmax(reference_logits(model, card, path), 0)
        assert preds[0]["label"] == names[int(ref.argmax())]
        assert preds[0]["probability"] == pytest.approx(float(ref.max()), abs=1e-5)
    assert "resized" in proc.stderr


def test_cli_folder_table_csv_and_output_file(tmp_path):
    run_dir, card, _ = make_model_dir(tmp_path, "MLP")
    folder = tmp_path / "images"
    write_images(folder / "a", 2, (12, 12), "L")
    write_images(folder / "b", 1, (12, 12), "L", seed=3)
    (folder / "notes.txt").write_text("not an image, and not picked from a folder")

    table = run_cli(run_dir / "best", folder, "--top-k", 2)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].split() == ["file", "top-1", "top-2"] and len(lines) == 4
    assert all(any(n in line for n in card["class_names"]) for line in lines[1:])

    out = tmp_path / "preds.csv"
    proc = run_cli(run_dir, folder, "--format", "csv", "--top-k", 5, "--output", out)
    assert proc.returncode == 0, proc.stderr
    rows = out.read_text().strip().splitlines()
    # --top-k above the class count lists every class
    assert rows[0] == "file,top1_label,top1_probability,top2_label,top2_probability,top3_label,top3_probability"
    assert len(rows) == 4


def test_a_folder_is_walked_as_training_walks_it(tmp_path):
    """predict finds what an image folder holds as training reads it (common.data.folders): a linked sub-folder is
    followed (it was skipped), any ending Pillow opens counts (.jfif was left out), hidden entries are skipped, and
    a link back up the tree is named instead of walked forever."""
    import os

    from common.tools.predict import collect_images

    folder = tmp_path / "images"
    write_images(folder / "a", 2, (12, 12), "L")
    write_images(tmp_path / "elsewhere", 1, (12, 12), "L", seed=3)
    os.symlink(tmp_path / "elsewhere", folder / "linked")
    (folder / "a" / "img_0.png").rename(folder / "a" / "img_0.jfif")  # an ending Pillow knows (the bytes: PNG)
    write_images(folder / ".hidden", 1, (12, 12), "L")
    names = sorted(p.relative_to(folder).as_posix() for p in collect_images([folder]))
    assert names == ["a/img_0.jfif", "a/img_1.png", "linked/img_0.png"], names
    os.symlink("..", folder / "a" / "up")
    from common.errors import RecipeError

    with pytest.raises(RecipeError, match="link back up the tree"):
        collect_images([folder])


def test_predict_files_in_process_tta(tmp_path):
    run_dir, card, model = make_model_dir(tmp_path, "CifarCNN", tta=2)
    paths = write_images(tmp_path / "imgs", 3, (32, 32), "RGB")
    predictor = load_predictor(run_dir)
    assert predictor.tta == 2 and predictor.model_dir == run_dir / "best"
    results = predict_files(predictor, collect_images([tmp_path / "imgs"]), top_k=1, batch_size=2)
    for path, result in zip(paths, results):
        ref = torch.softmax(reference_logits(model, card, path), 0)
        assert result["predictions"][0]["index"] == int(ref.argmax())
        assert result["predictions"][0]["probability"] == pytest.approx(float(ref.max()), abs=1e-5)
    no_tta = load_predictor(run_dir, tta=0)
    assert not no_tta.tta


def test_cli_errors_name_the_problem(tmp_path, capsys):
    from common.tools.predict import main

    run_dir, _, _ = make_model_dir(tmp_path, "MLP")
    good = write_images(tmp_path / "imgs", 1, (12, 12), "L")[0]
    missing = tmp_path / "imgs" / "missing.png"
    fake = tmp_path / "fake.png"
    fake.write_text("this is text, not a PNG")

    for args, needle in [((run_dir, good, missing), str(missing)), ((run_dir, good, fake), str(fake))]:
        assert main([str(a) for a in args]) == 2, args
        out, err = capsys.readouterr()
        assert needle in err
        assert err.startswith("error: ") and err.count("\n") == 1  # one paragraph
        assert out == ""


@pytest.mark.parametrize("case", ["no_such_run", "no_model_files", "empty_folder", "bad_top_k"])
def test_model_and_argument_errors_exit_2(tmp_path, capsys, case):
    from common.tools.predict import main

    run_dir, _, _ = make_model_dir(tmp_path, "MLP")
    good = write_images(tmp_path / "imgs", 1, (12, 12), "L")[0]
    (tmp_path / "empty").mkdir()
    args, needle = {
        "no_such_run": ([tmp_path / "no_such_run", good], str(tmp_path / "no_such_run")),
        "no_model_files": ([tmp_path / "imgs", good], "model.safetensors"),
        "empty_folder": ([run_dir, tmp_path / "empty"], str(tmp_path / "empty")),
        "bad_top_k": ([run_dir, good, "--top-k", "0"], "--top-k"),
    }[case]
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_a_copy_named_like_a_recipe_is_not_taken_for_the_recipe(tmp_path):
    """`cp recipes/fashion_mnist_mlp.py ~/work/fashion_mnist_mlp.py`, edited: its runs' model.json names the recipe
    "fashion_mnist_mlp" and the copy's file. Without --recipe, predict imports neither the copy (a run folder is
    data) nor the repository's recipe of that name (which may build another model). A run trained from a recipes/
    folder elsewhere (another clone, another machine) rebuilds from this repository's when the file's bytes were
    these (model.json's recipe_sha256), and is refused when they were not (an edited copy in a recipes/ folder of
    the user's own, or an older version)."""
    import hashlib

    from common.errors import RecipeError
    from common.tools.predict import load_recipe

    run_dir, card, _ = make_model_dir(tmp_path, "MLP")
    copy = tmp_path / "work" / "fashion_mnist_mlp.py"
    for recorded in (copy, Path("/home/someone/work/fashion_mnist_mlp.py")):
        with pytest.raises(RecipeError, match="--recipe path/to/that_recipe.py"):
            load_recipe({**card, "recipe_file": str(recorded)})
    other_clone = "/home/someone/accelerate-recipes/recipes/fashion_mnist_mlp.py"
    ours = REPO / "recipes" / "fashion_mnist_mlp.py"
    assert Path(load_recipe({**card, "recipe_file": other_clone}).__file__) == ours  # a card without the file's bytes
    same = hashlib.sha256(ours.read_bytes()).hexdigest()
    assert Path(load_recipe({**card, "recipe_file": other_clone, "recipe_sha256": same}).__file__) == ours
    for recorded in (other_clone, "/home/someone/myproject/recipes/fashion_mnist_mlp.py"):  # edited, or older
        with pytest.raises(RecipeError, match="--recipe path/to/that_recipe.py"):
            load_recipe({**card, "recipe_file": recorded, "recipe_sha256": "0" * 64})
    copy.parent.mkdir()
    copy.write_text((REPO / "recipes" / "fashion_mnist_mlp.py").read_text())
    assert Path(load_recipe({**card, "recipe_file": str(copy)}, recipe_file=copy).__file__) == copy


def test_a_recipe_changed_since_the_run_trained_is_named_not_used_silently(tmp_path, capsys):
    """model.json records the recipe file's sha256. The repository's own recipes/<name>.py, edited since the run
    trained (in this clone: the file model.json names), is not imported on the run folder's word: one paragraph says
    the file changed and names --recipe. With --recipe (the user's word) it is used, and a NOTE says it is not the
    file the run trained with."""
    from common.errors import RecipeError
    from common.tools.predict import load_recipe

    _, card, _ = make_model_dir(tmp_path, "MLP")
    ours = REPO / "recipes" / "fashion_mnist_mlp.py"
    then = {**card, "recipe_file": str(ours), "recipe_sha256": "0" * 64}
    with pytest.raises(RecipeError, match=r"is not the file this run trained with.*Pass --recipe .*fashion_mnist_mlp"):
        load_recipe(then)
    assert Path(load_recipe(then, recipe_file=ours).__file__) == ours
    assert "NOTE: --recipe" in capsys.readouterr().err
    load_recipe({**then, "recipe_sha256": hashlib.sha256(ours.read_bytes()).hexdigest()})  # the same bytes: used
    assert "NOTE" not in capsys.readouterr().err
