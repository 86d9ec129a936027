"""What a recipe's loop costs the host, with the model shrunk to almost nothing: the proxies a developer can watch
without a GPU for what a GPU run pays per step (on a GPU the math of these models takes microseconds, and the step
takes what the host takes to launch it).

Two pairs, each side in a process of its own, one torch thread, the same batch size, data and number of steps:

- ``cifar_cnn`` (its main(): the whole recipe, Accelerate and the run's bookkeeping, ``--widths 4,4,4``) beside
  ``benchmarks/airbench94.py``'s training loop (the method it implements, in plain PyTorch, widths 4,4,4; its SGD
  ``foreach``, as torch runs it on a GPU);
- ``mnist_convnet`` (``--width 1 --hidden 2``) beside a plain loop: the same model and AdamW, data in memory,
  ``F.cross_entropy``, ``backward``, ``step``, a scheduler.

Measured per side: ``host ms/step``, the median time between the ends of consecutive optimizer steps
(``register_optimizer_step_post_hook``: the same clock on both sides; the median leaves out the epoch ends);
``ops/step``, the aten operations dispatched per optimizer step (a ``TorchDispatchMode`` counting over steps
11-20, in a run of its own); ``to first step``, from the call of the side's function (main() for a recipe: after the
interpreter and imports) to the end of the first step; ``after last step``, from the end of the last step to the
function's return (a recipe's final evaluation, checkpoint, final/ and summary). Rounds alternate the sides
(A B A B); medians over rounds, and each side's fastest round's host ms/step (``fastest``: on a VM whose speed
drifts between processes, the least disturbed run of each side). Ratios: recipe / its baseline.

    python benchmarks/host_overhead.py                 # both pairs, 3 rounds
    python benchmarks/host_overhead.py --pairs mnist --rounds 5 --out-json benchmarks/results/host-overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import machine_line, synthetic_images, write_parquet  # first: the repository on sys.path
from launching import import_recipe
from machine import load_average, machine_info

PAIRS = {"cifar": ("cifar_cnn", "airbench94"), "mnist": ("mnist_convnet", "plain_loop")}
SHAPES = {"cifar": (3, 32, 32), "mnist": (1, 28, 28)}
BATCH, IMAGES, EPOCHS = 16, 1152, 3  # 64 steps an epoch after the recipe's 10% hold-out (1,024 images): 192 steps
COUNT_FROM, COUNT_TO = 10, 20  # ops counted from the end of step 10 to the end of step 20
RECIPE_ARGS = {
    "cifar_cnn": ["--widths", "4,4,4"],
    "mnist_convnet": ["--width", "1", "--hidden", "2"],
}


class Steps:
    """The end time of every optimizer step in this process, and the ops dispatched between two of them."""

    def __init__(self, count: bool):
        self.ends: list[float] = []
        self.counter = None
        if count:
            from torch.utils._python_dispatch import TorchDispatchMode

            class Counter(TorchDispatchMode):
                on, ops = False, 0

                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if self.on:
                        self.ops += 1
                    return func(*args, **(kwargs or {}))

            self.counter = Counter()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self._ended)

    def _ended(self, optimizer, args, kwargs) -> None:
        self.ends.append(time.perf_counter())
        if self.counter is not None:
            self.counter.on = COUNT_FROM <= len(self.ends) < COUNT_TO

    def result(self, t0: float, t1: float) -> dict:
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:])]
        out = {
            "steps": len(self.ends),
            "host_ms_per_step": round(1000 * statistics.median(gaps), 3) if gaps else None,
            "to_first_step_s": round(self.ends[0] - t0, 3) if self.ends else None,
            "after_last_step_s": round(t1 - self.ends[-1], 3) if self.ends else None,
        }
        if self.counter is not None:
            out["ops_per_step"] = round(self.counter.ops / (COUNT_TO - COUNT_FROM), 1)
        return out


def run_recipe(recipe: str, data: Path, work: Path) -> None:
    module = import_recipe(recipe)
    argv = ["--dataset", str(data), "--output-dir", str(work / "run"), "--cache-dir", str(work / "cache")]
    argv += ["--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--report-to", "none", "--seed", "1"]
    code = module.main([*argv, *RECIPE_ARGS[recipe]])
    if code != 0:
        raise SystemExit(f"{recipe} exited {code}")


def run_airbench(data: Path, work: Path) -> None:
    import airbench94

    # foreach: the multi-tensor SGD a GPU runs by default (on a CPU torch would loop over the parameters instead,
    # about 60 more ops a step than the GPU's baseline)
    airbench94.HYP.update(widths=(4, 4, 4), batch_size=BATCH, epochs=EPOCHS, foreach=True)
    airbench94.cpu_bf16_support = lambda: ""  # fp32, as the recipe's main() runs without a launcher's precision
    train, val = airbench94.load(str(data), 1, 0.1)
    airbench94.train_once(
        train.images, train.labels, val.images, val.labels, seed=1, device=torch.device("cpu"), classes=10
    )


def run_plain_loop(data: Path, work: Path) -> None:
    """What a plain PyTorch script does with MNIST in memory: the recipe's model at the same size, AdamW, a cosine
    schedule, label smoothing, per-batch normalisation; the recipe's own split of the same files."""
    from common.data.decoded import load_image_data
    from common.models import LeanConvNet

    cfg = import_recipe("mnist_convnet").Config(dataset=str(data), cache_dir=str(work / "cache"), seed=1)
    split = load_image_data(cfg, cfg.dataset).train
    images, labels = split.images, split.labels
    torch.manual_seed(1)
    model = LeanConvNet((1, 28, 28), 10, width=1, hidden=2).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.7, 0.9), weight_decay=1e-4, fused=True)
    steps = len(images) // BATCH
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps * EPOCHS)
    mean, std = images.float().mean() / 255, images.float().std() / 255
    for epoch in range(EPOCHS):
        order = torch.randperm(len(images))
        for i in range(steps):
            idx = order[i * BATCH : (i + 1) * BATCH]
            x = ((images[idx].float() / 255 - mean) / std).contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(model(x), labels[idx], label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()


def worker(side: str, data: Path, count: bool) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        work = Path(tmp)
        steps = Steps(count)
        run = {
            "cifar_cnn": lambda: run_recipe("cifar_cnn", data, work),
            "mnist_convnet": lambda: run_recipe("mnist_convnet", data, work),
            "airbench94": lambda: run_airbench(data, work),
            "plain_loop": lambda: run_plain_loop(data, work),
        }[side]
        with steps.counter or contextlib.nullcontext():  # the ops counted in a run of their own
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
        return steps.result(t0, t1)


def side_process(side: str, data: Path, cache: Path, count: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_RECIPES_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, __file__, "--worker", side, "--data", str(data)] + (["--count"] if count else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{side}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="cifar,mnist", help="comma-separated: cifar, mnist")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-json", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data", default="", help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.data), args.count)))
        return 0
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown or args.rounds < 1:
        print(f"error: --pairs takes {', '.join(PAIRS)} (got {', '.join(unknown) or '-'}); --rounds >= 1.")
        return 2
    load_start = load_average()
    report = {"study": "host_overhead", "batch": BATCH, "epochs": EPOCHS, "rows": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="host-overhead-data-") as tmp:
        root = Path(tmp)
        for pair in pairs:
            data = root / pair
            write_parquet(data, *synthetic_images(SHAPES[pair], IMAGES, seed=1))
            cache = root / f"cache-{pair}"
            recipe, baseline = PAIRS[pair]
            for side in (recipe, baseline):  # the decoded cache made and the code paths warmed once, not timed
                side_process(side, data, cache, count=False)
            runs = {recipe: [], baseline: []}
            for _ in range(args.rounds):
                for side in (recipe, baseline):
                    runs[side].append(side_process(side, data, cache, count=False))
            for side in (recipe, baseline):
                counted = side_process(side, data, cache, count=True)
                rows = runs[side]
                report["rows"][side] = {
                    "steps": rows[0]["steps"],
                    "ops_per_step": counted["ops_per_step"],
                    **{
                        key: round(statistics.median(r[key] for r in rows), 3)
                        for key in ("host_ms_per_step", "to_first_step_s", "after_last_step_s")
                    },
                    "host_ms_per_step_fastest": min(r["host_ms_per_step"] for r in rows),
                    "rounds": rows,
                }
            a, b = report["rows"][recipe], report["rows"][baseline]
            report["ratios"][pair] = {
                key: round(a[key] / b[key], 3) if b[key] else None
                for key in (
                    "host_ms_per_step",
                    "host_ms_per_step_fastest",
                    "ops_per_step",
                    "to_first_step_s",
                    "after_last_step_s",
                )
            }
    machine = {**machine_info("cpu"), "load_average_start": load_start, "load_average_end": load_average()}
    report["machine"] = machine
    print(machine_line(machine))
    print(
        f"{'side':<15} {'steps':>5} {'host ms/step':>12} {'fastest':>8} {'ops/step':>9} {'to first step':>14} "
        f"{'after last':>11}"
    )
    for side, r in report["rows"].items():
        print(
            f"{side:<15} {r['steps']:>5} {r['host_ms_per_step']:>12.3f} {r['host_ms_per_step_fastest']:>8.3f} "
            f"{r['ops_per_step']:>9} {r['to_first_step_s']:>13.3f}s {r['after_last_step_s']:>10.3f}s"
        )
    for pair, ratios in report["ratios"].items():
        recipe, baseline = PAIRS[pair]
        print(f"{recipe} / {baseline}: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
