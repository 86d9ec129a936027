"""The data path of one recipe against the pipeline a first version typically has, on synthetic data of its
shape. Rows (samples/s, 1 process): `recipe` and `raw_torch` as in throughput.py; `loader`, the recipe's data path
alone (common.data.decoded.make_loader, the device copy, BatchTransform); `seed_loader`, the same PNGs per sample (PIL,
torchvision's versions of the recipe's augmentation, a shuffling DataLoader with --seed-workers workers); and
`seed_training`, raw_torch's step fed by seed_loader. The loader rows time --repeats epochs after a warm-up epoch.
Ratios (targets in benchmarks/README.md): loader / recipe training, loader / per-sample loader, raw step with
tensor batches / the same step fed per sample.

    python benchmarks/data_path.py --recipe mnist_convnet
    python benchmarks/data_path.py --recipe cifar_cnn --seed-workers 4
"""

import os
import sys

import harness
import torch
from torchvision import transforms as T

from common.data.augment import batch_generator
from common.data.decoded import ImageSplit, make_loader


def add_args(p):
    p.add_argument("--repeats", type=int, help="timed epochs of the loader rows (default 5, --tiny 2)")
    p.add_argument(
        "--seed-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="DataLoader workers of the per-sample pipeline (default: os.cpu_count())",
    )


def epochs(loader):
    """(epoch, index, images, labels) forever, as the recipe's loop sees its batches."""
    epoch = 0
    while True:
        for i, batch in enumerate(loader):
            yield epoch, i, *batch
        epoch += 1


def time_loader(bench, loader, augment: bool) -> dict:
    """--repeats epochs of ``loader`` after one untimed epoch: each batch copied to the device (with ``augment``,
    through the recipe's BatchTransform too) and waited for."""
    stream, n, device, pin = epochs(loader), len(loader), bench.device, bench.device.type == "cuda"

    def consume():
        epoch, i, images, labels = next(stream)
        x = images.to(device, non_blocking=pin)
        if augment:
            x = bench.transform.train(x, batch_generator(bench.cfg.seed, epoch, i, 0))
        labels.to(device, non_blocking=pin)
        x.sum().item()  # waits until the batch is really made (a device sync on a GPU)

    seconds = harness.time_rounds({"": consume}, n, bench.args.repeats, n, device)[""]
    return harness.timed_row(seconds, n * bench.cfg.batch_size, batches_per_epoch=n)


def seed_rows(bench) -> dict:
    """The PNGs the recipe decoded, decoded per sample with PIL, torchvision's versions of the recipe's
    augmentation, a shuffling DataLoader; alone and feeding raw_torch's step."""
    t, workers = bench.transform, bench.args.seed_workers
    augment = [T.RandomCrop(bench.shape[1:], padding=t.translate, padding_mode="reflect")] if t.translate else []
    augment += [T.RandomHorizontalFlip()] if t.flip else []
    tf = T.Compose([*augment, T.ToTensor(), T.Normalize(t.mean, t.std)])
    loader = torch.utils.data.DataLoader(
        harness.PerSampleImages(bench.pngs, bench.labels.tolist(), tf),
        batch_size=bench.cfg.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=bench.device.type == "cuda",
    )
    alone = {**time_loader(bench, loader, augment=False), "loader_workers": workers}
    training = bench.raw_row(torch.get_num_threads(), stream_of=lambda: epochs(loader), transform=False)
    return {"seed_loader": alone, "seed_training": {**training, "loader_workers": workers}}


def measure(bench) -> dict:
    threads = torch.get_num_threads()
    bench.measure("recipe", lambda: bench.recipe_row("recipe", 1, threads))
    bench.measure("raw_torch", lambda: bench.raw_row(threads))
    bench.measure(
        "loader",
        lambda: time_loader(
            bench,
            make_loader(
                ImageSplit(bench.images, bench.labels),
                bench.cfg.batch_size,
                train=True,
                pin=bench.device.type == "cuda",
            ),
            augment=True,
        ),
    )
    bench.measure("seed rows", lambda: seed_rows(bench))
    return {
        "loader_vs_recipe": ("loader / recipe training", bench.ratio("loader", "recipe"), ">=", 10.0),
        "loader_vs_seed_loader": ("loader / per-sample loader", bench.ratio("loader", "seed_loader"), ">=", 20.0),
        "raw_vs_seed_training": (
            "raw step: tensor batches / per-sample pipeline",
            bench.ratio("raw_torch", "seed_training"),
            None,
            None,
        ),
    }


def main(argv=None) -> int:
    return harness.main("data_path", __doc__, argv, measure, add_args)


if __name__ == "__main__":
    sys.exit(main())
