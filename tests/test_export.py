"""common.export: ONNX export with normalization (and TTA) folded in, checked with onnxruntime.

Skipped only when onnx or onnxruntime is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import checkpoint, models  # noqa: E402
from common.augment import normalize  # noqa: E402

onnx = pytest.importorskip("onnx", reason="the onnx package is not installed (pip install onnx)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")

STUB_ACCELERATOR = SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m)


def make_model_dir(root: Path, kind: str, tta: bool):
    """<root>/run/best from an untrained model (last layer scaled so the logits are well apart)."""
    shape, names = ([3, 32, 32], ["cat", "dog", "bird"]) if kind == "CifarCNN" else ([1, 16, 16], ["a", "b", "c", "d"])
    args = {"CifarCNN": {"widths": [8, 16, 16]}, "ConvNet": {"width": 4, "dropout": 0.0},
            "MLP": {"hidden": [32], "dropout": 0.0}}[kind]
    torch.manual_seed(0)
    builder = getattr(models, kind)
    model = builder(tuple(shape), len(names), **{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    with torch.no_grad():
        [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].weight.mul_(20.0)
    model.eval()
    c = shape[0]
    card = {"recipe": "test_export", "model": kind, "model_args": args, "input_shape": shape, "class_names": names,
            "mean": [0.45] * c, "std": [0.25] * c, "config": {"tta": tta}}
    checkpoint.save_model_dir(STUB_ACCELERATOR, model, root / "run" / "best", card)
    return root / "run", card, model


@pytest.mark.parametrize("kind,tta", [("CifarCNN", True), ("ConvNet", False), ("MLP", False)])
def test_export_cli_checks_with_onnxruntime(tmp_path, kind, tta):
    run_dir, card, model = make_model_dir(tmp_path, kind, tta)
    out = tmp_path / "model.onnx"
    proc = subprocess.run([sys.executable, "-m", "common.export", str(run_dir), "--onnx", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "onnxruntime check passed" in proc.stdout
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
            want = 0.5 * (want + model(x.flip(3)))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"images": (pixels.float() / 255.0).numpy()})[0]
    assert got.shape == (5, len(card["class_names"]))
    assert np.abs(got - want.numpy()).max() < 1e-4
    assert (got.argmax(1) == want.argmax(1).numpy()).all()


def test_export_raw_model_in_process(tmp_path, capsys):
    from common.export import main

    run_dir, card, model = make_model_dir(tmp_path, "ConvNet", tta=False)
    out = tmp_path / "raw.onnx"
    assert main([str(run_dir / "best"), "--onnx", str(out), "--no-preprocess", "--exporter", "legacy"]) == 0
    assert "onnxruntime check passed" in capsys.readouterr().out
    x = torch.randn(2, *card["input_shape"])
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        assert np.abs(session.run(None, {"images": x.numpy()})[0] - model(x).numpy()).max() < 1e-4


def test_export_bad_model_path_exits_2(tmp_path, capsys):
    from common.export import main

    assert main([str(tmp_path / "nope"), "--onnx", str(tmp_path / "x.onnx")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
