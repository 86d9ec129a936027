"""benchmarks/throughput.py --tiny runs end to end and writes a complete report. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MEASUREMENTS = [
    "pure_compute", "recipe", "raw_torch", "recipe_bf16", "loader",
    "recipe_1proc_1thread", "raw_torch_1proc_1thread", "recipe_2proc_1thread", "raw_ddp_2proc_1thread",
    "seed_training", "seed_loader",
]
RATIOS = [
    "recipe_vs_pure_compute", "loader_vs_recipe", "loader_vs_seed_loader", "recipe_vs_seed_training",
    "accelerate_overhead_1proc_pct", "accelerate_overhead_2proc_pct", "scaling_efficiency_2proc", "bf16_vs_fp32",
]


def test_tiny_benchmark_writes_complete_report(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    # --device cpu: the 2-process measurements need 2 GPUs on a GPU machine, 2 CPU processes anywhere
    cmd = [sys.executable, "benchmarks/throughput.py", "--recipe", "mnist_convnet", "--tiny", "--device", "cpu",
           "--out-json", str(out_json), "--out-png", str(out_png)]
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"

    report = json.loads(out_json.read_text())
    assert report["recipe"] == "mnist_convnet" and report["skipped"] == {}
    for key in MEASUREMENTS:
        m = report["measurements"][key]
        assert m["samples_per_s"] > 0 and m["median_s"] > 0, (key, m)
        assert len(m["repeat_s"]) == 2 and all(t > 0 for t in m["repeat_s"]), (key, m)
    assert report["measurements"]["recipe_2proc_1thread"]["backend"] == "gloo"
    for key in RATIOS:
        r = report["ratios"][key]
        assert isinstance(r["value"], float) and math.isfinite(r["value"]), (key, r)
        assert r["status"] in ("PASS", "MISS", "info"), (key, r)
        assert r["label"] in proc.stdout
    machine = report["machine"]
    assert machine["hostname"] and machine["platform"] and machine["cpu_count"] >= 1
    assert machine["torch_num_threads"] >= 1 and machine["device"] == "cpu"
    assert {"torch", "accelerate", "python"} <= set(report["versions"])
    assert ("PASS" in proc.stdout) or ("MISS" in proc.stdout)
    assert out_png.stat().st_size > 0 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_mirrors_the_recipes_defaults():
    """The benchmark rebuilds each recipe's training step; its settings must be the recipes' defaults."""
    import importlib.util

    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput

    for name, spec in throughput.RECIPES.items():
        module_spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
        recipe = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = recipe  # dataclasses look their module up there
        module_spec.loader.exec_module(recipe)
        cfg = recipe.Config()
        pairs = {"widths": getattr(cfg, "widths", getattr(cfg, "hidden", None))}
        for key in ("batch_size", "lr", "weight_decay", "label_smoothing", "translate", "flip", "channels_last",
                    "dropout", "width", "depth", "momentum"):
            if hasattr(cfg, key):
                pairs[key] = getattr(cfg, key)
            elif key in spec:  # a technique this recipe does not have must be off in the benchmark too
                assert not spec[key], (name, key, spec[key], "not a knob of the recipe")
        for key, value in pairs.items():
            if key in spec or value is not None:
                assert spec.get(key) == value, (name, key, spec.get(key), value)
