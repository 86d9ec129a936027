"""Every GPU figure of issue 30 in one command, well inside 8 minutes on one H100: a markdown table with the GPU, the
versions and each row's seed, and benchmarks/results/gpu_report-<host>.json. Needs CUDA; --dry-run lists the commands.

    python benchmarks/gpu_report.py                         # data from ../shared/data: mnist/, cifar10/, flowers/
    python benchmarks/gpu_report.py --only hot_path,photo   # some rows (name prefixes)
    python benchmarks/gpu_report.py --dry-run               # every command and its time budget, on any machine

Each row is one subprocess with its own time limit, and the whole stops at --deadline-s; a row that fails, times out
or is not reached is reported in the table. Rows (single_gpu.yaml, bf16, unless said):
- mnist_convnet: time_to_accuracy.py, evaluating every 100 steps: wall and first step to 99.3% (goal < 3 s).
- cifar_cnn_vs_airbench94: time_to_accuracy.py --target baseline --baseline-kind airbench94 on one GPU and split, in
  fp16 (airbench94.py's; the recipe through an fp16 copy of single_gpu.yaml): each side's 10-epoch accuracy and time,
  cifar_cnn's time to airbench's accuracy (goal: within 1.5x).
- photo/recipe vs photo/baseline: finetune_folder.py at 224 px vs photo_baseline.py (fp32), same model, epochs,
  batch, split and workers: images/s (goal >= 1.0x), the baseline with --device cuda.
- hot_path/<recipe>: the recipe's main() in a process launched as recipes are, with set_sync_debug_mode("error")
  during each step between log steps (tests/test_hot_path.py's rule): no synchronising call over >= 50 steps.
- throughput/<recipe>/{host,device,device+compile}: samples/s (median of the metrics.jsonl windows after the first)
  with the data in host memory, on the device (--data-on-device), and on it under `accelerate launch --dynamo_backend
  inductor` (cold inductor cache; compile time apart: the first window less a steady one of as many steps).
"""

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from harness import REPO, bad_input, machine_line, provenance, save, warn_if_busy  # first: the repo on sys.path

from common.tools.launching import (
    CONFIGS_DIR,
    import_recipe,
    launch_command,
    read_run,
    recipe_config,
    recipe_env,
    stop_children_on_term,
)

FOLDERS = ("mnist", "fashion_mnist", "cifar10", "flowers")
TTA, BASELINE = REPO / "benchmarks" / "time_to_accuracy.py", REPO / "benchmarks" / "photo_baseline.py"


@dataclass
class Row:
    name: str
    seed: int
    budget_s: int
    cmd: list
    read: object  # () -> (result, goal, passed: True/False/None, data)
    env: dict = None
    skip: str = ""


def read_mnist(out: Path):
    r = json.loads(out.read_text())["seeds"][0]["recipe"]
    t = r["time_to_target_s"]
    reached = (
        f"to 99.3%: {t:.2f} s (step {r['step']}, {r['accuracy']:.4f})"
        if r["reached"]
        else f"99.3% not reached (best {r['best_accuracy']})"
    )
    return f"{reached}; wall {r['process_wall_s']:.1f} s", "< 3 s to 99.3%", bool(r["reached"] and t < 3), r


def read_cifar(out: Path):
    s = json.loads(out.read_text())["seeds"][0]
    rec, base = s["recipe"], s["baseline"]
    r_end, b_end, t = rec["curve"][-1], base["curve"][-1], rec["time_to_target_s"]
    text = (
        f"cifar_cnn {r_end['accuracy']:.4f} in {r_end['time_s']:.1f} s; airbench94 {b_end['accuracy']:.4f} "
        f"({b_end['accuracy_without_tta']:.4f} without TTA) in {b_end['time_s']:.1f} s; cifar_cnn to it: "
        + (f"{t:.1f} s = {t / b_end['time_s']:.2f}x airbench's" if rec["reached"] else "not reached")
    )
    return text, "<= 1.5x airbench's time", bool(rec["reached"] and t <= 1.5 * b_end["time_s"]), s


def windows(run_dir: Path) -> dict:
    """samples/s of a recipe run: the median of its metrics.jsonl windows after the first, and that first one."""
    run = read_run(run_dir)
    rows = [r for r in run["rows"] if "train/samples_per_sec" in r]
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has {len(rows)} throughput window(s): none after the first")
    rates = [r["train/samples_per_sec"] for r in rows[1:]]
    waits = [r["train/data_wait_fraction"] for r in rows[1:] if r.get("train/data_wait_fraction") is not None]
    med = statistics.median(rates)
    return {
        "samples_per_s": med,
        "spread": (max(rates) - min(rates)) / med,
        "windows": rates,
        "data_wait": statistics.median(waits) if waits else None,
        "first_step": rows[0]["step"],
        "first_window_s": rows[0]["time"] - run["summary"]["timing"]["train_start"],
        "batch": run["config"].get("batch_size"),
        "precision": run["summary"].get("precision"),
    }


def read_rate(run_dir: Path, compiled=False, goal="-"):
    w = windows(run_dir)
    text = f"{w['samples_per_s']:,.0f} images/s (spread {w['spread']:.0%}"
    text += f", data wait {w['data_wait']:.0%})" if w["data_wait"] is not None else ")"
    if compiled:  # the first window holds the compile and first_step steps at the steady rate
        w["compile_s"] = max(0.0, w["first_window_s"] - w["first_step"] * w["batch"] / w["samples_per_s"])
        text += f"; compile ~{w['compile_s']:.1f} s, outside the rate"
    return text, goal, None, w


def read_baseline(out: Path):
    r = json.loads(out.read_text())
    return f"{r['images_per_s']:,.0f} images/s ({r['epochs']} epochs, val {r['val_accuracy']:.4f})", "-", None, r


def read_sync(out: Path):
    r = json.loads(out.read_text())
    text = (
        f"synchronising call in step {r['step']} after {r['checked']} clean steps: {r['where']}"
        if r["sync"]
        else f"0 synchronising calls in {r['checked']} steps between log steps (exit {r['exit']})"
    )
    return text, "0 syncs, >= 50 steps", not r["sync"] and r["checked"] >= 50 and r["exit"] == 0, r


def plan(args, work: Path) -> list[Row]:
    data, cache, s = {k: args.data_root / k for k in FOLDERS}, work / "decoded-cache", args.seed
    py, rows = sys.executable, []
    recipe_args = f"--cache-dir {shlex.quote(str(cache))}"
    own = ["--seed", s, "--report-to", "none", "--cache-dir", cache]

    def launch(script, argv, precision="bf16", extra=()):
        return launch_command(script, argv, nproc=1, config="single_gpu.yaml", precision=precision, extra_launch=extra)

    out = work / "mnist_convnet.json"
    rows.append(
        Row(
            "mnist_convnet",
            s,
            90,
            [
                py,
                TTA,
                "--recipe",
                "mnist_convnet",
                "--dataset",
                data["mnist"],
                "--target",
                0.993,
                "--baseline",
                "off",
                "--seeds",
                s,
                "--device",
                "cuda",
                "--accelerate-config",
                CONFIGS_DIR / "single_gpu.yaml",
                "--eval-every-steps",
                100,
                "--goal-seconds",
                3,
                "--work-dir",
                work / "tta-mnist",
                "--recipe-args",
                recipe_args,
                "--out",
                out,
            ],
            lambda o=out: read_mnist(o),
        )
    )
    out = work / "cifar_vs_airbench.json"
    rows.append(
        Row(
            "cifar_cnn_vs_airbench94",
            s,
            150,
            [
                py,
                TTA,
                "--recipe",
                "cifar_cnn",
                "--dataset",
                data["cifar10"],
                "--target",
                "baseline",
                "--baseline-kind",
                "airbench94",
                "--seeds",
                s,
                "--device",
                "cuda",
                "--accelerate-config",
                work / "single_gpu_fp16.yaml",
                "--goal-ratio",
                0.667,
                "--work-dir",
                work / "tta-cifar",
                "--recipe-args",
                recipe_args,
                "--out",
                out,
            ],
            lambda o=out: read_cifar(o),
        )
    )

    cfg = recipe_config("finetune_folder", ["--dataset", data["flowers"], "--image-size", "224"])
    same = ["--epochs", 3, "--batch-size", cfg.batch_size, "--seed", s, "--val-fraction", 0.15]
    run = work / "photo-recipe"
    rows.append(
        Row(
            "photo/recipe",
            s,
            60,
            launch(
                "finetune_folder",
                [
                    "--dataset",
                    data["flowers"],
                    "--image-size",
                    224,
                    *same,
                    "--eval-every",
                    99,
                    "--report-to",
                    "none",
                    "--output-dir",
                    run,
                ],
            ),
            lambda r=run: read_rate(r),
        )
    )
    out, workers = work / "photo-baseline.json", max(0, min(8, (os.cpu_count() or 1) - 1))  # the recipe's default
    rows.append(
        Row(
            "photo/baseline",
            s,
            60,
            [
                py,
                BASELINE,
                "--data",
                data["flowers"],
                "--model",
                cfg.model,
                "--crop",
                224,
                *same,
                "--workers",
                workers,
                "--threads",
                1,
                "--device",
                "cuda",
                "--out",
                out,
            ],
            lambda o=out: read_baseline(o),
        )
    )

    checks = {
        "mnist_convnet": ("mnist", 1, 60),
        "fashion_mnist_mlp": ("fashion_mnist", 1, 60),
        "cifar_cnn": ("cifar10", 2, 60),
        "finetune_folder": ("flowers", 4, 70),
    }
    for recipe, (folder, epochs, steps) in checks.items():
        out = work / f"hot_path-{recipe}.json"
        argv = [
            "--dataset",
            data[folder],
            "--epochs",
            epochs,
            "--max-steps",
            steps,
            "--log-every",
            25,
            *own,
            "--output-dir",
            work / f"hot_path-{recipe}",
        ]
        rows.append(
            Row(
                f"hot_path/{recipe}",
                s,
                45,
                launch(Path(__file__), ["--sync-check", recipe, out, *argv]),
                lambda o=out: read_sync(o),
            )
        )

    levers = {
        "host": ([], ()),
        "device": (["--data-on-device"], ()),
        "device+compile": (["--data-on-device"], ("--dynamo_backend", "inductor")),
    }
    sizes = {"mnist_convnet": ("mnist", 200, 40, 75), "cifar_cnn": ("cifar10", 40, 5, 120)}
    for lever in levers:
        for recipe, (folder, steps, every, compile_budget) in sizes.items():
            flags, extra = levers[lever]
            run = work / f"throughput-{recipe}-{lever}"
            argv = [
                "--dataset",
                data[folder],
                "--epochs",
                1,
                "--max-steps",
                steps,
                "--log-every",
                every,
                *own,
                *flags,
                "--output-dir",
                run,
            ]
            compiled = bool(extra)
            rows.append(
                Row(
                    f"throughput/{recipe}/{lever}",
                    s,
                    compile_budget if compiled else 30,
                    launch(recipe, argv, extra=extra),
                    lambda r=run, c=compiled: read_rate(r, c),
                    {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{recipe}")} if compiled else None,
                )
            )
    return [r for r in rows if not args.only or any(r.name.startswith(p) for p in args.only)]


def run_group(cmd, env, log: Path, timeout: float):
    """(exit code or "timeout", wall s) of ``cmd`` in a session of its own: on a timeout (or when this script is
    stopped) the whole group is stopped, so no launcher's worker goes on using the GPU in the next row."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)  # leftovers of an exited run (compile workers) too
                    proc.wait(wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    return code, time.perf_counter() - t0


def last_error(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    pick = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else "no output")
    return pick[:200]


def run_row(row: Row, work: Path, env: dict, stop_at: float) -> dict:
    rec = {"name": row.name, "seed": row.seed, "budget_s": row.budget_s, "command": shlex.join(map(str, row.cmd))}
    left = stop_at - time.perf_counter()
    if row.skip or left < 15:
        return {**rec, "status": "not run", "result": row.skip or "the --deadline-s was reached first", "goal": "-"}
    log = work / "logs" / f"{row.name.replace('/', '-')}.log"
    print(f"{row.name} (up to {min(row.budget_s, left):.0f} s) ...", end=" ", flush=True)
    code, wall = run_group([str(c) for c in row.cmd], {**env, **(row.env or {})}, log, min(row.budget_s, left))
    rec.update(log=str(log), exit=code, wall_s=round(wall, 1))
    try:
        if code == "timeout":
            raise RuntimeError(f"stopped after {min(row.budget_s, left):.0f} s: {last_error(log)}")
        result, goal, passed, data = row.read()
        rec.update(result=result, goal=goal, data=data, status="ok" if passed is None else "PASS" if passed else "MISS")
    except Exception as err:  # reported in its row; the other rows still count
        rec.update(
            status="timeout" if code == "timeout" else "failed",
            goal="-",
            result=str(err) if code == "timeout" else f"exit {code}: {last_error(log)} ({type(err).__name__})",
        )
    print(f"{rec['status']} ({wall:.0f} s)", flush=True)
    return rec


def derived(rows: dict) -> list[dict]:
    """The ratios between rows: photo recipe / baseline, data on device / host, compiled / eager."""
    pairs = [("photo: recipe / baseline", "photo/recipe", "photo/baseline", ">= 1.0x")]
    for t in ("throughput/mnist_convnet/", "throughput/cifar_cnn/"):
        pairs += [
            (t + "device / host", t + "device", t + "host", "-"),
            (t + "compiled / eager (data on device)", t + "device+compile", t + "device", "-"),
        ]
    out = []
    for name, a, b, goal in [p for p in pairs if p[1] in rows or p[2] in rows]:
        ra, rb = ((rows.get(k, {}).get("data") or {}) for k in (a, b))
        ra, rb = (r.get("samples_per_s") or r.get("images_per_s") for r in (ra, rb))
        ratio = ra / rb if ra and rb else None
        out.append(
            {
                "name": name,
                "seed": rows.get(a, rows.get(b))["seed"],
                "goal": goal,
                "status": "-" if ratio is None else "ok" if goal == "-" else "PASS" if ratio >= 1.0 else "MISS",
                "result": f"{ratio:.2f}x"
                if ratio
                else f"n/a: {a} {rows.get(a, {}).get('status', 'not asked')}, "
                f"{b} {rows.get(b, {}).get('status', 'not asked')}",
            }
        )
    return out


def table(report: dict) -> list[str]:
    v, m = report["versions"], report["machine"]
    lines = [
        f"GPU report {report['created'][:10]}: {m['gpu']}; torch {v['torch']} (CUDA {v['cuda']}, cuDNN "
        f"{v['cudnn']}), accelerate {v['accelerate']}, torchvision {v['torchvision']}, python {v['python']}",
        machine_line(m),
        "",
        "| row | seed | result | goal | status | s (budget) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"] + report["ratios"]:
        took = f"{r['wall_s']:.0f} ({r['budget_s']})" if "wall_s" in r else f"- ({r.get('budget_s', '-')})"
        cells = [r["name"], r["seed"], r["result"], r["goal"], r["status"], took]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return lines


def sync_check(recipe: str, out: str, argv: list[str]) -> int:
    """The hot-path check inside the recipe's own process: its main(argv) with the CUDA sync debug mode at "error"
    during each optimizer step that must not wait for the GPU (not a log step, not the last, not an epoch's first),
    "default" elsewhere. Writes {checked, sync, step, where, exit} to ``out``."""
    import traceback

    from common.train.run import TrainingRun

    state, end_step, close = {"on": False, "checked": 0, "step": 1}, TrainingRun.end_step, TrainingRun._close

    def checked_end_step(self):
        end_step(self)  # under the mode set after the step before: a checked step's end is checked too
        state["checked"] += state["on"]
        state["step"] = nxt = self.global_step + 1
        state["on"] = bool(
            nxt % self.cfg.log_every and nxt < self.ckpt.total_steps and self.ckpt.mid_epoch()
        )  # this step was not the epoch's last
        torch.cuda.set_sync_debug_mode("error" if state["on"] else "default")

    def unchecked_close(self, err):  # the run's ending (summary.json after an error) is not the hot path
        torch.cuda.set_sync_debug_mode("default")
        close(self, err)

    TrainingRun.end_step, TrainingRun._close = checked_end_step, unchecked_close
    result = {"recipe": recipe, "argv": argv, "sync": False, "where": None}
    try:
        result["exit"] = import_recipe(recipe).main(argv)
    except RuntimeError as err:
        if "synchronizing" not in str(err):
            raise
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__][-4:]
        result.update(
            sync=True,
            exit=1,
            where=" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)),
        )
    result.update(checked=state["checked"], step=state["step"])
    Path(out).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--sync-check"]:  # the hot-path row's process (launched by this script)
        return sync_check(argv[1], argv[2], argv[3:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-root",
        type=Path,
        default=REPO.parent / "shared" / "data",
        help="the folder holding mnist/, cifar10/ and flowers/ (default: ../shared/data)",
    )
    p.add_argument("--seed", type=int, default=1, help="every row's seed")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], help="row name prefixes, comma-separated")
    p.add_argument("--deadline-s", type=float, default=450, help="stop starting or running rows after this")
    p.add_argument("--work-dir", type=Path, help="decoded data, runs and logs (default: a new temporary folder)")
    p.add_argument(
        "--out-json", type=Path, default=REPO / "benchmarks" / "results" / f"gpu_report-{socket.gethostname()}.json"
    )
    p.add_argument("--dry-run", action="store_true", help="print every command with its time budget and exit")
    args = p.parse_args(argv)
    root = args.data_root.resolve()
    missing = [f"{root / k}/" for k in FOLDERS if not (root / k).is_dir()]
    if missing:
        what = "the folder does not exist" if not root.is_dir() else "it lacks " + ", ".join(missing)
        bad_input(
            f"--data-root {root}: {what}. The report reads MNIST, CIFAR-10 and the flower photos from "
            f"{', '.join(f + '/' for f in FOLDERS)} under one folder, laid out as ../shared/data is (see its "
            "README.md); pass --data-root with the folder that holds them."
        )
    args.data_root = root
    t0 = time.perf_counter()
    work = args.work_dir or Path(tempfile.gettempdir()) / f"gpu_report-{os.getpid()}"
    if args.dry_run:
        rows = plan(args, work)
        print(
            f"dry run: {len(rows)} rows, one command each, budgets {sum(r.budget_s for r in rows)} s in all, the "
            f"whole stopped at {args.deadline_s:.0f} s; work dir {work}"
        )
        for r in rows:
            print(
                f"[{r.name}] budget {r.budget_s} s, seed {r.seed}{'; ' + r.skip if r.skip else ''}:\n  "
                f"{' '.join(f'{k}={v}' for k, v in (r.env or {}).items())}{' ' if r.env else ''}"
                f"{shlex.join(map(str, r.cmd))}"
            )
        return 0
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        bad_input(
            f"benchmarks/gpu_report.py measures the project's GPU figures and needs a CUDA GPU, but torch "
            f"{torch.__version__} sees none here (CUDA_VISIBLE_DEVICES={visible!r}). "
            "Run it on a machine with one; `python benchmarks/gpu_report.py --dry-run` lists every command it "
            "would run, with its time budget, on any machine."
        )
    stop_children_on_term()  # a stopped report leaves no recipe training
    load, stop_at = warn_if_busy(), t0 + args.deadline_s
    (work / "logs").mkdir(parents=True, exist_ok=True)
    fp16 = (CONFIGS_DIR / "single_gpu.yaml").read_text().replace("mixed_precision: bf16", "mixed_precision: fp16")
    (work / "single_gpu_fp16.yaml").write_text(fp16)  # airbench94.py's precision on a GPU, for cifar_cnn too
    env = recipe_env(work, threads=None, cache_dir=work / "decoded-cache")
    print(f"gpu report: {torch.cuda.get_device_name(0)}, work dir {work}", flush=True)
    rows = [run_row(r, work, env, stop_at) for r in plan(args, work)]
    report = {
        **provenance("gpu_report", argv, "cuda", load),
        "data_root": str(root),
        "work_dir": str(work),
        "seed": args.seed,
        "deadline_s": args.deadline_s,
        "rows": rows,
    }
    report["versions"].update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    report["ratios"] = derived({r["name"]: r for r in rows})
    report["wall_s"], report["finished"] = round(time.perf_counter() - t0, 1), datetime.now().isoformat("seconds")
    report["table"] = table(report)
    print("\n" + "\n".join(report["table"]) + "\n")
    save(report, args.out_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
