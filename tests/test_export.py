"""common.tools.export: ONNX export with normalization (and TTA) folded in, checked with onnxruntime.

onnx and onnxruntime are requirements, so nothing here is skipped: a missing package fails the tests.
The default exporter must work without onnxscript (which requirements.txt does not install)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from test_predict import six_view_logits

from common.data.augment import normalize
from common.tools.export import main

REPO = Path(__file__).resolve().parents[1]

# `python -c WITHOUT.format(module=...) ARGS...` runs the tool with that package made unimportable.
WITHOUT = (
    "import sys; sys.modules[{module!r}] = None; from common.tools.export import main; sys.exit(main(sys.argv[1:]))"
)
WITHOUT_ONNXSCRIPT = WITHOUT.format(module="onnxscript")  # as after README's install


# A recipe file as predict/export rebuild models from: Config plus build_model(cfg, in_shape, num_classes).
TINY_RECIPE = """
from dataclasses import dataclass

from common import models

ARGS = {"CifarCNN": {"widths": (8, 16, 16)}, "ConvNet": {"width": 4, "dropout": 0.0},
        "MLP": {"hidden": (32,), "dropout": 0.0}}


@dataclass
class Config:
    model: str = "MLP"
    tta: bool = False


def build_model(cfg, in_shape, num_classes):
    return getattr(models, cfg.model)(tuple(in_shape), num_classes, **ARGS[cfg.model])
"""


@pytest.fixture
def make_run(tmp_path):
    """make_run(kind, tta) -> (run dir, model.json card, model): <tmp>/run/best holding an untrained model
    (last layer scaled so the logits are well apart), written the way a recipe writes it, with the
    recipe file it names."""
    from common.train import checkpoint

    def make(kind: str, tta: bool = False):
        recipe_file = tmp_path / "tiny_recipe.py"
        recipe_file.write_text(TINY_RECIPE)
        shape, names = ([3, 32, 32], ["cat", "dog", "bird"]) if kind == "CifarCNN" else ([1, 16, 16], list("abcd"))
        spec = importlib.util.spec_from_file_location("tiny_recipe", recipe_file)
        recipe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(recipe)
        torch.manual_seed(0)
        model = recipe.build_model(recipe.Config(model=kind, tta=tta), shape, len(names))
        with torch.no_grad():
            [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].weight.mul_(20.0)
        model.eval()
        c = shape[0]
        card = {
            "recipe": "tiny_recipe",
            "recipe_file": str(recipe_file),
            "model": kind,
            "input_shape": shape,
            "class_names": names,
            "mean": [0.45] * c,
            "std": [0.25] * c,
            "config": {"model": kind, "tta": tta},
        }
        stub = SimpleNamespace(is_main_process=True, unwrap_model=lambda m, keep_torch_compile=True: m)
        checkpoint.save_model_dir(stub, model, tmp_path / "run" / "best", card)
        return tmp_path / "run", card, model

    return make


@pytest.mark.parametrize(
    "kind,tta,how", [("CifarCNN", 2, "cli"), ("ConvNet", False, "in_process"), ("MLP", False, "in_process")]
)
def test_export_checks_with_onnxruntime(tmp_path, make_run, kind, tta, how, capsys, monkeypatch):
    """README's command, from a folder outside the repository, with the default exporter: as a real
    command once, through main() for the other model kinds."""
    run_dir, card, model = make_run(kind, tta)
    out = tmp_path / "model.onnx"
    if how == "cli":
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "common.tools.export",
                str(run_dir),
                "--recipe",
                str(tmp_path / "tiny_recipe.py"),
                "--onnx",
                str(out),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        monkeypatch.chdir(tmp_path)
        code = main([str(run_dir), "--recipe", str(tmp_path / "tiny_recipe.py"), "--onnx", str(out)])
        stdout, stderr = capsys.readouterr()
    assert code == 0, stdout + stderr
    assert "onnxruntime check passed" in stdout and "TorchScript exporter" in stdout
    assert "skipped" not in stdout
    assert out.is_file()

    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta["class_names"]) == card["class_names"]
    assert "[0, 1]" in meta["input"]

    # The documented contract: float images in [0, 1] in, the same logits as eval preprocessing out.
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (5, *card["input_shape"]), dtype=np.uint8))
    x = normalize(pixels, card["mean"], card["std"])
    with torch.no_grad():
        want = model(x)
        if tta:
            want = six_view_logits(model, x)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"images": (pixels.float() / 255.0).numpy()})[0]
    assert got.shape == (5, len(card["class_names"]))
    assert np.abs(got - want.numpy()).max() < 1e-4
    assert (got.argmax(1) == want.argmax(1).numpy()).all()


def test_default_exporter_needs_no_onnxscript(tmp_path, make_run):
    """After README's install there is no onnxscript: the default works, --exporter dynamo says what to install."""
    run_dir, _, _ = make_run("ConvNet")
    out = tmp_path / "model.onnx"
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_ONNXSCRIPT,
            str(run_dir),
            "--recipe",
            str(tmp_path / "tiny_recipe.py"),
            "--onnx",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "onnxruntime check passed" in ok.stdout

    dyn = tmp_path / "dynamo.onnx"
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_ONNXSCRIPT,
            str(run_dir),
            "--recipe",
            str(tmp_path / "tiny_recipe.py"),
            "--onnx",
            str(dyn),
            "--exporter",
            "dynamo",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "pip install onnxscript" in bad.stderr and "leave out --exporter" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not dyn.exists()


@pytest.mark.parametrize("module", ["onnx", "onnxruntime"])
def test_missing_requirement_names_the_install(tmp_path, make_run, module):
    run_dir, _, _ = make_run("MLP")
    out = tmp_path / "model.onnx"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT.format(module=module),
            str(run_dir),
            "--recipe",
            str(tmp_path / "tiny_recipe.py"),
            "--onnx",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"needs the {module} package" in proc.stderr and "pip install -r requirements.txt" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_help_says_what_each_exporter_needs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "common.tools.export", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("``", "").split())
    assert "nothing extra" not in text
    assert "torchscript (default)" in text and "dynamo=False" in text
    assert "pip install onnxscript" in text and "needs onnx and onnxscript" in text
    assert "skipped" not in text  # the check always runs: onnxruntime is a requirement


def test_failed_export_names_a_fix_that_is_not_the_same_exporter(tmp_path, make_run, monkeypatch, capsys):
    run_dir, _, _ = make_run("MLP")
    out = tmp_path / "model.onnx"

    def broken_export(*args, **kwargs):
        Path(args[2]).write_bytes(b"half")
        raise RuntimeError("an operator this exporter cannot translate")

    args = [str(run_dir), "--recipe", str(tmp_path / "tiny_recipe.py"), "--onnx", str(out)]
    assert main(args) == 0  # a good export first: a failed one must leave it as it is
    good = out.read_bytes()
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(torch.onnx, "export", broken_export)
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "TorchScript exporter" in err and "cannot translate" in err
    assert "pip install onnxscript`, then add --exporter dynamo" in err
    assert out.read_bytes() == good  # the previous file kept, no half-written one beside it
    assert sorted(p.name for p in tmp_path.glob("*.onnx*")) == ["model.onnx"]
    assert main([*args, "--atol", "0"]) != 0  # the onnxruntime check fails: the previous file is kept too
    assert out.read_bytes() == good and "was not written (the previous file there is kept)" in capsys.readouterr().out


def test_export_raw_model_in_process(tmp_path, make_run, capsys):
    run_dir, card, model = make_run("ConvNet")
    out = tmp_path / "raw.onnx"
    assert (
        main(
            [
                str(run_dir / "best"),
                "--recipe",
                str(tmp_path / "tiny_recipe.py"),
                "--onnx",
                str(out),
                "--no-preprocess",
                "--exporter",
                "torchscript",
            ]
        )
        == 0
    )
    assert "onnxruntime check passed" in capsys.readouterr().out
    x = torch.randn(2, *card["input_shape"])
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        assert np.abs(session.run(None, {"images": x.numpy()})[0] - model(x).numpy()).max() < 1e-4


def test_export_bad_model_path_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--onnx", str(tmp_path / "x.onnx")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
