"""A photo-classification baseline trained the way torchvision's reference script does
(pytorch/vision references/classification/train.py), written fresh, for side-by-side comparison with the recipes.

    python benchmarks/photo_baseline.py --data ../shared/data/flowers --epochs 10 --out flowers-1proc.json
    torchrun --nproc_per_node 2 benchmarks/photo_baseline.py --data ../shared/data/flowers --epochs 10

Reproduced: ImageFolder-style loading (one PIL image per sample, RGB, in DataLoader workers); RandomResizedCrop(crop)
+ RandomHorizontalFlip for training, Resize(round(crop / 0.875)) + CenterCrop(crop) for evaluation (224 -> 256 in
the reference), ToTensor + Normalize (ImageNet mean/std); SGD momentum 0.9, weight decay 1e-4 on every parameter,
lr 0.1 x global batch / 64 unless --lr; the reference's per-epoch schedule (optional LinearLR warm-up from 0.01 x lr,
then CosineAnnealingLR to 0); cross-entropy with label smoothing; torchvision.models.get_model(name, num_classes=K)
from scratch; DistributedDataParallel (gloo) with DistributedSampler under torchrun. Left out: weight EMA,
mixup/cutmix, auto-augment policies, random erasing, AMP (fp32 only), channels_last, torch.compile, checkpoints,
no-decay for norm layers, repeated augmentation, GPUs, and the reference's padded evaluation (each rank evaluates
val[rank::world] here, so no image counts twice). Added for measuring: --persistent-workers keeps both loaders' workers
across epochs (the reference starts them anew every epoch), --window N reports images/s over windows of N training
steps (steady_images_per_s: the median of the windows after the first; evaluation time left out).

The split is the project's own: the folder read by common.data.folders.scan, its validation split if it has one, else
common.data.splits.hold_out(--val-fraction, --seed) as the recipes hold it out. wall_s: from the launch (torchrun's
process under torchrun, else this process) to the end of the last evaluation. train_s: the training loops of all
epochs, DataLoader worker start-up included, evaluation excluded. images_per_s: training images of all ranks
(DistributedSampler's padding included) / train_s.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil  # Accelerate's own dependency

T_IMPORT = time.time()  # before torch's import


def launch_start() -> tuple[float, str]:
    """When the user's command started: torchrun's process under torchrun (it starts the workers), else this one."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        started = psutil.Process(os.getppid() if torchrun else os.getpid()).create_time()
        return started, "torchrun start" if torchrun else "process start"
    except psutil.Error:
        return T_IMPORT, "script import"


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchvision  # noqa: E402
from machine import cpu_info  # noqa: E402  (benchmarks/, this script's folder)
from PIL import Image  # noqa: E402
from torchvision import transforms as T  # noqa: E402

from common.data.folders import scan  # noqa: E402
from common.data.splits import ImageSplit, hold_out  # noqa: E402
from common.errors import DataError  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Files(torch.utils.data.Dataset):
    """torchvision's ImageFolder item: open the file with PIL, convert to RGB, transform."""

    def __init__(self, paths, labels, transform):
        self.paths, self.labels, self.transform = paths, labels, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return self.transform(Image.open(f).convert("RGB")), self.labels[i]


def the_split(data: Path, val_fraction: float, seed: int):
    """(train files, train labels, val files, val labels, class names): exactly the recipes' split."""
    s = scan(data, str(data))
    train = s.splits["train"]
    paths = [str(train.base / f) for f in train.files]
    if "validation" in s.splits:
        val = s.splits["validation"]
        return paths, train.labels, [str(val.base / f) for f in val.files], val.labels, s.class_names
    n = len(paths)
    train_part, val_part = hold_out(
        ImageSplit(torch.zeros(n, 1, 1, 1, dtype=torch.uint8), torch.tensor(train.labels)), val_fraction, seed
    )
    pick = lambda index, xs: [xs[i] for i in index.tolist()]  # noqa: E731
    return (
        pick(train_part.index, paths),
        pick(train_part.index, train.labels),
        pick(val_part.index, paths),
        pick(val_part.index, train.labels),
        s.class_names,
    )


def bad(message: str):
    """Bad input: one paragraph on stderr, exit 2 (as the recipes and benchmarks do)."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path, help="an image folder (<class>/<image>, or train/ val/ ...)")
    p.add_argument("--model", default="resnet18", help="a torchvision.models name")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global, over all processes")
    p.add_argument("--lr", type=float, default=None, help="default 0.1 x batch / 64")
    p.add_argument("--warmup-epochs", type=int, default=0, help="linear warm-up from 0.01 x lr, per epoch")
    p.add_argument("--crop", type=int, default=112)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per process")
    p.add_argument("--seed", type=int, default=42, help="the hold-out, the shuffle and the weights, as in the recipes")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument(
        "--persistent-workers",
        action="store_true",
        help="keep the training loader's workers across epochs (the reference restarts them every epoch)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="also report images/s over windows of N training steps (spanning epochs, evaluation time left out): "
        "the median of the windows after the first, as the recipes' metrics.jsonl windows",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (each rank its LOCAL_RANK's GPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass (the loss in fp32)")
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format for model and batches")
    p.add_argument(
        "--decode-only",
        action="store_true",
        help="time the training loader alone for --epochs (no model): the CPUs' decode-and-augment ceiling, images/s",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    start, start_kind = launch_start()
    args = parse(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    main_rank = rank == 0
    if args.batch_size % world:
        bad(f"--batch-size {args.batch_size} (global) does not split evenly over {world} processes.")
    if not 0 <= args.warmup_epochs < args.epochs:
        bad(f"--warmup-epochs {args.warmup_epochs} must be at least 0 and below --epochs {args.epochs}.")
    if not args.data.is_dir():
        bad(f"--data {args.data} is not a folder.")
    try:  # every rank scans the folder: the same sorted files and the same seeded hold-out
        train_files, train_labels, val_files, val_labels, classes = the_split(args.data, args.val_fraction, args.seed)
    except DataError as err:
        bad(str(err))
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else 0.1 * args.batch_size / 64
    to_tensor = [T.ToTensor(), T.Normalize(MEAN, STD)]
    train_tf = T.Compose([T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), *to_tensor])
    eval_tf = T.Compose([T.Resize(round(args.crop / 0.875)), T.CenterCrop(args.crop), *to_tensor])
    train_ds = Files(train_files, train_labels, train_tf)
    val_ds = Files(val_files[rank::world], val_labels[rank::world], eval_tf)  # no padding: each image counted once
    sampler = torch.utils.data.DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    per_rank = args.batch_size // world
    train_loader = torch.utils.data.DataLoader(
        train_ds,
        per_rank,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=args.device == "cuda",
        persistent_workers=args.persistent_workers and args.workers > 0,
    )
    val_loader = torch.utils.data.DataLoader(
        val_ds, per_rank, num_workers=args.workers, persistent_workers=args.persistent_workers and args.workers > 0
    )
    print(
        f"rank {rank} of world size {world}: {len(sampler)} training images per epoch, {len(val_ds)} validation "
        f"images, {torch.get_num_threads()} threads",
        flush=True,
    )
    if main_rank:
        print(
            f"machine: {os.cpu_count()} CPUs, flags {' '.join(cpu_info()[1]) or '-'}, load average "
            f"{[round(x, 2) for x in os.getloadavg()]}; torch {torch.__version__}, torchvision "
            f"{torchvision.__version__}; {len(train_files)} train / {len(val_files)} val images, "
            f"{len(classes)} classes; {args.model}, batch {args.batch_size}, lr {lr:g}",
            flush=True,
        )

    if args.decode_only:  # the training loader alone: what this machine's CPUs decode and augment this way
        t0, seen = time.perf_counter(), 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            seen += sum(len(labels) for _, labels in train_loader)
        seconds = time.perf_counter() - t0
        if world > 1:  # every rank's images over the slowest rank's time
            t = torch.tensor([seen, seconds], dtype=torch.float64)
            dist.all_reduce(t[:1])
            dist.all_reduce(t[1:], op=dist.ReduceOp.MAX)
            seen, seconds = int(t[0]), float(t[1])
        result = {"decode_only": True, "images": seen, "seconds": round(seconds, 2), "images_per_s": seen / seconds}
        result.update(crop=args.crop, epochs=args.epochs, processes=world, workers=args.workers, data=str(args.data))
        return finish(result, args.out, main_rank, world)

    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.model, weights=None, num_classes=len(classes)).to(device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler
    scheduler = sched.CosineAnnealingLR(optimizer, T_max=args.epochs - args.warmup_epochs)
    if args.warmup_epochs > 0:
        warmup = sched.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs)
        scheduler = sched.SequentialLR(optimizer, [warmup, scheduler], milestones=[args.warmup_epochs])

    def reduced(*values) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device if args.device == "cuda" else "cpu")
        if world > 1:
            dist.all_reduce(t)
        return t.tolist()

    train_s, eval_s, trained, curve, waited = 0.0, 0.0, 0, [], 0.0
    marks, mine = [], 0  # per training step: (training seconds, data-wait seconds, this rank's images) so far
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        ddp.train()
        sampler.set_epoch(epoch)
        epoch_lr = optimizer.param_groups[0]["lr"]
        loss_sum = seen = 0.0
        batches, asked = iter(train_loader), time.perf_counter()
        for images, labels in batches:
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            waited += time.perf_counter() - asked  # for the next batch (the step before synced at loss.item())
            with autocast():
                logits = ddp(images)
            loss = criterion(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(labels)
            seen += len(labels)
            asked = time.perf_counter()
            mine += len(labels)
            marks.append((train_s + asked - t0, waited, mine))
        scheduler.step()
        loss_sum, seen = reduced(loss_sum, seen)  # also the point where the ranks meet: t1 is the slowest rank's
        t1 = time.perf_counter()
        ddp.eval()
        correct = count = 0
        with torch.inference_mode():
            for images, labels in val_loader:
                images, labels = images.to(device, memory_format=memory_format), labels.to(device)
                with autocast():
                    correct += (model(images).argmax(1) == labels).sum().item()
                count += len(labels)
        correct, count = reduced(correct, count)
        t2 = time.perf_counter()
        train_s, eval_s, trained = train_s + t1 - t0, eval_s + t2 - t1, trained + int(seen)
        accuracy = correct / count
        curve.append(round(accuracy, 4))
        if main_rank:
            print(
                f"epoch {epoch + 1}/{args.epochs}: lr {epoch_lr:.4g}, train loss {loss_sum / seen:.4f} "
                f"({int(seen)} images, {t1 - t0:.1f} s, {seen / (t1 - t0):.1f} images/s), val accuracy "
                f"{accuracy:.4f} ({int(correct)}/{int(count)}, {t2 - t1:.1f} s), {time.time() - start:.1f} s "
                "since launch",
                flush=True,
            )
    wall_s = time.time() - start
    result = {
        "model": args.model,
        "epochs": args.epochs,
        "crop": args.crop,
        "batch": args.batch_size,
        "lr": lr,
        "seed": args.seed,
        "val_accuracy": accuracy,
        "val_count": int(count),
        "train_count": len(train_files),
        "val_accuracy_per_epoch": curve,
        "wall_s": round(wall_s, 2),
        "wall_from": start_kind,
        "train_s": round(train_s, 2),
        "eval_s": round(eval_s, 2),
        "images_per_s": round(trained / train_s, 2),
        "data_wait_share": round(waited / train_s, 3),  # this rank's time waiting for the next batch
        **steady(marks, args.window, world),
        "persistent_workers": args.persistent_workers,
        "bf16": args.bf16,
        "channels_last": args.channels_last,
        "processes": world,
        "threads": args.threads,
        "workers": args.workers,
        "label_smoothing": args.label_smoothing,
        "warmup_epochs": args.warmup_epochs,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpu_flags": cpu_info()[1],
        "data": str(args.data),
    }
    return finish(result, args.out, main_rank, world)


def steady(marks: list, window: int, world: int) -> dict:
    """images/s and data-wait share over windows of ``window`` steps (this rank's steps and waits; images of all
    ranks, as every rank takes the same number of steps): the median of the windows after the first."""
    if window <= 0:
        return {}
    ends = [marks[i] for i in range(window - 1, len(marks), window)]
    if len(ends) < 2:
        return {"window": window, "windows": [], "steady_images_per_s": None, "steady_data_wait_share": None}
    rates, waits = [], []
    for (t0, w0, n0), (t1, w1, n1) in zip(ends, ends[1:]):
        rates.append((n1 - n0) * world / (t1 - t0))
        waits.append((w1 - w0) / (t1 - t0))
    return {
        "window": window,
        "windows": [round(r, 2) for r in rates],
        "steady_images_per_s": round(statistics.median(rates), 2),
        "steady_data_wait_share": round(statistics.median(waits), 3),
    }


def finish(result: dict, out: Path | None, main_rank: bool, world: int) -> int:
    """The result printed (and written to ``out``) by the main rank; the process group ended."""
    if main_rank:
        print(json.dumps(result), flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result) + "\n")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
