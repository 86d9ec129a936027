"""Resident memory per process of the decoded dataset: a memory-mapped cache shared by a node's processes
(``load_image_data``'s default, mode `mmap`; the held-out split is an index) against one in-memory copy per process
(mode `copy`, the behaviour before it, made here: the cache read into the process's own memory and both splits gathered
from it, so every process holds its own copy, and briefly two). The cache is decoded once, unmeasured; each case then
starts N fresh processes (spawn) that at the same moment call ``load_image_data`` on it, hold out 10% of train, read
every batch of both splits once (an epoch), and measure while all N are alive. Columns, in MiB, each also as `+data`
(minus its value after imports, before loading): `rss` (VmRSS: shared pages counted in full in every process), `pss`
(Pss from /proc/self/smaps_rollup: shared pages divided among the processes that map them, so its sum is what the node
really spends), `peak` (VmHWM: the largest RSS the process reached).

    python benchmarks/memory.py                                  # ../shared/data/mnist, 1 and 2 processes
    python benchmarks/memory.py --dataset /path/to/cifar10 --procs 1 2 4
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from harness import REPO, bad_input  # first: puts the repository on sys.path
from machine import machine_info

from common.config import CommonConfig
from common.data.decoded import ImageSplit, load_image_data, make_loader


def memory_kib() -> dict:
    """rss, peak (VmHWM) and, where the kernel has smaps_rollup, pss, in KiB."""
    names = {"VmRSS:": "rss", "VmHWM:": "peak", "Pss:": "pss"}
    rollup = Path("/proc/self/smaps_rollup")
    text = Path("/proc/self/status").read_text() + (rollup.read_text() if rollup.exists() else "")
    return {names[f[0]]: int(f[1]) for f in map(str.split, text.splitlines()) if f and f[0] in names}


def worker(rank: int, mode: str, dataset: str, cache_dir: str, start, done, results):
    torch.set_num_threads(1)
    import datasets  # noqa: F401  (imported here so that the baseline holds the libraries, not just the data)

    start.wait()  # every peer has imported: the libraries' shared pages are split as they will be later
    base = memory_kib()
    start.wait()  # every process loads at once, as the recipes do
    data = load_image_data(CommonConfig(dataset=dataset, cache_dir=cache_dir, val_fraction=0.1), "", False)
    if mode == "copy":  # the whole cache in this process's own memory, then both splits gathered from it
        own = data.train.source_images.clone()
        data.train, data.val = (
            ImageSplit(own if s.index is None else own[s.index], s.labels) for s in (data.train, data.val)
        )
    seen = sum(images.shape[0] for split in (data.train, data.val) for images, _ in make_loader(split, 1000, False))
    done.wait()  # measure while every peer still maps its data
    results.put({"rank": rank, "base": base, "images": seen, **memory_kib()})
    done.wait()


def run_case(mode: str, procs: int, dataset: str, cache_dir: str) -> list[dict]:
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset",
        default=str(REPO.parent / "shared" / "data" / "mnist"),
        help="a local dataset folder (default: ../shared/data/mnist next to the repository)",
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    args = parser.parse_args(argv)
    if not Path(args.dataset).expanduser().is_dir() or min(args.procs) < 1:
        bad_input(
            f"--dataset {args.dataset} --procs {' '.join(map(str, args.procs))}: the dataset must be a local "
            "folder (parquet or images) and every process count at least 1."
        )
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as cache_dir:
        data = load_image_data(  # decode once, unmeasured
            CommonConfig(dataset=args.dataset, cache_dir=cache_dir, val_fraction=0.1), "", True
        )
        n = len(data.train) + len(data.val)
        mib = n * data.train.source_images[0].numel() / 2**20
        del data
        m, ram = machine_info("cpu"), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        print(
            f"machine: {m['hostname']}: {m['cpu']}, {m['cpu_count']} CPUs, {ram:.0f} GiB RAM, {m['platform']}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        print(f"dataset: {args.dataset}: {n} train images of {mib:.1f} MiB uint8, 10% held out")
        print(
            f"{'mode':<5} {'procs':>5} {'rank':>4} {'rss MiB':>8} {'+data':>7} {'pss MiB':>8} {'+data':>7} "
            f"{'peak MiB':>8} {'+data':>7}"
        )
        for mode in ("copy", "mmap"):
            for procs in args.procs:
                rows = run_case(mode, procs, args.dataset, cache_dir)
                for r in rows:
                    cols = [
                        (r[k] / 1024, (r[k] - r["base"][k if k != "peak" else "rss"]) / 1024) if k in r else None
                        for k in ("rss", "pss", "peak")
                    ]
                    print(
                        f"{mode:<5} {procs:>5} {r['rank']:>4} "
                        + " ".join(f"{c[0]:8.1f} {c[1]:7.1f}" if c else f"{'n/a':>8} {'n/a':>7}" for c in cols)
                    )
                if all("pss" in r for r in rows):
                    total = sum(r["pss"] - r["base"]["pss"] for r in rows) / 1024
                    print(f"{mode:<5} {procs:>5}  all processes: pss +data {total:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
