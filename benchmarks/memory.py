#!/usr/bin/env python
"""Resident memory per process of the decoded dataset: a memory-mapped cache shared by a node's processes
(``load_image_data``'s default) against one in-memory copy per process (the behaviour before it).

    python benchmarks/memory.py                                  # ../shared/data/mnist, 1 and 2 processes
    python benchmarks/memory.py --dataset /path/to/cifar10 --procs 1 2 4

The cache is decoded once before anything is measured. Each case then starts N fresh processes
(torch.multiprocessing, spawn), which at the same moment call ``load_image_data`` on that warm cache,
hold out 10% of train for validation, gather every training and validation batch once (what an epoch
reads), and wait until all N are done, so that each reads its memory while its peers are alive:

  rss    VmRSS: pages this process maps, shared ones counted in full in every process
  pss    Pss from /proc/self/smaps_rollup: shared pages divided among the processes that map them
         (the column whose sum is what the node really spends)
  peak   VmHWM: the largest RSS the process reached
  base   the same after imports (interpreter, torch, datasets), before loading; "+data" columns subtract it

  mmap   the images memory-mapped from the cache; the held-out split is an index (no copy)
  copy   load_image_data(mmap=False), then both splits materialised as the hold-out used to do:
         every process holds its own copy, and briefly two

Prints only what it measures, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def memory_kib() -> dict:
    """rss, peak (VmHWM) and, where the kernel has smaps_rollup, pss, in KiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[{"VmRSS": "rss", "VmHWM": "peak"}[key]] = int(value.split()[0])
    rollup = Path("/proc/self/smaps_rollup")
    if rollup.exists():
        for line in rollup.read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss"] = int(line.split()[1])
    return out


def worker(rank: int, mode: str, dataset: str, cache_dir: str, start, done, results):
    import torch

    torch.set_num_threads(1)
    import datasets  # noqa: F401  (imported here so that `base` holds the libraries, not just the data)
    from common.config import CommonConfig
    from common.data import ImageSplit, load_image_data, make_loader

    start.wait()  # every peer has imported: the libraries' shared pages are split as they will be later
    base = memory_kib()
    start.wait()  # every process loads at once, as the recipes do
    cfg = CommonConfig(dataset=dataset, cache_dir=cache_dir, val_fraction=0.1)
    data = load_image_data(cfg, "", False, print, mmap=(mode == "mmap"))
    if mode == "copy":  # the previous hold-out: both splits gathered into tensors of their own
        data.train, data.val = (ImageSplit(data.train.images, data.train.labels),
                                ImageSplit(data.val.images, data.val.labels))
    seen = 0
    for split in (data.train, data.val):
        for images, _ in make_loader(split, 1000, train=False):
            seen += images.shape[0]
    done.wait()  # measure while every peer still maps its data
    results.put({"rank": rank, "base": base, "images": seen, **memory_kib()})
    done.wait()


def run_case(mode: str, procs: int, dataset: str, cache_dir: str) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, done, results = ctx.Barrier(procs), ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, mode, dataset, cache_dir, start, done, results)) for r in range(procs)]
    for p in ps:
        p.start()
    rows = sorted((results.get(timeout=600) for _ in ps), key=lambda r: r["rank"])
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a {mode} worker exited with {p.exitcode}")
    return rows


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return (f"{socket.gethostname()}: {cpu}, {os.cpu_count()} CPUs, {mem / 2**20:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, load average {os.getloadavg()[0]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=str(REPO.parent / "shared" / "data" / "mnist"),
                        help="dataset directory (default: ../shared/data/mnist next to the repository)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    args = parser.parse_args()
    if not Path(args.dataset).expanduser().is_dir():
        raise SystemExit(f"{args.dataset} is not a directory: pass --dataset a local dataset (parquet or image folder)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from common.config import CommonConfig
    from common.data import load_image_data

    with tempfile.TemporaryDirectory(prefix="memory-bench-") as cache_dir:
        data = load_image_data(CommonConfig(dataset=args.dataset, cache_dir=cache_dir, val_fraction=0.1), "",
                               True, lambda *_: None)  # decode once, unmeasured
        n = len(data.train) + len(data.val)
        mib = n * data.train.source_images[0].numel() / 2**20
        del data
        print(f"machine: {machine()}")
        print(f"dataset: {args.dataset}: {n} train images of {mib:.1f} MiB uint8, 10% held out")
        print(f"{'mode':<5} {'procs':>5} {'rank':>4} {'rss MiB':>8} {'+data':>7} {'pss MiB':>8} {'+data':>7} "
              f"{'peak MiB':>9} {'+data':>7}")
        for mode in ("copy", "mmap"):
            for procs in args.procs:
                rows = run_case(mode, procs, args.dataset, cache_dir)
                for r in rows:
                    b = r["base"]
                    pss = (f"{r['pss'] / 1024:8.1f} {(r['pss'] - b['pss']) / 1024:7.1f}" if "pss" in r
                           else f"{'n/a':>8} {'n/a':>7}")
                    rss = f"{r['rss'] / 1024:8.1f} {(r['rss'] - b['rss']) / 1024:7.1f}"
                    peak = f"{r['peak'] / 1024:9.1f} {(r['peak'] - b['rss']) / 1024:7.1f}"
                    print(f"{mode:<5} {procs:>5} {r['rank']:>4} {rss} {pss} {peak}")
                if all("pss" in r for r in rows):
                    total = sum(r["pss"] - r["base"]["pss"] for r in rows) / 1024
                    print(f"{mode:<5} {procs:>5}  all processes: pss +data {total:.1f} MiB")

if __name__ == "__main__":
    main()
