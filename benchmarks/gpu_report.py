"""The project's GPU figures in one command that fits the GPU window (one H100 or H200, a copy of the working tree
plus at most 64 MiB of carried ignored files, no `datasets`, this project not installed, no network, at most 10
minutes a command; only files under $OUT come back), and its rehearsal on a CPU.

    python benchmarks/gpu_data.py                               # once, here: ../shared/data -> gpu-data/ (54 MiB)
    python benchmarks/gpu_report.py --rehearse --out /tmp/gr    # every row at toy size on this CPU, as there
    python benchmarks/gpu_report.py --dry-run                   # every row's command and time budget

The device run is one `run` call (DEVICE_COMMAND below), carrying gpu-data/ (carry ["gpu-data"], timeout_s 540):

    ACCELERATE_RECIPES_REVISION=<rev> PYTHONPATH=$PWD python3 benchmarks/gpu_report.py --out $OUT \
        --work-dir /tmp/gpu-report

(--dry-run prints it with this tree's revision: the device's copy has no git).
It writes $OUT/gpu_report.md (the table: the GPU, the versions, every row's result, goal, status and seconds, the
failed rows' log tails), $OUT/gpu_report.json, $OUT/logs.tar.gz (each row's log and its runs' summary, config and
metrics) and $OUT/traces.tar.gz (the profiler traces): four files, as what comes back is at most eight. Run dirs,
caches and temporary files go to --work-dir (default <out>/work, which is what --rehearse keeps); nothing is
written anywhere else: HOME-based caches, TMPDIR, the inductor, Triton, CUDA and matplotlib caches all point into
it, bytecode is not written, and every row runs from it.

The data: gpu-data/ (benchmarks/gpu_data.py) is installed first into what the recipes read without `datasets`
(a folder and its decoded cache with the source index naming it); the photos are read where they are.

Rows, in order of priority (the speed goals first: a run cut short keeps them), one subprocess each with its own time
budget (BUDGET_S for the default command, which sums to DEADLINE_S less SETUP_S; EXTRA_BUDGET_S for the rows that run
only when --only names them: throughput, profile/mnist_convnet and correct); a row may use what earlier rows left
unused, never what later rows are budgeted. A row that fails, times out or is not reached is reported in the table
with the tail of its log; the script goes on and always writes the table. What each row runs and its goal, and what
--rehearse does (every row at toy size on this CPU, in an environment made like the GPU machine's, failing a row that
ran another precision than a GPU run would or ran past its scaled budget): benchmarks/README.md, "GPU report".
"""

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import site
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import venv
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import gpu_data
import torch
from harness import (  # first: the repo on sys.path
    REPO,
    REVISION_VAR,
    bad_input,
    machine_line,
    provenance,
    recipe_windows,
    revision,
    summarize,
    warn_if_busy,
)
from launching import CONFIGS_DIR, read_run, recipe_env, run_logged, stop_children_on_term

DEADLINE_S, SETUP_S, RUN_TIMEOUT_S = 480, 20, 540  # the script's deadline, its data install, the run's timeout_s
# The default command's rows and their seconds on the GPU, summing to at most DEADLINE_S less SETUP_S: what decides
# the GPU goals. From an NVIDIA H200's report (benchmarks/results/gpu/h200-2026-11-27.json), where one launch of a
# recipe cost about 30 s before its first step and cifar_cnn trained 9.7 s, mnist_convnet 4.3 s, airbench94 2.8 s; the
# rows of several seeds run each side's seeds in one process (a launch, then each seed's main: estimated at the
# first seed's cost plus the training and a few seconds for each later one), with a 25% margin.
BUDGET_S = {
    "cifar_cnn_vs_airbench94": 150,  # 5 seeds: the recipe's launch ~45 s + 4 x ~12 s, airbench94 ~15 s + 4 x ~4 s
    "mnist_convnet_to_99.3": 78,  # 3 seeds: ~46 s (the 1-seed row) + 2 x ~8 s
    "ab/cifar_cnn/report-to-none": 45,  # each: cifar_cnn alone, one launch (about 40 s of the 56 s 1-seed row)
    "ab/cifar_cnn/cudnn-off": 45,
    "profile/cifar_cnn": 23,  # the H200 report's 22.4 s
    # photos/*: never run on a GPU yet; estimated from the recipes' launches (~25 s to the first step), 80 steps of
    # 32 photos at ~1,500 images/s (8 workers' decoding), a ResNet-50's build and the reference's torch import
    "photos/decode": 20,
    "photos/reference": 45,
    "photos/recipe": 50,
}
# Rows a run makes only when --only names them (they do not fit the default run's deadline): their own budgets
# (the H200 report's seconds, rounded up by about a second)
EXTRA_BUDGET_S = {
    "throughput/mnist_convnet/host": 20,
    "throughput/mnist_convnet/device": 18,
    "throughput/cifar_cnn/host": 26,
    "throughput/cifar_cnn/device": 22,
    "profile/mnist_convnet": 19,
    "correct/bf16": 21,
    "correct/bf16+clip": 16,
    "correct/fp16": 21,
    "correct/fp16+clip": 18,
    "correct/compile": 48,
    "correct/compile/predict": 7,
    "correct/ema": 46,
    "correct/sync-bn": 25,
    "correct/fsdp2": 45,
}
ALL_BUDGET_S = {**BUDGET_S, **EXTRA_BUDGET_S}
DEFAULT_SEEDS = {"cifar_cnn_vs_airbench94": "1,2,3,4,5", "mnist_convnet_to_99.3": "1,2,3"}
DEVICE_COMMAND = "PYTHONPATH=$PWD python3 benchmarks/gpu_report.py --out $OUT --work-dir /tmp/gpu-report"
CARRY = "gpu-data"
TTA, ME = REPO / "benchmarks" / "time_to_accuracy.py", Path(__file__).resolve()
STEPS = 40  # optimizer steps of each correctness row
# The rows' order: what the speed goals need first (a run cut short keeps them), the correctness checks last
PRIORITY = (
    "cifar_cnn_vs_airbench94", "mnist_convnet_to_99.3", "ab/", "profile/", "photos/", "throughput/",
    "correct/",
)  # fmt: skip
INNER = "GPU_REPORT_REHEARSAL"  # set in the rehearsal's own process, inside its environment
TOY = {  # rehearsal: small models and batches (last on the command line: they win)
    "mnist_convnet": "--width 8 --hidden 32 --batch-size 8".split(),
    "cifar_cnn": "--widths 8,16,16 --batch-size 8".split(),
    "finetune_folder": "--model mobilenet_v3_small --image-size 32 --batch-size 4 --epochs 2 --workers 0".split(),
}
# rehearsal: dynamo's capture without inductor's code generation (minutes of C++ compiling on 2 cores, and not
# the code a GPU runs): the wrapper, its saved weights and predict are what the rehearsal checks
TOY_BACKEND = "eager"
TOY_AIRBENCH = dict(batch_size=64, widths=(8, 16, 16), epochs=1, whiten_bias_epochs=1)
# rehearsal: the precision a CPU runs for what a row asks (make_accelerator: fp16 asked on a CPU trains in bf16); bf16
# stays bf16 through the native-bf16 stand-in on any CPU, so a fallback to fp32 is a failure there as on a GPU
CPU_PRECISION = {"fp16": "bf16"}
BF16_STANDIN = REPO / "tests" / "standins" / "native_bf16_on_cpu.py"
# rehearsal: a row's time allowance is its GPU budget scaled to the rehearsal machine, declared, not measured: two rows
# at a time on a 2-core CPU (each gets about one core) at toy sizes, where most of a row is its launches (two torch
# imports and torch._dynamo's each, as on the GPU, at about half the GPU machine's single-core speed): 2x the budget;
# and at least 20 s, the imports of one process on that shared CPU, which the budgets of a few seconds (predict's 7 s,
# after its CUDA context is up) never had to hold. A row past its allowance fails the rehearsal: its GPU budget is
# then likely short too.
REHEARSAL_FACTOR, REHEARSAL_MIN_S = 2.0, 20.0
CACHES = {  # environment variable -> folder under the work dir: where each cache or temporary file goes
    "TMPDIR": "tmp",
    "MPLCONFIGDIR": "mpl",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "TRITON_HOME": "triton-home",
    "CUDA_CACHE_PATH": "nv-cache",
    "TORCH_HOME": "torch-home",
    "TORCH_EXTENSIONS_DIR": "torch-extensions",
    "XDG_CACHE_HOME": "xdg-cache",
    "XDG_CONFIG_HOME": "xdg-config",
}
# what the rehearsal's Python leaves out of this one's packages: what the GPU machine lacks
LEFT_OUT = ("datasets", "common", "recipes", "__pycache__")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "aten::item")


@dataclass
class Row:
    name: str
    budget_s: int  # on the GPU
    what: str
    cmd: list
    read: Callable  # () -> (result, goal, passed: True/False/None, data)
    after: str | None = None  # a row whose output this one reads: runs after it, not at all if it failed
    reads: str | None = None  # a row whose output this one reads when there is one: runs after it whatever it did
    record: dict = field(default_factory=dict)


@dataclass
class Ctx:
    py: str  # the Python the rows run with
    work: Path
    data: dict  # dataset name -> the folder to pass as --dataset
    seed: int
    toy: bool
    device: str  # cuda, or cpu in the rehearsal
    cifar_seeds: str = ""  # the cifar_cnn_vs_airbench94 row's seeds (default: DEFAULT_SEEDS)


# --- reading what a row wrote ---------------------------------------------------------------------------------------


def ran_as(precision: str, toy: bool) -> str:
    """The precision a row asking for ``precision`` must run under: on the GPU what it asks; in the rehearsal what a
    CPU gives for it (``CPU_PRECISION``), never a fallback to fp32."""
    return CPU_PRECISION.get(precision, precision) if toy else precision


def read_correct(run_dir: Path, precision: str, toy: bool, compiled: bool = False):
    """A correctness row's run: completed, STEPS steps, a finite validation loss, and the precision it asked for (in
    the rehearsal too: ``ran_as``)."""
    s = read_run(run_dir)["summary"]
    if not s:
        raise RuntimeError(f"{run_dir} has no summary.json")
    final = s.get("final") or {}
    loss, acc = final.get("val/loss"), final.get("val/accuracy")
    checks = {
        "status completed": s.get("status") == "completed",
        f"{STEPS} steps": s.get("global_step") == STEPS,
        "finite val loss": loss is not None and math.isfinite(loss),
    }
    expected = ran_as(precision, toy)
    asked = f" (asked {precision}: a CPU runs {expected})" if expected != precision else ""
    checks[f"precision {expected}{asked}"] = s.get("precision") == expected
    if compiled:
        checks.update(plain_weights(run_dir))
    text = (
        f"{s.get('status')}, {s.get('global_step')} steps, precision {s.get('precision')}, skipped steps "
        f"{s.get('skipped_steps')}, val loss {loss if loss is None else f'{loss:.4f}'}, accuracy "
        f"{acc if acc is None else f'{acc:.4f}'}"
    )
    missed = [k for k, ok in checks.items() if not ok]
    return text + (f"; MISSED: {', '.join(missed)}" if missed else ""), ", ".join(checks), not missed, s


def read_sharded(run_dir: Path, toy: bool):
    """An FSDP2 run: completed, its startup line said so, its checkpoints hold Accelerate's sharded folders, final/
    one whole state_dict of the model's own class."""
    from safetensors import safe_open

    # the rehearsal's FSDP stand-in runs fp32 whatever the launcher asks (tests/standins/fsdp_on_cpu.py says why)
    text, goal, passed, s = read_correct(run_dir, "no" if toy else "bf16", toy)
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    checks = {
        "distributed FSDP": s.get("distributed") == "FSDP",
        "sharded checkpoint": bool(checkpoints) and (checkpoints[-1] / "pytorch_model_fsdp_0" / ".metadata").exists(),
        "final/ names the model's class": "FSDP" not in (run_dir / "final" / "model.json").read_text(),
    }
    with safe_open(str(run_dir / "final" / "model.safetensors"), "pt") as f:
        checks["final/ whole"] = len(list(f.keys())) > 0
    missed = [k for k, ok in checks.items() if not ok]
    text += f"; MISSED: {', '.join(missed)}" if missed else ""
    return text, f"{goal}, {', '.join(checks)}", passed and not missed, s


def plain_weights(run_dir: Path) -> dict:
    """best/ and final/ of a compiled run hold the model's own state keys and name its own class."""
    from safetensors import safe_open

    checks = {}
    for sub in ("best", "final"):
        weights, card = run_dir / sub / "model.safetensors", run_dir / sub / "model.json"
        if weights.exists():
            with safe_open(str(weights), "pt") as f:
                checks[f"{sub}/ without _orig_mod. keys"] = not any("_orig_mod" in k.split(".") for k in f.keys())
            checks[f"{sub}/model.json names no OptimizedModule"] = "OptimizedModule" not in card.read_text()
    return checks or {"best/ or final/ written": False}


def read_predict(out: Path, inputs: Path):
    results = json.loads(out.read_text())["results"]
    n = len(list(inputs.glob("*.png")))
    right = sum(int(Path(r["file"]).stem.split("label")[1]) == r["predictions"][0]["index"] for r in results)
    text = f"{len(results)} of {n} images predicted; top-1 right on {right} ({right / max(1, len(results)):.0%})"
    return text, "every image predicted", len(results) == n > 0, {"images": n, "right": right}


def read_tta_cifar(out: Path, toy: bool):
    """Every seed of the row, judged by the means as the goal states it (one seed's accuracy on 5,000 images moves by
    about 0.4 points, a binomial sd: a rule per seed fails an equally good recipe most of the time): cifar_cnn's mean
    final accuracy at least airbench94's mean, with the paired mean difference and its spread, and the ratio of the
    two sides' mean times on one timer (from just before the first step to the end of the evaluation that gave the
    final accuracy) at most 1.2. Each seed's time to airbench94's accuracy of the same seed is reported beside."""
    seeds = json.loads(out.read_text())["seeds"]

    def spread(values, digits):
        sd = f" +- {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
        return f"{statistics.mean(values):.{digits}f}{sd}"

    ends = [(s["recipe"]["curve"][-1], s["baseline"]["curve"][-1]) for s in seeds]
    r_acc, b_acc = [r["accuracy"] for r, _ in ends], [b["accuracy"] for _, b in ends]
    r_time, b_time = [r["time_s"] for r, _ in ends], [b["time_s"] for _, b in ends]
    diffs = [r - b for r, b in zip(r_acc, b_acc)]  # paired: the same seed's split and order on both sides
    time_ratio = statistics.mean(r_time) / statistics.mean(b_time)
    ratios = [s["recipe"]["time_to_target_s"] / b["time_s"] for s, (_, b) in zip(seeds, ends) if s["recipe"]["reached"]]
    cold = (
        f"; the first seed {r_time[0]:.1f} s, the others {statistics.mean(r_time[1:]):.1f} s" if len(seeds) > 1 else ""
    )
    cold += f" (the first seed's {fmt_phases(seeds[0]['recipe'].get('phases'))})"
    text = (
        f"{len(seeds)} seed(s): cifar_cnn {spread(r_acc, 4)} in {spread(r_time, 1)} s{cold} (launch to exit or main "
        f"{statistics.mean(s['recipe']['process_wall_s'] for s in seeds):.1f} s); airbench94 {spread(b_acc, 4)} in "
        f"{spread(b_time, 1)} s; paired accuracy difference {spread(diffs, 4)}; mean times {time_ratio:.2f}x "
        f"airbench94's; per seed, cifar_cnn to airbench's accuracy reached in {len(ratios)} of {len(seeds)}"
        + (f", at {', '.join(f'{x:.2f}' for x in ratios)}x airbench's time" if ratios else "")
    )
    met = statistics.mean(r_acc) >= statistics.mean(b_acc) and time_ratio <= 1.2
    judged = {
        "mean_accuracy": {"cifar_cnn": statistics.mean(r_acc), "airbench94": statistics.mean(b_acc)},
        "paired_difference": {
            "mean": statistics.mean(diffs),
            "sd": statistics.stdev(diffs) if len(diffs) > 1 else None,
        },
        "mean_time_s": {"cifar_cnn": statistics.mean(r_time), "airbench94": statistics.mean(b_time)},
        "time_ratio": time_ratio,
    }
    goal = "mean accuracy >= airbench94's mean, mean time <= 1.2x airbench94's"
    return text, goal, None if toy else met, {"seeds": seeds, "judged": judged}


def fmt_phases(p: dict | None) -> str:
    """time_to_accuracy's ``phases`` of a recipe run in a line."""
    if not p:
        return "phases not recorded"
    parts = [f"set-up {p['setup_s']:.2f} s" if p.get("setup_s") is not None else None]
    parts.append(f"first update {p['first_update_s']:.2f} s" if p.get("first_update_s") is not None else None)
    if p.get("first_window"):
        parts.append(f"then {p['first_window']['steps']} steps in {p['first_window']['s']:.2f} s")
    if p.get("later_ms_per_step") is not None:
        parts.append(f"then {p['later_ms_per_step']:.2f} ms a step")
    return ", ".join(x for x in parts if x) or "phases not recorded"


def read_alone(out: Path, as_is: Path | None = None):
    """A recipe run alone (an ab/ row): its final accuracy, its training time from just before the first step to the
    end of the evaluation that gave it (the one timer of the cifar row), its first steps' phases and its launch to
    exit; beside it, ``as_is``'s (the cifar row's) first seed, the recipe as is in a fresh process, when it ran."""
    r = json.loads(out.read_text())["seeds"][0]["recipe"]
    end = r["curve"][-1]
    text = f"final accuracy {end['accuracy']:.4f} at {end['time_s']:.2f} s of training ({fmt_phases(r.get('phases'))})"
    text += f"; launch to exit {r['process_wall_s']:.1f} s"
    data = {"final_accuracy": end["accuracy"], "train_s": end["time_s"], "wall_s": r["process_wall_s"]}
    data["phases"] = r.get("phases")
    if as_is is not None and as_is.exists():
        first = json.loads(as_is.read_text())["seeds"][0]["recipe"]
        t = first["curve"][-1]["time_s"]
        text += f"; as is (the cifar row's first seed): {t:.2f} s ({fmt_phases(first.get('phases'))})"
        data.update(as_is_train_s=t, as_is_phases=first.get("phases"), saved_s=t - end["time_s"])
    return text, "-", None, data


def read_tta_mnist(out: Path, toy: bool):
    """The seeds of the row (in one process: the first pays its one-time costs, reported apart): each seed's time to
    99.3% and final accuracy. The goal, judged by the means: a mean final accuracy of at least 99.3% and a mean time
    to 99.3%, over the seeds that reached it, under 2 s."""
    seeds = [s["recipe"] for s in json.loads(out.read_text())["seeds"]]
    times = [r["time_to_target_s"] for r in seeds if r["reached"]]
    finals = [r["final_accuracy"] for r in seeds if r["final_accuracy"] is not None]
    each = ", ".join(f"{r['time_to_target_s']:.2f} s" if r["reached"] else "not reached" for r in seeds)
    text = (
        f"{len(seeds)} seed(s) to 99.3%: {each} (reached in {len(times)} of {len(seeds)}"
        + (f", mean {statistics.mean(times):.2f} s" if times else "")
        + f"); final accuracy mean {statistics.mean(finals):.4f}" * bool(finals)
        + f"; the first seed's main {seeds[0]['process_wall_s']:.1f} s"
        + (f", the others' {statistics.mean(r['process_wall_s'] for r in seeds[1:]):.1f} s" if len(seeds) > 1 else "")
    )
    met = bool(times) and bool(finals) and statistics.mean(finals) >= 0.993 and statistics.mean(times) < 2
    return text, "mean final >= 99.3%, mean time to 99.3% < 2 s", None if toy else met, {"seeds": seeds}


def windows(run_dir: Path) -> dict:
    """images/s of a recipe run: the median of its metrics.jsonl windows after the first."""
    rows = recipe_windows(read_run(run_dir)["rows"])
    if not rows:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no throughput window after the first")
    rates = [r["train/samples_per_sec"] for r in rows]
    waits = [r["train/data_wait_fraction"] for r in rows if r.get("train/data_wait_fraction") is not None]
    return {**summarize(rates), "data_wait": statistics.median(waits) if waits else None, "windows": rates}


def read_rate(run_dir: Path):
    w = windows(run_dir)
    text = f"{w['samples_per_s']:,.0f} images/s (spread {w['spread']:.0%}"
    text += f", data wait {w['data_wait']:.0%})" if w["data_wait"] is not None else ")"
    return text, "-", None, w


def read_photo_reference(out: Path):
    """The reference's images/s and data wait over its windows (the steady state), and over all its epochs."""
    r = json.loads(out.read_text())
    if r.get("steady_images_per_s") is None:
        raise RuntimeError(f"{out}: fewer than two windows of {r.get('window')} steps, none after the first")
    text = (
        f"{r['steady_images_per_s']:,.0f} images/s, data wait {r['steady_data_wait_share']:.0%} over windows of "
        f"{r['window']} steps ({r['model']}, {r['crop']} px); all epochs {r['images_per_s']:,.0f} images/s"
    )
    return text, "-", None, r


def read_photo_decode(out: Path):
    r = json.loads(out.read_text())
    text = f"{r['images_per_s']:,.0f} images/s ({r['images']} images, {r['workers']} workers kept across epochs, "
    text += f"{r['crop']} px)"
    return text, "-", None, r


def read_photo_recipe(run_dir: Path, reference: Path, toy: bool, decode: Path | None = None):
    """The photo recipe's images/s and data wait beside the reference's (photos/reference, run just before), and,
    when both wait on their data more than half the time, the CPUs' decode ceiling (photos/decode)."""
    text, _, _, w = read_rate(run_dir)
    if not reference.exists():
        return text + "; the reference row left no result", ">= the reference's images/s", None, w
    ref = json.loads(reference.read_text())
    if ref.get("steady_images_per_s") is None:
        return text + "; the reference row has no steady-state windows", ">= the reference's images/s", None, w
    ratio = w["samples_per_s"] / ref["steady_images_per_s"]
    text += f"; {ratio:.2f}x the reference's {ref['steady_images_per_s']:,.0f} images/s (windows of the same steps)"
    if (w["data_wait"] or 0) > 0.5 and ref["steady_data_wait_share"] > 0.5:
        ceiling = json.loads(decode.read_text())["images_per_s"] if decode and decode.exists() else None
        text += "; both wait on their data more than half the time" + (
            f": the CPUs decode {ceiling:,.0f} images/s the reference's way (photos/decode)" if ceiling else ""
        )
    return text, ">= the reference's images/s", None if toy else ratio >= 1.0, {**w, "reference": ref, "ratio": ratio}


def read_profile(run_dir: Path):
    traces = sorted((run_dir / "profile").rglob("*.json"))
    if not traces:
        raise RuntimeError(f"no trace in {run_dir / 'profile'}")
    calls, mib = Counter(), sum(t.stat().st_size for t in traces) / 2**20
    steps, device_us = [], 0.0
    for t in traces:
        for e in json.loads(t.read_text()).get("traceEvents", []):
            name = str(e.get("name", ""))
            if e.get("ph") != "X":
                continue
            if any(name == s or name.startswith(s + "_") for s in SYNC_CALLS):
                calls[name] += 1
            if name.startswith("ProfilerStep#") and e.get("cat") == "user_annotation":
                steps.append(float(e.get("dur", 0)))  # the host's time for the step
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                device_us += float(e.get("dur", 0))  # the device busy
    found = ", ".join(f"{k} x{v}" for k, v in calls.most_common()) or "none"
    host_ms = statistics.mean(steps) / 1000 if steps else None
    device_ms = device_us / len(steps) / 1000 if steps and device_us else None
    text = f"{len(traces)} trace(s), {mib:.1f} MiB; synchronising calls in 5 steps: {found}"
    if host_ms is not None:
        text += f"; a step: host {host_ms:.2f} ms, device busy " + (f"{device_ms:.2f} ms" if device_ms else "-")
    data = {"trace_mib": mib, "sync_calls": dict(calls), "host_ms_per_step": host_ms, "device_ms_per_step": device_ms}
    return text, "-", None, data


# --- the rows -------------------------------------------------------------------------------------------------------


def launch(ctx: Ctx, recipe: str, args, precision: str = "bf16", extra=(), through=()) -> list:
    """`accelerate launch --config_file accelerate_configs/single_gpu.yaml ...` with the report's Python; ``through``:
    a script that runs the recipe (the rehearsal's FSDP stand-in). The rehearsal's launches in bf16 or fp16 go through
    the native-bf16 stand-in first: they run bf16 on any CPU."""
    if ctx.toy and precision != "no":
        through = (BF16_STANDIN, *through)
    launcher = [ctx.py, "-m", "accelerate.commands.launch", "--config_file", CONFIGS_DIR / "single_gpu.yaml"]
    return [*launcher, "--mixed_precision", precision, *extra, *through, REPO / "recipes" / f"{recipe}.py", *args]


def blob_id(path: Path) -> str:
    """git's id of the file's content (git hash-object), which names the airbench94 code the row ran."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:12]


def plan(ctx: Ctx) -> list[Row]:
    w, s, toy = ctx.work, ctx.seed, ctx.toy
    data = dict(
        zip(("mnist_convnet", "cifar_cnn", "finetune_folder"), (ctx.data[k] for k in ("mnist", "cifar10", "flowers")))
    )

    def args(recipe, run, *flags, report=False):
        own = ["--dataset", data[recipe], "--seed", s, "--cache-dir", w / "cache", "--output-dir", w / "runs" / run]
        return [*own, *flags, *([] if report else ["--report-to", "none"]), *(TOY[recipe] if toy else [])]

    steps, rows = ["--epochs", 1, "--max-steps", STEPS, "--log-every", 10], []
    for precision in ("bf16", "fp16"):
        for clip in (False, True):
            name = f"correct/{precision}{'+clip' if clip else ''}"
            run = w / "runs" / name.replace("/", "-")
            flags = [*steps, *(["--max-grad-norm", 1] if clip else [])]
            rows.append(
                Row(
                    name,
                    ALL_BUDGET_S[name],
                    f"mnist_convnet {precision}{', --max-grad-norm 1' if clip else ''}, {STEPS} steps",
                    launch(ctx, "mnist_convnet", args("mnist_convnet", run.name, *flags, report=not clip), precision),
                    lambda r=run, p=precision: read_correct(r, p, toy),
                )
            )
    run, backend = w / "runs" / "correct-compile", TOY_BACKEND if toy else "inductor"
    rows.append(
        Row(
            "correct/compile",
            ALL_BUDGET_S["correct/compile"],
            f"mnist_convnet bf16 under --dynamo_backend {backend}, {STEPS} steps; weights without _orig_mod.",
            launch(ctx, "mnist_convnet", args("mnist_convnet", run.name, *steps), extra=("--dynamo_backend", backend)),
            lambda r=run: read_correct(r, "bf16", toy, compiled=True),
        )
    )
    out, inputs = w / "predict.json", w / "predict-inputs"
    predict = [ctx.py, "-m", "common.tools.predict", run, inputs, "--device", ctx.device, "--format", "json"]
    rows.append(
        Row(
            "correct/compile/predict",
            ALL_BUDGET_S["correct/compile/predict"],
            "python -m common.tools.predict on the compiled run's best/ (else final/), 48 held-out images",
            [*predict, "--output", out],
            lambda o=out, i=inputs: read_predict(o, i),
            after="correct/compile",
        )
    )
    for name, recipe, flags, what in (
        ("correct/ema", "finetune_folder", ["--ema-decay", 0.99, "--epochs", 8, "--batch-size", 32],
         "finetune_folder --ema-decay 0.99, 200 flower photos"),
        ("correct/sync-bn", "cifar_cnn", ["--sync-bn", "--epochs", 1], "cifar_cnn --sync-bn, 1 GPU"),
    ):  # fmt: skip
        run = w / "runs" / name.replace("/", "-")
        flags = [*flags, "--max-steps", STEPS, "--log-every", 10]
        rows.append(
            Row(
                name,
                ALL_BUDGET_S[name],
                f"{what}, {STEPS} steps",
                launch(ctx, recipe, args(recipe, run.name, *flags)),
                lambda r=run: read_correct(r, "bf16", toy),
            )
        )
    # FSDP version 2 as `accelerate launch --use_fsdp --fsdp_version 2` gives it (1 GPU: the sharding code path,
    # Accelerate's sharded checkpoint and the gathered final/; tests/test_fsdp.py runs 2 CPU processes)
    run = w / "runs" / "correct-fsdp2"
    fsdp = ("--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    flags = ["--epochs", 8, "--batch-size", 32, "--max-steps", STEPS, "--log-every", 10, "--checkpoint-every", 20]
    rows.append(
        Row(
            "correct/fsdp2",
            ALL_BUDGET_S["correct/fsdp2"],
            f"finetune_folder under --use_fsdp --fsdp_version 2 (block by block), 200 flower photos, {STEPS} steps",
            launch(ctx, "finetune_folder", args("finetune_folder", run.name, *flags), extra=fsdp,
                   through=(REPO / "tests" / "standins" / "fsdp_on_cpu.py",) if toy else ()),
            lambda r=run: read_sharded(r, toy),
        )
    )  # fmt: skip

    def tta(recipe: str, name: str, flags: str, recipe_args: str = "", toy_args: str = "") -> list:
        """time_to_accuracy.py ``flags`` on ``recipe``'s data, one GPU (single_gpu.yaml), its work dir and report
        named ``name``, ``recipe_args`` (in the rehearsal ``toy_args`` too, and airbench94 at toy size)."""
        recipe_args = f"--cache-dir {shlex.quote(str(w / 'cache'))}{recipe_args}{toy_args if toy else ''}"
        config, out = CONFIGS_DIR / "single_gpu.yaml", w / f"{name}.json"
        own = ["--recipe", recipe, "--dataset", data[recipe], *flags.split(), "--device", ctx.device]
        own += ["--accelerate-config", config, "--work-dir", w / name, "--out", out]
        return [ctx.py, *([ME, "--toy-airbench"] if toy else [TTA]), *map(str, own), "--recipe-args", recipe_args]

    cifar_seeds = ctx.cifar_seeds or DEFAULT_SEEDS["cifar_cnn_vs_airbench94"]
    rows.append(
        Row(
            "cifar_cnn_vs_airbench94",
            ALL_BUDGET_S["cifar_cnn_vs_airbench94"],
            f"cifar_cnn default (single_gpu.yaml, bf16) vs airbench94 = benchmarks/airbench94.py (blob "
            f"{blob_id(REPO / 'benchmarks' / 'airbench94.py')}: this repository's, from the paper arXiv 2404.00498, "
            "not Keller Jordan's file; fp16, uncompiled), same split and GPU, seeds "
            f"{cifar_seeds}, each side's seeds in one process",
            tta(
                "cifar_cnn",
                "tta-cifar",
                f"--target baseline --baseline-kind airbench94 --seeds {cifar_seeds} --recipe-seeds-in-one-process",
                toy_args=" --widths 8,16,16 --batch-size 16 --epochs 1",
            ),
            lambda o=w / "tta-cifar.json": read_tta_cifar(o, toy),
        )
    )
    rows.append(
        Row(
            "mnist_convnet_to_99.3",
            ALL_BUDGET_S["mnist_convnet_to_99.3"],
            "time_to_accuracy.py, mnist_convnet default (single_gpu.yaml, bf16), evaluating every 100 steps, seeds "
            f"{DEFAULT_SEEDS['mnist_convnet_to_99.3']} in one process",
            tta(
                "mnist_convnet",
                "tta-mnist",
                f"--target 0.993 --baseline off --seeds {DEFAULT_SEEDS['mnist_convnet_to_99.3']} "
                f"--recipe-seeds-in-one-process --eval-every-steps {8 if toy else 100}",
                toy_args=" --width 8 --hidden 32 --batch-size 32 --epochs 1",
            ),
            lambda o=w / "tta-mnist.json": read_tta_mnist(o, toy),
        )
    )
    sizes = {"mnist_convnet": (30, 5) if toy else (200, 25), "cifar_cnn": (24, 4) if toy else (40, 8)}
    for recipe, (n, every) in sizes.items():
        for lever, on in (("host", "false"), ("device", "true")):
            name = f"throughput/{recipe}/{lever}"
            run = w / "runs" / name.replace("/", "-")
            flags = ["--epochs", 1, "--max-steps", n, "--log-every", every, "--data-on-device", on]
            rows.append(
                Row(
                    name,
                    ALL_BUDGET_S[name],
                    f"{recipe} bf16, --data-on-device {on}, {n} steps, windows of {every}",
                    launch(ctx, recipe, args(recipe, run.name, *flags)),
                    lambda r=run: read_rate(r),
                )
            )
    for recipe in ("mnist_convnet", "cifar_cnn"):
        run = w / "runs" / f"profile-{recipe}"
        flags = ["--epochs", 1, "--max-steps", 12, "--log-every", 10, "--profile", 5]
        rows.append(
            Row(
                f"profile/{recipe}",
                ALL_BUDGET_S[f"profile/{recipe}"],
                f"{recipe} bf16 --profile 5 (steps 3-7)",
                launch(ctx, recipe, args(recipe, run.name, *flags)),
                lambda r=run: read_profile(r),
            )
        )
    # ab/*: cifar_cnn alone (seed --seed), each its own launch, with one suspected one-time cost of its first epoch
    # taken away: TensorBoard's writer (--report-to none), cuDNN's kernel search (--cudnn-benchmark false). Each is
    # read beside the cifar row's first seed (the same recipe as is, in a fresh process, on the same timer).
    for variant, extra in (("report-to-none", " --report-to none"), ("cudnn-off", " --cudnn-benchmark false")):
        rows.append(
            Row(
                f"ab/cifar_cnn/{variant}",
                ALL_BUDGET_S[f"ab/cifar_cnn/{variant}"],
                f"cifar_cnn default{extra or ' (as is)'}, alone (time_to_accuracy.py --baseline off), seed {s}",
                tta("cifar_cnn", f"ab-{variant}", f"--target 0.5 --baseline off --seeds {s}", extra,
                    toy_args=" --widths 8,16,16 --batch-size 16 --epochs 1"),
                lambda o=w / f"ab-{variant}.json", c=w / "tta-cifar.json": read_alone(o, c),
                reads="cifar_cnn_vs_airbench94",
            )
        )  # fmt: skip
    # photos/*: 170 training photos (gpu-data's 200 flowers, 15% held out): batches of 32 (5 steps an epoch), 16
    # epochs, images/s over windows of 20 steps spanning epochs (the median of those after the first), each side's
    # training workers kept across epochs; the recipe evaluates once, at the end (outside its windows)
    epochs, window = (2, 4) if toy else (16, 20)
    photo_args = ["--epochs", epochs, "--batch-size", 16 if toy else 32, "--workers", 0 if toy else 8]
    reference_args = [*photo_args, "--persistent-workers", "--window", window]
    decode, reference = w / "photos-decode.json", w / "photos-reference.json"
    rows.append(
        Row(
            "photos/decode",
            ALL_BUDGET_S["photos/decode"],
            "photo_baseline.py --decode-only: the reference's training loader alone (PIL decode, RandomResizedCrop, "
            "flip, ToTensor, Normalize in the DataLoader workers), no model: the CPUs' ceiling in images/s",
            [ctx.py, REPO / "benchmarks" / "photo_baseline.py", "--data", data["finetune_folder"], "--crop",
             32 if toy else 224, *reference_args, "--seed", s, "--decode-only", "--out", decode],
            lambda o=decode: read_photo_decode(o),
        )
    )  # fmt: skip
    rows.append(
        Row(
            "photos/reference",
            ALL_BUDGET_S["photos/reference"],
            "benchmarks/photo_baseline.py (torchvision's reference train.py, written fresh): "
            + ("resnet18 at 32 px" if toy else "resnet50 at 224 px")
            + ", bf16, channels_last, the flower photos",
            [ctx.py, REPO / "benchmarks" / "photo_baseline.py", "--data", data["finetune_folder"], "--model",
             "resnet18" if toy else "resnet50", "--crop", 32 if toy else 224, *reference_args, "--device", ctx.device,
             "--bf16", "--channels-last", "--seed", s, "--out", reference],
            lambda o=reference: read_photo_reference(o),
            reads="photos/decode",  # one chain with the recipe's row, which reads both
        )
    )  # fmt: skip
    run = w / "runs" / "photos-recipe"
    flags = ["--model", "resnet18" if toy else "resnet50", "--image-size", 32 if toy else 224, "--start-image-size"]
    flags += [0, *photo_args, "--log-every", window, "--eval-every", epochs, "--channels-last", "true"]
    rows.append(
        Row(
            "photos/recipe",
            ALL_BUDGET_S["photos/recipe"],
            "finetune_folder the same way (single_gpu.yaml: bf16): images/s and data wait beside the reference's",
            launch(ctx, "finetune_folder", [*args("finetune_folder", run.name), *flags]),
            lambda r=run, o=reference, d=decode: read_photo_recipe(r, o, toy, d),
            reads="photos/reference",
        )
    )
    order = [next(i for i, first in enumerate(PRIORITY) if row.name.startswith(first)) for row in rows]
    return [row for _, row in sorted(zip(order, rows), key=lambda pair: pair[0])]  # stable: a group keeps its order


# --- running them ---------------------------------------------------------------------------------------------------


def tail(log: Path, n: int = 15) -> list[str]:
    """The last ``n`` lines of a row's log, less the launcher's own traceback after a worker's (it only says that
    the worker failed)."""
    lines = [x.rstrip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    starts = [i for i, x in enumerate(lines) if x.startswith("Traceback (most recent call last)")]
    if len(starts) > 1 and lines[-1].startswith("subprocess.CalledProcessError"):
        lines = lines[: starts[-1]]
    return lines[-n:] or ["(no output)"]


def error_line(log: Path) -> str:
    """The line that names a failed row's error: the last exception line of its log, else its last line."""
    lines = tail(log, 200)
    found = [x for x in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", x)]
    return (found or lines)[-1][:300]


def rehearsal_allowance(budget_s: float) -> float:
    """A row's seconds in the rehearsal: its GPU budget scaled to the rehearsal machine (``REHEARSAL_FACTOR``)."""
    return max(budget_s * REHEARSAL_FACTOR, REHEARSAL_MIN_S)


def judge_rehearsal_time(status: str, result: str, wall_s: float, budget_s: float) -> tuple[str, str]:
    """A rehearsal row's (status, result) with its time judged: a row that ran to its end past its allowance fails,
    whatever it measured; every row's result says its seconds against the allowance."""
    allowed = rehearsal_allowance(budget_s)
    said = f"{wall_s:.0f} s of the rehearsal's {allowed:.0f} s (GPU budget {budget_s} s x {REHEARSAL_FACTOR:g}"
    said += f", at least {REHEARSAL_MIN_S:.0f} s)"
    if wall_s > allowed and status in ("ok", "PASS", "MISS"):
        return "failed", f"ran past its time: {said}; {result}"
    return status, f"{result} [{said}]"


def run_row(row: Row, ctx: Ctx, env: dict, limit: float) -> dict:
    rec = row.record
    log = ctx.work / "logs" / f"{row.name.replace('/', '-')}.log"
    rec.update(limit_s=round(limit), log=str(log))
    code, wall = run_logged([str(c) for c in row.cmd], env, log, limit, cwd=ctx.work)
    rec.update(exit=code, wall_s=round(wall, 1))
    try:
        result, goal, passed, data = row.read()
        status = "ok" if passed is None else "PASS" if passed else "MISS"
        rec["data"] = data
    except Exception as err:  # noqa: BLE001 - whatever a row left behind, it is reported in its row
        result, goal, status = f"no result ({type(err).__name__}: {err})", "-", "failed"
    if code != 0:
        status = "timeout" if code == "timeout" else "failed"
        said = f"stopped after {limit:.0f} s" if code == "timeout" else f"exit {code}"
        result = f"{said}: {error_line(log)}" + ("" if result.startswith("no result") else f" ({result})")
    if ctx.toy:  # the rehearsal: within the row's GPU budget scaled to this machine
        status, result = judge_rehearsal_time(status, result, wall, row.budget_s)
        rec["allowance_s"] = round(rehearsal_allowance(row.budget_s))
    rec.update(result=result, goal=goal, status=status)
    if status in ("failed", "timeout", "MISS"):
        rec["tail"] = tail(log)
    return rec


def execute(rows: list[Row], ctx: Ctx, env: dict, stop_at: float, jobs: int, row_limit, save) -> None:
    """Each row in a subprocess. One at a time: a row may use the time earlier rows left, never the budgets of the
    rows after it (``row_limit`` None); or at most ``row_limit`` s each, --jobs N at a time in chains (a row with
    ``after`` or ``reads`` runs after that row, in its chain)."""
    lock, done = threading.Lock(), {}

    def one(row, reserved):
        if row.after and done.get(row.after) not in ("PASS", "ok", "MISS"):
            rec = {"status": "not run", "result": f"{row.after} did not run to its end", "goal": "-"}
        else:
            limit = min(row_limit or math.inf, stop_at - time.perf_counter() - reserved)
            if limit < min(10, row.budget_s / 2):
                rec = {"status": "not run", "result": "the deadline was reached first", "goal": "-"}
            else:
                print(f"{row.name} (up to {limit:.0f} s) ...", flush=True)
                rec = run_row(row, ctx, env, limit)
                print(f"  {row.name}: {rec['status']} ({rec['wall_s']:.0f} s) {rec['result'][:160]}", flush=True)
        with lock:
            row.record.update(rec)
            done[row.name] = rec["status"]
            save()

    if jobs <= 1:
        for i, row in enumerate(rows):
            one(row, 0 if row_limit else sum(r.budget_s for r in rows[i + 1 :]))
        return
    chains = []
    for row in rows:
        first = row.after or row.reads
        chain = next((c for c in chains if first in {r.name for r in c}), None)
        chain.append(row) if chain else chains.append([row])
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda c: [one(r, 0) for r in c], chains))


# --- the environment ------------------------------------------------------------------------------------------------


def child_env(work: Path) -> dict:
    """The rows' environment: offline, the repository on PYTHONPATH, no bytecode written, every cache and temporary
    folder under the work dir."""
    env = recipe_env(work, threads=None, cache_dir=work / "cache")
    for var, sub in CACHES.items():
        (work / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(work / sub)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def gpu_like_python(dest: Path) -> Path:
    """A Python environment at ``dest`` like the GPU machine's: this one's packages (symbolic links) less `datasets`
    and this project's own install, with an `accelerate` command. Returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(dest)
    packages = dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for folder in dict.fromkeys(Path(p) for p in site.getsitepackages()):
        for entry in folder.iterdir() if folder.is_dir() else ():
            name = entry.name
            left_out = name in LEFT_OUT or name.startswith(("datasets-", "accelerate_recipes-", "__editable__"))
            if not left_out and not (packages / name).exists():
                (packages / name).symlink_to(entry)
    cli = dest / "bin" / "accelerate"
    cli.write_text(f"#!{dest / 'bin' / 'python'}\nimport sys\nfrom accelerate.commands.accelerate_cli import main\n"
                   "sys.exit(main())\n")  # fmt: skip
    cli.chmod(0o755)
    return dest / "bin" / "python"


# --- the report -----------------------------------------------------------------------------------------------------


def ratios(rows: dict) -> list[dict]:
    """images/s with the data on the device / in host memory, for each recipe whose two rows were asked for."""
    out = []
    for recipe in ("mnist_convnet", "cifar_cnn"):
        if not {f"throughput/{recipe}/{k}" for k in ("device", "host")} <= set(rows):
            continue
        a, b = (rows[f"throughput/{recipe}/{k}"] for k in ("device", "host"))
        ra, rb = ((r.get("data") or {}).get("samples_per_s") if r.get("status") == "ok" else None for r in (a, b))
        out.append(
            {
                "name": f"throughput/{recipe}: device / host",
                "result": f"{ra / rb:.2f}x" if ra and rb else "n/a (a row did not run to its end)",
                "goal": "-",
                "status": "ok" if ra and rb else "-",
            }
        )
    return out


def markdown(report: dict) -> str:
    v, m = report["versions"], report["machine"]
    head = "rehearsal on CPU at toy size" if report["rehearsal"] else m["gpu"]
    lines = [
        f"# GPU report: {head}",
        "",
        f"{report['created']}; revision {report.get('revision', 'not recorded')}; torch {v['torch']} (CUDA "
        f"{v.get('cuda')}, cuDNN {v.get('cudnn')}), accelerate "
        f"{v['accelerate']}, torchvision {v['torchvision']}, python {v['python']}; seed {report['seed']}",
        "",
        machine_line(m),
        "",
        f"data: {report.get('data', 'not installed yet')}",
        "",
        f"deadline {report['deadline_s']:.0f} s, wall {report.get('wall_s', '-')} s; command: `{report['command']}`",
        "",
        "| row | what | result | goal | status | s (limit; GPU budget) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"] + report.get("ratios", []):
        took = f"{r['wall_s']:.0f} ({r.get('limit_s', '-')}; {r.get('budget_s', '-')})" if "wall_s" in r else "-"
        cells = [r["name"], r.get("what", ""), r.get("result", "not reached yet"), r.get("goal", "-"),
                 r.get("status", "pending"), took]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    failed = [r for r in report["rows"] if r.get("tail")]
    if failed:
        lines += ["", "## Rows that failed or missed: the end of their logs", ""]
        for r in failed:
            lines += [f"### {r['name']} ({r['status']})", "", f"`{r['command']}`", "", "```text", *r["tail"], "```", ""]
    return "\n".join(lines) + "\n"


def bundle(out: Path, work: Path) -> None:
    """logs.tar.gz: every row's log and what its runs wrote beside the weights; traces.tar.gz: the profiler's."""
    small = ("summary.json", "config.json", "metrics.jsonl", "model.json")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for p in sorted((work / "logs").glob("*.log")) + sorted(work.glob("*.json")):
            tar.add(p, arcname=str(p.relative_to(work)))
        for sub in ("runs", "tta-cifar", "tta-mnist"):
            for p in sorted((work / sub).rglob("*")) if (work / sub).is_dir() else []:
                if p.name in small or p.suffix == ".log":
                    tar.add(p, arcname=str(p.relative_to(work)))
    with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
        for p in sorted((work / "runs").glob("profile-*/profile/**/*.json")):
            tar.add(p, arcname=str(p.relative_to(work)))


# --- the command line -----------------------------------------------------------------------------------------------


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="the table (gpu_report.md), its JSON and the logs' archives go here")
    p.add_argument("--work-dir", type=Path, help="runs, caches, temporary files (default: <out>/work)")
    p.add_argument("--data", type=Path, default=REPO / CARRY, help="what gpu_data.py made (default gpu-data/)")
    p.add_argument("--rehearse", action="store_true", help="every row at toy size on this CPU, as on the GPU machine")
    p.add_argument("--dry-run", action="store_true", help="print every row's command and time budget, run nothing")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], help="row name prefixes, comma-separated")
    p.add_argument("--seed", type=int, default=1, help="every row's seed")
    p.add_argument(
        "--cifar-seeds",
        default="",
        help="the cifar_cnn_vs_airbench94 row's seeds, comma-separated (default: 1,2,3,4,5, each side's in one "
        "process)",
    )
    p.add_argument("--deadline-s", type=float, help=f"stop rows after this (default {DEADLINE_S}; rehearsal 1500)")
    p.add_argument("--jobs", type=int, help="rows at a time (default 1; rehearsal 2): timings want 1")
    p.add_argument("--row-limit-s", type=float, default=300, help="the rehearsal's time limit per row")
    args = p.parse_args(argv)
    if not args.dry_run and args.out is None:
        bad_input("--out DIR is needed: the table, its JSON and the logs go there (on the GPU machine: --out $OUT).")
    args.deadline_s = args.deadline_s or (1500 if args.rehearse else DEADLINE_S)
    args.jobs = args.jobs or (2 if args.rehearse else 1)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--toy-airbench"]:  # the rehearsal's time_to_accuracy.py: airbench94 at toy size
        # imported here only: importing them imports torch._dynamo, which makes its cache folder at once
        import airbench94
        import time_to_accuracy

        airbench94.HYP.update(TOY_AIRBENCH)
        stop_children_on_term()
        return time_to_accuracy.main(argv[1:])
    args, t0 = parse(argv), time.perf_counter()
    out = args.out.resolve() if args.out else Path(tempfile.gettempdir()) / "gpu-report"
    work = (args.work_dir or out / "work").resolve()
    if args.rehearse and not os.environ.get(INNER):  # again, inside an environment like the GPU machine's
        work.mkdir(parents=True, exist_ok=True)
        py = gpu_like_python(work / "gpu-env")
        env = {**child_env(work), INNER: "1"}
        inner = [str(py), str(ME), *argv, "--out", str(out), "--work-dir", str(work)]  # argparse: the last one wins
        return subprocess.call(inner, env=env, cwd=str(work))
    toy, device = args.rehearse, "cpu" if args.rehearse else "cuda"
    pack = work / "gpu-data-toy" if toy else args.data.resolve()
    ctx = Ctx(sys.executable, work, gpu_data.installed_paths(pack, work), args.seed, toy, device, args.cifar_seeds)
    rows = [r for r in plan(ctx) if (any(r.name.startswith(p) for p in args.only) if args.only else r.name in BUDGET_S)]
    if args.dry_run:
        total = sum(r.budget_s for r in rows)
        print(
            f"dry run: {len(rows)} rows, budgets {total} s + {SETUP_S} s for the data = {total + SETUP_S} s of the "
            f"{args.deadline_s:.0f} s deadline (the run's timeout_s: {RUN_TIMEOUT_S}); work dir {work}\n"
            f"device command (carry [{CARRY!r}], timeout_s {RUN_TIMEOUT_S}): "
            f"{REVISION_VAR}={shlex.quote(revision())} {DEVICE_COMMAND}"
        )
        for r in rows:
            print(f"[{r.name}] budget {r.budget_s} s, seed {args.seed}: {r.what}\n  {shlex.join(map(str, r.cmd))}")
        return 0
    if not toy:
        gpu_data.read_manifest(args.data)  # made here by gpu_data.py, carried: one paragraph naming it when missing
    if not toy and not torch.cuda.is_available():
        bad_input(
            f"benchmarks/gpu_report.py measures the GPU rows and needs a CUDA GPU, but torch {torch.__version__} sees "
            f"none here (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). `--rehearse --out DIR` "
            "runs every row at toy size on this CPU; `--dry-run` lists the commands."
        )
    stop_children_on_term()  # a stopped report leaves no recipe training
    for sub in ("logs", "runs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(work)
    os.environ.update({k: env[k] for k in CACHES})  # this process's own temporary files and caches too
    tempfile.tempdir = None
    load, stop_at = warn_if_busy(), t0 + args.deadline_s
    report = {
        **provenance("gpu_report", argv, device, load),
        "rehearsal": toy,
        "seed": args.seed,
        "deadline_s": args.deadline_s,
        "work_dir": str(work),
    }
    report["versions"].update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    for r in rows:
        r.record.update(name=r.name, what=r.what, budget_s=r.budget_s, command=shlex.join(map(str, r.cmd)))

    def save(final=False):
        report["rows"] = [r.record for r in rows]
        if final:
            report["ratios"] = ratios({r.name: r.record for r in rows})
            report["wall_s"] = round(time.perf_counter() - t0, 1)
            report["finished"] = datetime.now().isoformat(timespec="seconds")
        (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (out / "gpu_report.md").write_text(markdown(report))

    try:  # the data first: without it no row can run, and the table says why
        if toy:
            gpu_data.pack_toy(pack)
        installed = gpu_data.install(pack, work)
        assert {k: installed[k] for k in ctx.data} == ctx.data, "the data was installed elsewhere than planned"
        manifest = installed["manifest"]
        described = "; ".join(f"{k} {v['count']} images ({v['kind']})" for k, v in manifest["datasets"].items())
        report["data"] = f"{pack} from {manifest['from']}: {described}; {'; '.join(installed['notes'])}"
    except Exception as err:  # noqa: BLE001 - reported in the table, which is written whatever happens
        report["data"] = f"{pack} could not be installed: {type(err).__name__}: {err}"
        for r in rows:
            r.record.update(status="not run", result="the data could not be installed", goal="-")
        save(final=True)
        print(markdown(report))
        raise
    try:
        data = gpu_data.read_installed("mnist_convnet", ctx.data["mnist"], work / "cache", args.seed)
        gpu_data.predict_inputs(data, work / "predict-inputs")
    except Exception as err:  # noqa: BLE001 - only the predict row needs them: it fails and says so
        report["data"] += f"; the predict row's images could not be written ({type(err).__name__}: {err})"
    print(f"gpu report: {head_line(toy)}; {len(rows)} rows, out {out}, work {work}", flush=True)
    execute(rows, ctx, env, stop_at, args.jobs, args.row_limit_s if toy else None, save)
    save(final=True)
    bundle(out, work)
    print(markdown(report))
    return 0


def head_line(toy: bool) -> str:
    return "rehearsal on CPU, toy sizes" if toy else torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
