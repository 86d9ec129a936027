"""benchmarks/throughput.py: --tiny runs end to end on the recipe's own code and writes a complete report;
bad input is one paragraph and exit 2. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROWS = ["recipe", "raw_torch", "pure_compute", "pure_bf16", "pure_channels_last", "pure_compiled", "loader",
        "seed_loader", "seed_training"]
MEASURED_RATIOS = ["recipe_vs_pure_compute", "accelerate_overhead_1proc_pct", "loader_vs_recipe",
                   "loader_vs_seed_loader", "raw_vs_seed_training", "bf16_vs_fp32", "channels_last_vs_contiguous",
                   "compile_vs_eager"]
PROCESS_RATIOS = ["accelerate_overhead_1proc_1thread_pct", "accelerate_overhead_2proc_pct", "scaling_efficiency_2proc",
                  "scaling_efficiency_2proc_raw"]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("throughput_bench", REPO / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_benchmark_times_the_recipe_and_writes_a_complete_report(tmp_path):
    from common.accelerator import cpu_bf16_support

    out_json, work = tmp_path / "bench.json", tmp_path / "work"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    # The 2-process rows (two more recipe launches) and inductor's C++ compile take minutes on 2 cores: the
    # test leaves the first out and compiles with the eager backend (the same torch.compile plumbing).
    cmd = [sys.executable, "benchmarks/throughput.py", "--recipe", "mnist_convnet", "--tiny", "--device", "cpu",
           "--skip", "processes", "--compile-backend", "eager", "--work-dir", str(work), "--out-json", str(out_json)]
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                                  f"STDERR:\n{proc.stderr[-6000:]}")
    report = json.loads(out_json.read_text())

    # the model and settings are the recipe's own: its Config defaults, --tiny's flags parsed by its parser
    cfg = report["settings"]["config"]
    assert report["recipe"] == "mnist_convnet" and cfg["width"] == 8 and cfg["batch_size"] == 32
    assert cfg["lr"] == 1e-2 and cfg["label_smoothing"] == 0.1 and report["settings"]["model"] == "LeanConvNet"
    assert report["skipped"] == {"processes": "--skip processes"}

    rows = report["rows"]
    assert list(rows) == ROWS
    for name in ROWS:
        row = rows[name]
        assert math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0, (name, row)
        assert row["n"] == len(row["samples_per_s_each"]) >= 2 and row["spread"] >= 0, (name, row)

    # the recipe row is a real run: its windows are the run directory's metrics.jsonl, the first one dropped
    recipe = rows["recipe"]
    assert recipe["source"] == "metrics.jsonl" and len(recipe["runs"]) == 1
    run = recipe["runs"][0]
    assert run["status"] == "completed" and run["precision"] == "no" and run["processes"] == 1
    assert "recipes/mnist_convnet.py" in run["command"] and "--max-steps 4" in run["command"]
    logged = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train/samples_per_sec"] for r in logged if "train/samples_per_sec" in r]
    assert len(speeds) == 4 and recipe["samples_per_s_each"] == [round(v, 3) for v in speeds[1:]]
    assert (Path(run["run_dir"]) / "summary.json").is_file() and Path(run["log"]).is_file()

    levers = report["levers"]
    assert levers["bf16"]["status"] == "ok" and levers["bf16"]["native_bf16"] == bool(cpu_bf16_support())
    assert levers["channels_last"]["status"] == "ok" and levers["channels_last"]["recipe_default"] is False
    assert levers["compile"]["status"] == "ok" and levers["compile"]["backend"] == "eager"
    assert levers["compile"]["compile_s"] >= 0

    ratios = report["ratios"]
    for key in MEASURED_RATIOS:
        assert isinstance(ratios[key]["value"], float) and math.isfinite(ratios[key]["value"]), (key, ratios[key])
        assert ratios[key]["status"] in ("PASS", "MISS", "info") and ratios[key]["label"] in proc.stdout
    assert all(ratios[key]["value"] is None and ratios[key]["status"] == "n/a" for key in PROCESS_RATIOS)
    assert ratios["recipe_vs_pure_compute"]["value"] == pytest.approx(
        rows["recipe"]["samples_per_s"] / rows["pure_compute"]["samples_per_s"])

    machine = report["machine"]
    assert machine["cpu"] and machine["cpu_count"] >= 1 and machine["torch_num_threads"] >= 1
    assert isinstance(machine["cpu_flags"], list) and machine["device"] == "cpu"
    assert {"torch", "accelerate", "python"} <= set(report["versions"])
    assert "native bf16" in proc.stdout and "lever compile (eager)" in proc.stdout


@pytest.mark.parametrize("argv, says", [
    (["--recipe", "no_such_recipe"], "there is no"),
    (["--recipe", "mnist_convnet", "--steps", "3", "--log-every", "2"], "must be a multiple of --log-every"),
    (["--recipe", "mnist_convnet", "--skip", "gpu"], "--skip gpu: unknown"),
    (["--recipe", "mnist_convnet", "--recipe-args", "--width abc"], "is not a valid command line for the recipe"),
])
def test_bad_input_is_one_paragraph_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_benchmark().main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
