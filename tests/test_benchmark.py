"""The throughput studies (benchmarks/throughput.py, scaling.py): each
runs end to end with --tiny on the recipe's own code and writes a complete report; bad input is
one paragraph and exit 2. No timing is asserted: the numbers are whatever this machine gives."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402
import throughput  # noqa: E402


def run_tiny(study: str, tmp_path, *extra) -> tuple[dict, str]:
    """``benchmarks/<study>.py --recipe mnist_convnet --tiny`` as a user runs it; its JSON report and stdout."""
    out_json = tmp_path / f"{study}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [
        sys.executable,
        f"benchmarks/{study}.py",
        "--recipe",
        "mnist_convnet",
        "--tiny",
        "--device",
        "cpu",
        "--work-dir",
        str(tmp_path / "work"),
        "--out-json",
        str(out_json),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nOUT:\n{proc.stdout[-4000:]}\nERR:\n{proc.stderr[-6000:]}"
    report = json.loads(out_json.read_text())
    assert report["benchmark"] == study and report["recipe"] == "mnist_convnet"
    for name, row in report["rows"].items():
        assert math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0, (name, row)
        assert row["n"] == len(row["samples_per_s_each"]) >= 2 and row["spread"] >= 0, (name, row)
    for key, ratio in report["ratios"].items():  # every ratio measured, printed, judged (never a failure)
        assert isinstance(ratio["value"], float) and math.isfinite(ratio["value"]), (key, ratio)
        assert ratio["status"] in ("PASS", "MISS", "info") and ratio["label"] in proc.stdout
    machine = report["machine"]
    assert machine["cpu"] and machine["cpu_count"] >= 1 and machine["torch_num_threads"] >= 1
    assert isinstance(machine["cpu_flags"], list) and machine["device"] == "cpu"
    assert {"torch", "accelerate", "python"} <= set(report["versions"]) and "native bf16" in proc.stdout
    return report, proc.stdout


def check_recipe_row(row: dict, processes: int, steps: int = 4) -> None:
    """A recipe row is a real run: its windows are the run directory's metrics.jsonl, the first one dropped."""
    assert row["source"] == "metrics.jsonl" and len(row["runs"]) == 1
    run = row["runs"][0]
    assert run["status"] == "completed" and run["precision"] == "no" and run["processes"] == processes
    assert "recipes/mnist_convnet.py" in run["command"] and f"--max-steps {steps}" in run["command"]
    logged = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train/samples_per_sec"] for r in logged if "train/samples_per_sec" in r]
    assert len(speeds) == steps and row["samples_per_s_each"] == [round(v, 3) for v in speeds[1:]]
    assert (Path(run["run_dir"]) / "summary.json").is_file() and Path(run["log"]).is_file()


def test_throughput_times_the_recipe_the_raw_loop_the_bound_and_the_levers(tmp_path):
    from common.train.accelerator import cpu_bf16_support

    # inductor's C++ compile takes minutes on 2 cores: the eager backend runs the same torch.compile plumbing
    report, stdout = run_tiny("throughput", tmp_path, "--compile-backend", "eager")
    cfg = report["settings"]["config"]  # the recipe's own Config: its defaults, --tiny's flags by its parser
    assert (
        cfg["width"] == 8
        and cfg["batch_size"] == 32
        and cfg["lr"] == pytest.approx(1e-2 * (32 / 256) ** 0.5)
        and cfg["label_smoothing"] == 0.1
    )
    assert report["settings"]["model"] == "LeanConvNet" and report["skipped"] == {}
    assert list(report["rows"]) == [
        "recipe",
        "raw_torch",
        "pure_compute",
        "pure_bf16",
        "pure_contiguous",  # the lever row: the memory format the recipe does not use
        "pure_compiled",
    ]
    check_recipe_row(report["rows"]["recipe"], processes=1)
    levers = report["levers"]
    assert levers["bf16"]["status"] == "ok" and levers["bf16"]["native_bf16"] == bool(cpu_bf16_support())
    assert levers["channels_last"]["status"] == "ok" and levers["channels_last"]["recipe_default"] is True
    assert levers["compile"]["status"] == "ok" and levers["compile"]["compile_s"] >= 0
    ratios = report["ratios"]
    assert set(ratios) == {
        "recipe_vs_pure_compute",
        "accelerate_overhead_1proc_pct",
        "bf16_vs_fp32",
        "channels_last_vs_contiguous",
        "compile_vs_eager",
    }
    assert ratios["recipe_vs_pure_compute"]["value"] == pytest.approx(
        report["rows"]["recipe"]["samples_per_s"] / report["rows"]["pure_compute"]["samples_per_s"]
    )
    assert "torch.compile (eager)" in stdout


def test_scaling_runs_one_and_two_processes_through_accelerate_and_raw_ddp(tmp_path):
    report, _ = run_tiny("scaling", tmp_path)
    rows = report["rows"]
    assert list(rows) == ["recipe_1proc", "raw_torch_1proc", "recipe_2proc", "raw_ddp_2proc"]
    assert all(row["threads"] == 1 for row in rows.values()) and report["skipped"] == {}
    check_recipe_row(rows["recipe_1proc"], processes=1)
    check_recipe_row(rows["recipe_2proc"], processes=2)
    assert "cpu_2proc.yaml" in rows["recipe_2proc"]["runs"][0]["command"] and rows["raw_ddp_2proc"]["backend"] == "gloo"
    assert report["ratios"]["scaling_efficiency_2proc"]["value"] == pytest.approx(
        rows["recipe_2proc"]["samples_per_s"] / (2 * rows["recipe_1proc"]["samples_per_s"])
    )


@pytest.mark.parametrize(
    "study, argv, says",
    [
        (throughput, ["--recipe", "no_such_recipe"], "there is no"),
        (throughput, ["--recipe", "mnist_convnet", "--steps", "3", "--log-every", "2"], "a multiple of --log-every"),
        (throughput, ["--recipe", "mnist_convnet", "--skip", "gpu"], "--skip gpu: unknown"),
        (
            throughput,
            ["--recipe", "mnist_convnet", "--recipe-args", "--width abc"],
            "is not a valid command line for the",
        ),
        (scaling, ["--recipe", "mnist_convnet", "--runs", "0"], "--runs 0"),
    ],
)
def test_bad_input_is_one_paragraph_and_exit_2(study, argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        study.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
