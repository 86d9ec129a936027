#!/usr/bin/env python
"""The data path of one recipe against the pipeline a first version typically has: how much faster than its own
training the recipe's loader feeds batches, and how much faster than a per-sample PIL/torchvision DataLoader.
On synthetic data of the recipe's shape; the shared timing and report are in harness.py.

Rows (samples/s, 1 process at the benchmark's threads):
  recipe         the recipe itself, end to end, as in throughput.py (what the loader has to keep up with)
  raw_torch      the recipe's step in a plain PyTorch loop over tensor-indexed batches
  loader         the recipe's data path alone: common.data.make_loader, the device copy, BatchTransform
  seed_loader    a per-sample pipeline over the same images: PNG bytes -> PIL -> torchvision's versions of the
                 recipe's augmentation -> ToTensor, Normalize, in a shuffling DataLoader (--seed-workers workers)
  seed_training  raw_torch's step fed by seed_loader

Ratios: loader / recipe training (>= 10), loader / per-sample loader (>= 20), raw step with tensor batches /
the same step fed per sample (reported). Loader rows time --repeats epochs after a warm-up epoch.

    python benchmarks/data_path.py --recipe mnist_convnet
    python benchmarks/data_path.py --recipe cifar_cnn --seed-workers 4
    python benchmarks/data_path.py --recipe mnist_convnet --tiny         # smoke test
"""

from __future__ import annotations

import os
import sys

import harness
import torch


def add_args(p):
    p.add_argument("--repeats", type=int, help="timed epochs of the loader rows (default 5, --tiny 2)")
    p.add_argument("--seed-workers", type=int, default=os.cpu_count() or 1,
                   help="DataLoader workers of the per-sample pipeline (default: os.cpu_count())")


def epochs(loader):
    """(epoch, index, images, labels) forever, as the recipe's loop sees its batches."""
    epoch = 0
    while True:
        for i, batch in enumerate(loader):
            yield epoch, i, *batch
        epoch += 1


def time_loader(bench, loader, consume) -> dict:
    """--repeats epochs of ``loader``, each batch handed to ``consume``, after one untimed epoch."""
    stream, n = epochs(loader), len(loader)
    seconds = harness.time_rounds({"": lambda: consume(*next(stream))}, n, bench.args.repeats, n, bench.device)[""]
    return harness.summarize(harness.rate(seconds, n * bench.cfg.batch_size), source="timed in the benchmark",
                             processes=1, threads=torch.get_num_threads(), batches_per_epoch=n)


def loader_row(bench) -> dict:
    from common.augment import batch_generator
    from common.data import ImageSplit, make_loader

    cfg, device, pin = bench.cfg, bench.device, bench.device.type == "cuda"

    def consume(epoch, i, images, labels):
        x = bench.transform.train(images.to(device, non_blocking=pin), batch_generator(cfg.seed, epoch, i, 0))
        labels.to(device, non_blocking=pin)
        x.sum().item()  # waits until the batch is really made (a device sync on a GPU)

    return time_loader(bench, make_loader(ImageSplit(bench.images, bench.labels), cfg.batch_size, train=True,
                                          pin=pin), consume)


def per_sample_loader(bench):
    """The same PNGs the recipe decoded, decoded per sample with PIL, torchvision's versions of the recipe's
    augmentation, a shuffling DataLoader with --seed-workers workers."""
    from torchvision import transforms as T

    cfg, t, workers = bench.cfg, bench.transform, bench.args.seed_workers
    augment = [T.RandomCrop(bench.shape[1:], padding=t.translate, padding_mode="reflect")] if t.translate else []
    augment += [T.RandomHorizontalFlip()] if t.flip else []
    tf = T.Compose([*augment, T.ToTensor(), T.Normalize(t.mean, t.std)])
    return torch.utils.data.DataLoader(harness.PerSampleImages(bench.pngs, bench.labels.tolist(), tf),
                                       batch_size=cfg.batch_size, shuffle=True, drop_last=True, num_workers=workers,
                                       persistent_workers=workers > 0, pin_memory=bench.device.type == "cuda")


def seed_rows(bench) -> dict:
    device, pin = bench.device, bench.device.type == "cuda"
    loader, workers = per_sample_loader(bench), {"loader_workers": bench.args.seed_workers}

    def consume(epoch, i, images, labels):
        images.to(device, non_blocking=pin).sum().item()
        labels.to(device, non_blocking=pin)

    alone = time_loader(bench, loader, consume)
    training = bench.raw_row(torch.get_num_threads(), stream_of=lambda: epochs(loader), transform=False)
    return {"seed_loader": {**alone, **workers}, "seed_training": {**training, **workers}}


def measure(bench) -> dict:
    threads = torch.get_num_threads()
    bench.measure("recipe", lambda: bench.recipe_row("recipe", 1, threads))
    bench.measure("raw_torch", lambda: bench.raw_row(threads))
    bench.measure("loader", lambda: loader_row(bench))
    bench.measure("seed rows", lambda: seed_rows(bench))
    return {
        "loader_vs_recipe": ("loader / recipe training", bench.ratio("loader", "recipe"), ">=", 10.0),
        "loader_vs_seed_loader": ("loader / per-sample loader", bench.ratio("loader", "seed_loader"), ">=", 20.0),
        "raw_vs_seed_training": ("raw step: tensor batches / per-sample pipeline",
                                 bench.ratio("raw_torch", "seed_training"), None, None),
    }


def main(argv=None) -> int:
    return harness.main("data_path", __doc__, argv, measure, add_args)


if __name__ == "__main__":
    sys.exit(main())
