"""How long the photo recipe takes to reach its first training step as the folder grows, and its peak memory.

    python benchmarks/photo_startup.py --root /tmp/photo-scale --sizes 1000 10000 100000 1000000

For each size, a folder of that many distinct small JPEGs (10 classes, 32x32; written once under --root and
reused) is trained on by ``recipes/finetune_folder.py`` as a user runs it (one process, ``--image-size 32``, one
step): a first launch with an empty cache folder, then later launches reusing it (the folder is walked at every
launch and nothing about it is kept there: the two differ only by what the OS caches). The time is from the
command's start to the run's first optimizer step (``timing.first_step_at`` in its summary.json), so imports and
the scan are counted; peak memory is the largest resident set of the process tree (os.wait4). Prints a markdown
table and writes benchmarks/results/photo-startup-<host>.json.
"""

from __future__ import annotations

import argparse
import io
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

from benchmarks.harness import bad_input, machine_line, provenance, warn_if_busy  # noqa: E402

CLASSES = 10


def jpeg_bytes() -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def build(folder: Path, n: int) -> None:
    """``n`` distinct JPEGs (one image, each file with its own bytes after the end marker, which decoders ignore)
    in ``CLASSES`` class folders; kept and reused once complete (a marker file says so)."""
    done = folder / ".complete"
    if done.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    body = jpeg_bytes()
    for c in range(CLASSES):
        (folder / f"class_{c}").mkdir(parents=True)
    for i in range(n):
        with open(folder / f"class_{i % CLASSES}" / f"{i:07d}.jpg", "wb") as f:
            f.write(body + i.to_bytes(4, "little"))
    done.touch()


def launch(folder: Path, cache: Path, out: Path, log: Path) -> dict:
    """One launch to the first step; its seconds to the first step, wall seconds and peak RSS in MB."""
    cmd = [
        sys.executable,
        str(REPO / "recipes" / "finetune_folder.py"),
        "--dataset",
        str(folder),
        "--image-size",
        "32",
        "--batch-size",
        "32",
        "--max-steps",
        "1",
        "--val-fraction",
        "0",
        "--cache-dir",
        str(cache),
        "--output-dir",
        str(out),
        "--workers",
        "0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        bad_input(f"the recipe exited {code} on {folder}; its output is in {log}:\n{log.read_text()[-2000:]}")
    timing = json.loads((out / "summary.json").read_text())["timing"]
    # versions before timing.first_step_at recorded when the training loop began (train_start), a moment earlier
    mark = "first_step_at" if timing.get("first_step_at") else "train_start"
    return {
        "first_step_s": round(timing[mark] - t0, 2),
        "wall_s": round(wall, 2),
        "measured_to": mark,
        "peak_rss_mb": round(usage.ru_maxrss / 1024),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, required=True, help="where the folders are written (and reused)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    p.add_argument("--later", type=int, default=2, help="later launches per size (the median is reported)")
    p.add_argument(
        "--out-json", type=Path, default=REPO / "benchmarks" / "results" / f"photo-startup-{socket.gethostname()}.json"
    )
    args = p.parse_args(argv)
    load = warn_if_busy()
    rows = []
    for n in args.sizes:
        folder = args.root / f"photos-{n}"
        t0 = time.time()
        build(folder, n)
        if time.time() - t0 > 1:
            print(f"wrote {n:,} files in {time.time() - t0:.0f} s", file=sys.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            first = launch(folder, tmp / "cache", tmp / "run-first", tmp / "first.log")
            later = sorted(
                (launch(folder, tmp / "cache", tmp / f"run-{k}", tmp / f"later-{k}.log") for k in range(args.later)),
                key=lambda r: r["first_step_s"],
            )
        rows.append({"files": n, "first": first, "later": later[len(later) // 2], "later_all": later})
        print(
            f"{n:>9,} files: first launch {first['first_step_s']} s ({first['peak_rss_mb']} MB), later "
            f"{rows[-1]['later']['first_step_s']} s ({rows[-1]['later']['peak_rss_mb']} MB)",
            file=sys.stderr,
        )
    report = {**provenance("photo_startup", argv, "cpu", load), "rows": rows}
    print(machine_line(report["machine"]))
    print("\n| files | first launch: s to first step | peak MB | later launch: s to first step | peak MB |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['files']:,} | {r['first']['first_step_s']} | {r['first']['peak_rss_mb']} | "
            f"{r['later']['first_step_s']} | {r['later']['peak_rss_mb']} |"
        )
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
