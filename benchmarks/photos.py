"""The photo recipe beside a torchvision-style baseline on a folder of real photos, seed by seed.

    python benchmarks/photos.py --data ../shared/data/flowers --seeds 1 2 3

For each seed, both at --nproc processes on this machine with the same model, epochs, crop, global batch, threads
per process and validation split (the recipe's own hold-out, --val-fraction): benchmarks/photo_baseline.py under
torchrun (the way torchvision's reference script trains: per-sample PIL decode and augmentation in DataLoader
workers, fp32, SGD), then recipes/finetune_folder.py with its defaults under `accelerate launch` (the shipped
launcher config: bf16 where the CPU has native bf16). Wall time is the whole command, launch to exit, as a user
waits for it; peak memory is the largest process's resident set (os.wait4 over the process tree). Prints a
markdown table and writes benchmarks/results/photos-<host>.json. Run it on an idle machine: the two sides are
timed one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launching import launch_command, recipe_env  # noqa: E402

from benchmarks.harness import machine_line, provenance, warn_if_busy  # noqa: E402


def timed(cmd, env, log: Path) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in MB of the largest process of the tree) of ``cmd``."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - t0, usage.ru_maxrss / 1024


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="an image folder (recipes/finetune_folder.py's rules)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--val-fraction", type=float, default=0.15, help="held out of train, the same on both sides")
    p.add_argument("--baseline-workers", type=int, default=1, help="DataLoader workers per baseline process")
    p.add_argument("--recipe-args", default="", help="extra flags for the recipe (its defaults otherwise)")
    p.add_argument("--skip-baseline", action="store_true", help="time the recipe only")
    p.add_argument("--work-dir", type=Path, help="keep runs and logs here (default: a temporary folder)")
    p.add_argument(
        "--out-json", type=Path, default=REPO / "benchmarks" / "results" / f"photos-{socket.gethostname()}.json"
    )
    args = p.parse_args(argv)
    from launching import recipe_config

    cfg = recipe_config("finetune_folder", ["--dataset", str(args.data), *args.recipe_args.split()])
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="photos-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load = warn_if_busy()
    env = recipe_env(work, threads=1)
    rows = []
    for seed in args.seeds:
        common = [
            "--epochs",
            cfg.epochs,
            "--batch-size",
            cfg.batch_size,
            "--seed",
            seed,
            "--val-fraction",
            args.val_fraction,
        ]
        row = {"seed": seed}
        if not args.skip_baseline:
            out = work / f"baseline-{seed}.json"
            cmd = [
                shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun",
                f"--nproc_per_node={args.nproc}",
                str(REPO / "benchmarks" / "photo_baseline.py"),
                "--data",
                str(args.data),
                "--model",
                cfg.model,
                "--crop",
                cfg.image_size,
                "--workers",
                args.baseline_workers,
                "--threads",
                1,
                "--out",
                out,
                *common,
            ]
            code, wall, rss = timed([str(c) for c in cmd], env, work / f"baseline-{seed}.log")
            res = json.loads(out.read_text()) if code == 0 else {}
            row["baseline"] = {
                "exit": code,
                "wall_s": round(wall, 1),
                "peak_rss_mb": round(rss),
                "val_accuracy": res.get("val_accuracy"),
            }
        run = work / f"recipe-{seed}"
        shutil.rmtree(run, ignore_errors=True)
        cmd = launch_command(
            "finetune_folder",
            ["--dataset", args.data, *common, *args.recipe_args.split(), "--output-dir", run],
            nproc=args.nproc,
            precision=None,
        )
        code, wall, rss = timed(cmd, env, work / f"recipe-{seed}.log")
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        row["recipe"] = {
            "exit": code,
            "wall_s": round(wall, 1),
            "peak_rss_mb": round(rss),
            "val_accuracy": summary.get("final", {}).get("val/accuracy"),
            "precision": summary.get("precision"),
            "run_dir_mb": round(folder_mb(run), 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_report(args, cfg, rows, load, argv)
    return 0


def write_report(args, cfg, rows: list[dict], load, argv=None) -> None:
    """The markdown table (printed) and the JSON file of a finished set of rows."""
    report = {
        **provenance("photos", argv, "cpu", load),
        "data": str(args.data),
        "nproc": args.nproc,
        "settings": {
            "model": cfg.model,
            "epochs": cfg.epochs,
            "crop": cfg.image_size,
            "batch": cfg.batch_size,
            "val_fraction": args.val_fraction,
        },
        "rows": rows,
    }
    lines = [
        machine_line(report["machine"]),
        f"{args.data}: {cfg.model}, {cfg.epochs} epochs, crop {cfg.image_size}, global batch {cfg.batch_size}, "
        f"{args.nproc} processes x 1 thread, {args.val_fraction:.0%} held out",
        "| seed | baseline acc | baseline wall | recipe acc | recipe wall | wall ratio | peak RSS (MB) b / r |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, c = r.get("baseline", {}), r["recipe"]
        ratio = c["wall_s"] / b["wall_s"] if b.get("wall_s") else float("nan")
        lines.append(
            f"| {r['seed']} | {b.get('val_accuracy', float('nan')):.4f} | {b.get('wall_s', float('nan'))} s | "
            f"{c['val_accuracy'] or float('nan'):.4f} | {c['wall_s']} s | {ratio:.2f}x | "
            f"{b.get('peak_rss_mb', '-')} / {c['peak_rss_mb']} |"
        )
    print("\n".join(lines))
    report["table"] = lines
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out_json}")


if __name__ == "__main__":
    sys.exit(main())
