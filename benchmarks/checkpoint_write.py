"""What a checkpoint costs the training loop: the time ``run.checkpoint()`` holds it (every rank's files written) and
the time until the checkpoint is complete on disk (fsync'd, renamed, marked COMPLETE, pruned), which the main process
finishes in a thread while training goes on (``common.train.checkpoint.save_checkpoint(..., background=True)``).

Each recipe's default model and optimizer (one update taken, so the optimizer holds its state), prepared by one
CPU process's Accelerator, saved --repeats times into a run folder on --dir's filesystem both ways, alternating:
``inline`` (everything before returning, as before) and ``background``. Prints medians and the share of the write
the loop no longer waits for; --out-json writes them with the machine.

    python benchmarks/checkpoint_write.py                      # cifar_cnn, mnist_convnet, fashion_mnist_mlp
    python benchmarks/checkpoint_write.py --dir /path/on/the/disk/runs/go/to --repeats 20
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from launching import import_recipe
from machine import machine_info

SHAPES = {"cifar_cnn": ((3, 32, 32), 10), "mnist_convnet": ((1, 28, 28), 10), "fashion_mnist_mlp": ((1, 28, 28), 10)}


def prepared(recipe: str):
    from accelerate import Accelerator

    module = import_recipe(recipe)
    cfg = module.Config()
    shape, classes = SHAPES[recipe]
    model = module.build_model(cfg, shape, classes)
    optimizer = module.build_optimizer(cfg, model)
    model(torch.randn(2, *shape)).sum().backward()
    optimizer.step()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return accelerator, size


def measure(recipe: str, root: Path, repeats: int) -> dict:
    from common.train import checkpoint as ckpt

    accelerator, size = prepared(recipe)
    held, complete = {"inline": [], "background": []}, {"inline": [], "background": []}
    for i in range(repeats):
        for way in ("inline", "background"):
            run = root / f"{recipe}-{way}"
            t0 = time.perf_counter()
            background = way == "background"
            _, completion = ckpt.save_checkpoint(accelerator, run, {"global_step": i}, 3, background=background)
            t1 = time.perf_counter()
            if completion is not None:
                completion.wait()
            t2 = time.perf_counter()
            held[way].append(t1 - t0)
            complete[way].append(t2 - t0)
    row = {"recipe": recipe, "weights_mb": round(size / 1e6, 2), "repeats": repeats}
    for way in held:
        row[f"{way}_held_s"] = round(statistics.median(held[way]), 4)
        row[f"{way}_complete_s"] = round(statistics.median(complete[way]), 4)
    row["held_ratio"] = round(row["background_held_s"] / row["inline_held_s"], 3)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="cifar_cnn,mnist_convnet,fashion_mnist_mlp")
    parser.add_argument("--dir", default="", help="a folder on the filesystem to measure ('' = a temporary folder)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out-json", default="")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="checkpoint-write-", dir=args.dir or None))
    try:
        rows = [measure(recipe, root, args.repeats) for recipe in args.recipes.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'recipe':<18} {'MB':>6} {'inline held':>12} {'bg held':>9} {'bg complete':>12} {'held ratio':>11}")
    for r in rows:
        print(
            f"{r['recipe']:<18} {r['weights_mb']:>6} {r['inline_held_s']:>11.4f}s {r['background_held_s']:>8.4f}s "
            f"{r['background_complete_s']:>11.4f}s {r['held_ratio']:>11}"
        )
    if args.out_json:
        doc = {"study": "checkpoint_write", "machine": machine_info("cpu"), "rows": rows}
        Path(args.out_json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
