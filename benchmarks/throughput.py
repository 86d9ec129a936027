#!/usr/bin/env python
"""Training-throughput benchmark for one recipe: where do the samples/s go?

Measures, in one run on one machine, on synthetic data of the recipe's shape:

  pure_compute        the model, optimizer and batch size over ONE pre-built batch (the compute bound)
  recipe              the recipe's training path: make_loader + BatchTransform inside the Accelerator
  raw_torch           the same model and data path without Accelerate (plain PyTorch)
  recipe_bf16         the recipe path with the forward under bf16 autocast (what mixed_precision=bf16 does)
  loader              the prepared loader alone, touching every batch
  seed_training       a seed-style pipeline: per-sample Dataset, PIL decode, torchvision transforms,
                      DataLoader(num_workers=cpu_count), same model and training step
  seed_loader         that DataLoader alone
  *_1proc_1thread     recipe and raw PyTorch in 1 process with 1 thread
  *_2proc_1thread     recipe and raw DDP (gloo on CPU, nccl on GPUs) in 2 processes with 1 thread each

and prints each ratio against the project's targets (PASS/MISS, never an assertion). Results go to a
JSON file (every raw repeat timing, the machine, the versions) and a PNG bar chart.

    python benchmarks/throughput.py --recipe mnist_convnet
    python benchmarks/throughput.py --recipe cifar_cnn --device cuda
    python benchmarks/throughput.py --recipe mnist_convnet --tiny      # smoke test, well under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch
import torch.nn.functional as F

from common.augment import BatchTransform, batch_generator, channel_stats
from common.data import ImageSplit, TensorImages, keep_batch, make_loader
from common.models import MLP, CifarCNN, ConvNet, count_parameters, parse_ints
from common.accelerator import make_accelerator
from common.guard import StepGuard

NUM_CLASSES = 10

# --- the recipes' defaults (mirrors recipes/*.py; tests/test_benchmark.py checks they agree) ----------

RECIPES = {
    "fashion_mnist_mlp": dict(shape=(1, 28, 28), batch_size=128, model="MLP", widths="1024,1024", dropout=0.2,
                              optimizer="adamw", lr=1e-3, weight_decay=1e-4, label_smoothing=0.1,
                              translate=0, flip=False, channels_last=False),
    "mnist_convnet": dict(shape=(1, 28, 28), batch_size=128, model="ConvNet", width=48, depth=2, dropout=0.1,
                          optimizer="adamw", lr=2e-3, weight_decay=1e-4, label_smoothing=0.1,
                          translate=2, flip=False, channels_last=False),
    "cifar_cnn": dict(shape=(3, 32, 32), batch_size=512, model="CifarCNN", widths="64,256,256",
                      optimizer="sgd", lr=0.2, momentum=0.9, weight_decay=5e-4, label_smoothing=0.2,
                      translate=2, flip=True, channels_last=True),
}
NORMAL = dict(num_images=10000, steps=20, warmup=5, repeats=5)
TINY = dict(num_images=256, steps=2, warmup=1, repeats=2, batch_size=32, width=8,
            widths={"MLP": "64", "CifarCNN": "16,32,32"})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--num-images", type=int, help=f"synthetic training images (default {NORMAL['num_images']})")
    p.add_argument("--batch-size", type=int, help="PER-PROCESS batch (default: the recipe's global batch)")
    p.add_argument("--steps", type=int, help=f"training steps per timed repeat (default {NORMAL['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps before timing (default {NORMAL['warmup']})")
    p.add_argument("--repeats", type=int, help=f"timed repeats; the median is reported (default {NORMAL['repeats']})")
    p.add_argument("--width", type=int, help="ConvNet width (mnist_convnet)")
    p.add_argument("--widths", help="CifarCNN block widths or MLP hidden widths, comma-separated")
    p.add_argument("--seed-workers", type=int, default=os.cpu_count() or 1,
                   help="DataLoader workers of the seed-style pipeline (default: os.cpu_count())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="smoke test: few images, 2 repeats of 2 steps, small widths")
    p.add_argument("--out-json", type=Path, help="default benchmarks/results/<recipe>-<hostname>.json")
    p.add_argument("--out-png", type=Path, help="default benchmarks/results/<recipe>-<hostname>.png")
    args = p.parse_args(argv)

    spec = RECIPES[args.recipe]
    preset = TINY if args.tiny else NORMAL
    for key in ("num_images", "steps", "warmup", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.batch_size is None:
        args.batch_size = TINY["batch_size"] if args.tiny else spec["batch_size"]
    if args.width is None:
        args.width = TINY["width"] if args.tiny else spec.get("width", 32)
    if args.widths is None:
        args.widths = TINY["widths"].get(spec["model"], "") if args.tiny else spec.get("widths", "")
    if min(args.num_images, args.batch_size, args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--num-images, --batch-size, --steps and --repeats must be >= 1, --warmup >= 0")
    if args.num_images < args.batch_size:
        p.error(f"--num-images {args.num_images} is smaller than one batch ({args.batch_size})")
    if args.repeats < 5 and not args.tiny:
        print(f"warning: --repeats {args.repeats} < 5: the medians are less trustworthy", file=sys.stderr)
    stem = f"{args.recipe}-{socket.gethostname()}"
    args.out_json = args.out_json or REPO / "benchmarks" / "results" / f"{stem}.json"
    args.out_png = args.out_png or REPO / "benchmarks" / "results" / f"{stem}.png"
    return args


# --- building blocks: data, model, optimizer, accelerator ------------------------------------------

def synthetic_split(shape, n: int, seed: int) -> ImageSplit:
    """uint8 images of the recipe's shape. Smooth (upsampled low-resolution noise) rather than white
    noise, so their PNGs compress and decode like natural images do."""
    c, h, w = shape
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for start in range(0, n, 2048):
        coarse = torch.rand(min(2048, n - start), c, max(1, h // 4), max(1, w // 4), generator=g)
        fine = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        chunks.append(fine.mul_(255).round_().to(torch.uint8))
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return ImageSplit(torch.cat(chunks).contiguous(), labels)


def build_model(spec: dict, args) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # every path starts from the same weights
    if spec["model"] == "MLP":
        model = MLP(spec["shape"], NUM_CLASSES, hidden=parse_ints(args.widths), dropout=spec["dropout"])
    elif spec["model"] == "ConvNet":
        model = ConvNet(spec["shape"], NUM_CLASSES, width=args.width, depth=spec["depth"], dropout=spec["dropout"])
    else:
        model = CifarCNN(spec["shape"], NUM_CLASSES, widths=parse_ints(args.widths))
    if spec["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def build_optimizer(spec: dict, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if spec["optimizer"] == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"],
                                 fused=device.type == "cuda" or None)
    return torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"], nesterov=True,
                           weight_decay=spec["weight_decay"], foreach=True)


def build_transform(spec: dict, split: ImageSplit) -> BatchTransform:
    mean, std = channel_stats(split.images)
    return BatchTransform(mean, std, translate=spec["translate"], flip=spec["flip"],
                          channels_last=spec["channels_last"])


def new_accelerator(args):
    """The recipes' own Accelerator (common.accelerator.make_accelerator), fp32. bf16 is measured with an
    explicit autocast, so that one Accelerator serves every path."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    accelerator, _ = make_accelerator(types.SimpleNamespace(grad_accum=1, seed=args.seed, timeout_s=300))
    return accelerator


def batches(loader):
    """(epoch, index in epoch, batch) forever, reshuffling every epoch as the recipes' loop does."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            yield epoch, i, batch
        epoch += 1


# --- timing ----------------------------------------------------------------------------------------

@dataclass
class Runner:
    name: str
    step: Callable[[], None]   # one training step (or one batch), fetching its own data
    samples_per_step: int      # global samples per step (all processes)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runners(runners, warmup: int, steps: int, repeats: int, device, barrier=lambda: None) -> dict:
    """Warm each runner up, then time `repeats` rounds of `steps` steps. Within a round the runners
    take turns, so a slow drift of the machine (clock, neighbours) hits all of them alike.
    Returns {name: [seconds per repeat]}."""
    for r in runners:
        for _ in range(warmup):
            r.step()
    sync(device)
    seconds = {r.name: [] for r in runners}
    for _ in range(repeats):
        for r in runners:
            barrier()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                r.step()
            sync(device)
            seconds[r.name].append(time.perf_counter() - t0)
    return seconds


def summarize(seconds: list[float], steps: int, samples_per_step: int, **info) -> dict:
    """Median samples/s over the repeats (and the best repeat's, a hint on a busy machine), plus
    everything needed to recompute them."""
    median = statistics.median(seconds)
    return {"samples_per_s": steps * samples_per_step / median, "ms_per_step": 1000 * median / steps,
            "samples_per_s_best": steps * samples_per_step / min(seconds),
            "median_s": median, "spread": (max(seconds) - min(seconds)) / median, "steps_per_repeat": steps,
            "samples_per_step": samples_per_step, "repeat_s": seconds, **info}


# --- step functions: one per training path ---------------------------------------------------------

def pure_compute_step(spec, args, device, batch) -> Callable[[], None]:
    """1. The compute bound: a bare loop over ONE pre-built, pre-transformed batch."""
    model = build_model(spec, args).to(device)
    optimizer = build_optimizer(spec, model, device)
    x, y = batch

    def step():
        loss = F.cross_entropy(model(x).float(), y, label_smoothing=spec["label_smoothing"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def accelerate_step(spec, args, accelerator, loader, transform, bf16: bool = False) -> Callable[[], None]:
    """2. The recipe's training step (recipes/*.py, minus logging/checkpointing): prepared model,
    optimizer and loader, on-device BatchTransform with the per-step generator, accelerator.backward,
    the per-step StepGuard all-reduce (``common.guard``, as ``TrainingRun`` runs it), optimizer.step.
    ``transform=None`` feeds the batch as it comes (the seed-style loader already normalizes); ``bf16`` runs the forward under bf16
    autocast, as Accelerate's mixed_precision='bf16' does."""
    model = build_model(spec, args)
    optimizer = build_optimizer(spec, model, accelerator.device)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = StepGuard(accelerator)
    stream, rank = batches(loader), accelerator.process_index
    device_type = accelerator.device.type

    def step():
        epoch, i, (images, labels) = next(stream)
        with accelerator.accumulate(model):
            x = transform.train(images, batch_generator(args.seed, epoch, i, rank)) if transform else images
            with torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=spec["label_smoothing"])
            guard.track(loss)
            accelerator.backward(loss)
            guard.check(stop_requested=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def raw_torch_step(spec, args, device, split, transform, rank: int = 0, world: int = 1) -> Callable[[], None]:
    """5. The same step in plain PyTorch: the same loader (a DistributedSampler over the same
    dataset when world > 1), the same transform, the same 3-number all-reduce, DDP when world > 1."""
    model = build_model(spec, args).to(device)
    optimizer = build_optimizer(spec, model, device)
    pin = device.type == "cuda"
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, DistributedSampler

        model = DistributedDataParallel(model, device_ids=[device.index] if pin else None)
        dataset = TensorImages(split)
        sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                            collate_fn=keep_batch, pin_memory=pin)
    else:
        loader = make_loader(split, args.batch_size, train=True, pin=pin)
    stream = batches(loader)

    def step():
        epoch, i, (images, labels) = next(stream)
        images, labels = images.to(device, non_blocking=pin), labels.to(device, non_blocking=pin)
        logits = model(transform.train(images, batch_generator(args.seed, epoch, i, rank)))
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=spec["label_smoothing"])
        d = loss.detach().float()
        packed = torch.stack([(~torch.isfinite(d)).float(), torch.zeros((), device=device),
                              torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0)])
        if world > 1:
            torch.distributed.all_reduce(packed)
        packed.tolist()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def loader_step(loader) -> Callable[[], None]:
    """3. One batch from the loader, touched (summed) so that it is really produced."""
    stream = batches(loader)

    def step():
        _, _, (images, labels) = next(stream)
        images.sum()
        labels.sum()
    return step


# --- seed-style pipeline -----------------------------------------------------------------------------

class SeedStyleImages(torch.utils.data.Dataset):
    """What a first version typically does: one PNG decode and one torchvision transform per sample."""

    def __init__(self, pngs: list[bytes], labels: list[int], transform):
        self.pngs, self.labels, self.transform = pngs, labels, transform

    def __len__(self):
        return len(self.pngs)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.open(io.BytesIO(self.pngs[i]))), self.labels[i]


def seed_style_loader(spec, args, split: ImageSplit, transform: BatchTransform, device):
    """Encode the images to PNG bytes once (in memory), then decode per sample with PIL as a real
    image dataset would; torchvision transforms; a DataLoader with num_workers=os.cpu_count()."""
    from PIL import Image
    from torchvision import transforms as T

    pngs = []
    for arr in split.images.permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    augment = []
    if spec["translate"]:
        augment.append(T.RandomCrop(spec["shape"][1:], padding=spec["translate"], padding_mode="reflect"))
    if spec["flip"]:
        augment.append(T.RandomHorizontalFlip())
    tf = T.Compose([*augment, T.ToTensor(), T.Normalize(transform.mean, transform.std)])
    dataset = SeedStyleImages(pngs, split.labels.tolist(), tf)
    workers = args.seed_workers
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                       num_workers=workers, persistent_workers=workers > 0,
                                       pin_memory=device.type == "cuda")


# --- measurements --------------------------------------------------------------------------------------

def measure_training(spec, args, accelerator, split, transform) -> dict:
    """1, 2, 5 (one process), 7: pure compute, recipe, raw PyTorch and recipe-in-bf16, interleaved."""
    device = accelerator.device
    first = split.images[:args.batch_size].to(device)
    x = transform.train(first, batch_generator(args.seed, 0, 0, 0))
    y = split.labels[:args.batch_size].to(device)
    runners = [
        Runner("pure_compute", pure_compute_step(spec, args, device, (x, y)), args.batch_size),
        Runner("recipe", accelerate_step(spec, args, accelerator, make_loader(
            split, args.batch_size, train=True, pin=device.type == "cuda"), transform), args.batch_size),
        Runner("raw_torch", raw_torch_step(spec, args, device, split, transform), args.batch_size),
        Runner("recipe_bf16", accelerate_step(spec, args, accelerator, make_loader(
            split, args.batch_size, train=True, pin=device.type == "cuda"), transform, bf16=True),
            args.batch_size),
    ]
    seconds = time_runners(runners, args.warmup, args.steps, args.repeats, device)
    info = dict(processes=1, threads=torch.get_num_threads())
    return {r.name: summarize(seconds[r.name], args.steps, r.samples_per_step, **info) for r in runners}


def measure_loader(args, accelerator, split) -> dict:
    """3. The prepared recipe loader alone. Each repeat is a whole epoch (at least --steps batches)."""
    loader = accelerator.prepare(make_loader(split, args.batch_size, train=True,
                                             pin=accelerator.device.type == "cuda"))
    n = max(args.steps, len(loader))
    runner = Runner("loader", loader_step(loader), args.batch_size)
    seconds = time_runners([runner], args.warmup, n, args.repeats, accelerator.device)
    return {"loader": summarize(seconds["loader"], n, args.batch_size, processes=1, threads=torch.get_num_threads())}


def measure_seed_style(spec, args, accelerator, split, transform) -> dict:
    """4. Seed-style pipeline: training with it (same model and step as the recipe), then its loader alone."""
    loader = accelerator.prepare(seed_style_loader(spec, args, split, transform, accelerator.device))
    device = accelerator.device
    train = Runner("seed_training", accelerate_step(spec, args, accelerator, loader, None), args.batch_size)
    seconds = time_runners([train], args.warmup, args.steps, args.repeats, device)
    n = max(args.steps, len(loader))
    only = Runner("seed_loader", loader_step(loader), args.batch_size)
    seconds.update(time_runners([only], args.warmup, n, args.repeats, device))
    info = dict(processes=1, threads=torch.get_num_threads(), loader_workers=args.seed_workers)
    return {"seed_training": summarize(seconds["seed_training"], args.steps, args.batch_size, **info),
            "seed_loader": summarize(seconds["seed_loader"], n, args.batch_size, **info)}


def _process_worker(rank: int, world: int, port: int, arg_dict: dict, out_dir: str):
    """One rank of measure_processes (started by torch.multiprocessing, spawn)."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # Accelerate would otherwise pick its own
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    args = argparse.Namespace(**arg_dict)
    spec = RECIPES[args.recipe]
    accelerator = new_accelerator(args)
    torch.set_num_threads(1)
    device = accelerator.device
    split = synthetic_split(spec["shape"], args.num_images, args.seed)
    transform = build_transform(spec, split)
    loader = make_loader(split, args.batch_size, train=True, pin=device.type == "cuda")
    raw_name = "raw_ddp" if world > 1 else "raw_torch"
    runners = [Runner("recipe", accelerate_step(spec, args, accelerator, loader, transform), world * args.batch_size),
               Runner(raw_name, raw_torch_step(spec, args, device, split, transform, rank, world),
                      world * args.batch_size)]
    barrier = torch.distributed.barrier if world > 1 else (lambda: None)
    seconds = time_runners(runners, args.warmup, args.steps, args.repeats, device, barrier)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "threads": torch.get_num_threads(), "backend": accelerator.state.backend,
         "distributed": accelerator.distributed_type.value, "processes": accelerator.num_processes}))
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_processes(args, device, skipped: dict) -> dict:
    """5 (two processes) and 6: recipe vs raw PyTorch/DDP in 1 and in 2 processes, 1 thread each,
    the per-rank batch fixed. Each rank's repeat counts as long as the slowest rank's."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        skipped["processes"] = f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
        return {}
    import torch.multiprocessing as mp

    out = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.start_processes(_process_worker, args=(world, free_port(), vars(args), tmp),
                                   nprocs=world, join=True, start_method="spawn")
            except Exception as err:  # report and go on: the other measurements still count
                last_line = (str(err).strip().splitlines() or [""])[-1]
                skipped[f"{world}proc"] = f"{type(err).__name__}: {last_line}"
                print(f"  {world}-process measurement failed: {err}", file=sys.stderr)
                continue
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        for name in ranks[0]["seconds"]:
            per_rank = [r["seconds"][name] for r in ranks]
            seconds = [max(ts) for ts in zip(*per_rank)]
            out[f"{name}_{world}proc_1thread"] = summarize(
                seconds, args.steps, world * args.batch_size, processes=world, threads=ranks[0]["threads"],
                backend=ranks[0]["backend"], distributed=ranks[0]["distributed"], repeat_s_per_rank=per_rank)
    return out


# --- ratios against the project's targets -------------------------------------------------------------

def compute_ratios(m: dict, spec: dict) -> dict:
    cnn = spec["model"] != "MLP"
    sps = {k: v["samples_per_s"] for k, v in m.items()}

    def ratio(a, b, scale=1.0):
        return sps[a] / (scale * sps[b]) if a in sps and b in sps else None

    def overhead_pct(accel, raw):  # extra time per step, in % of the raw PyTorch step
        return (sps[raw] / sps[accel] - 1) * 100 if accel in sps and raw in sps else None

    rows = {
        "recipe_vs_pure_compute": ("recipe / pure compute", ratio("recipe", "pure_compute"), ">=", 0.90),
        "loader_vs_recipe": ("loader / recipe training", ratio("loader", "recipe"), ">=", 10.0),
        "loader_vs_seed_loader": ("loader / seed-style loader", ratio("loader", "seed_loader"), ">=", 20.0),
        "recipe_vs_seed_training": ("recipe / seed-style training", ratio("recipe", "seed_training"), None, None),
        "accelerate_overhead_1proc_pct": ("Accelerate overhead, 1 proc (%)",
                                          overhead_pct("recipe", "raw_torch"), "<=", 3.0),
        "accelerate_overhead_1proc_1thread_pct": ("Accelerate overhead, 1 proc 1 thread (%)",
                                                  overhead_pct("recipe_1proc_1thread", "raw_torch_1proc_1thread"),
                                                  None, None),
        "accelerate_overhead_2proc_pct": ("Accelerate overhead, 2 procs (%)",
                                          overhead_pct("recipe_2proc_1thread", "raw_ddp_2proc_1thread"), "<=", 3.0),
        "scaling_efficiency_2proc": ("2-proc scaling efficiency (recipe)",
                                     ratio("recipe_2proc_1thread", "recipe_1proc_1thread", 2.0),
                                     ">=", 0.85 if cnn else 0.75),
        "scaling_efficiency_2proc_raw": ("2-proc scaling efficiency (raw DDP)",
                                         ratio("raw_ddp_2proc_1thread", "raw_torch_1proc_1thread", 2.0), None, None),
        "bf16_vs_fp32": ("bf16 autocast / fp32 (recipe)", ratio("recipe_bf16", "recipe"), ">=", 1.3 if cnn else 1.0),
    }
    out = {}
    for key, (label, value, op, target) in rows.items():
        ok = None
        if value is not None and op is not None:
            ok = value >= target if op == ">=" else value <= target
        out[key] = {"label": label, "value": value, "op": op, "target": target,
                    "status": "n/a" if value is None else ("info" if op is None else ("PASS" if ok else "MISS"))}
    return out


# --- report: machine, table, JSON, PNG -----------------------------------------------------------------

def machine_info(device: torch.device) -> dict:
    cpu_model, flags = platform.processor(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                cpu_model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_model,
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu_bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
            "torch_num_threads": torch.get_num_threads(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "gpu_count": torch.cuda.device_count() if device.type == "cuda" else 0}


def versions() -> dict:
    import accelerate
    import torchvision

    return {"python": platform.python_version(), "torch": torch.__version__,
            "accelerate": accelerate.__version__, "torchvision": torchvision.__version__}


def format_table(report: dict) -> str:
    m, lines = report["measurements"], []
    lines.append(f"{'measurement':<26}{'samples/s':>14}{'ms/step':>10}{'spread':>8}{'procs':>6}{'thr':>5}")
    for key, v in m.items():
        lines.append(f"{key:<26}{v['samples_per_s']:>14,.0f}{v['ms_per_step']:>10.2f}{v['spread']:>8.1%}"
                     f"{v.get('processes', 1):>6}{v.get('threads', ''):>5}")
    lines.append("")
    lines.append(f"{'ratio':<42}{'value':>10}  {'target':<9}result")
    for r in report["ratios"].values():
        value = "-" if r["value"] is None else f"{r['value']:.3g}" if abs(r["value"]) >= 1e3 else f"{r['value']:.2f}"
        target = "" if r["op"] is None else f"{r['op']} {r['target']:g}"
        lines.append(f"{r['label']:<42}{value:>10}  {target:<9}{r['status']}")
    for what, why in report["skipped"].items():
        lines.append(f"skipped {what}: {why}")
    return "\n".join(lines)


def draw_png(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report["measurements"]
    names = list(m)[::-1]
    colors = ["tab:blue" if n in ("pure_compute", "recipe", "raw_torch", "recipe_bf16") else
              "tab:orange" if "loader" in n else "tab:gray" if n.startswith("seed") else "tab:green" for n in names]
    fig, (ax, ax_text) = plt.subplots(1, 2, figsize=(14, 0.45 * len(names) + 2.5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    values = [m[n]["samples_per_s"] for n in names]
    ax.barh(names, values, color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("samples/s (median of repeats, log scale)")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlim(right=max(values) * 8)
    mach = report["machine"]
    ax.set_title(f"{report['recipe']} on {mach['hostname']} ({mach['gpu'] or mach['cpu']}, "
                 f"{mach['cpu_count']} CPUs)", fontsize=10)
    ax_text.axis("off")
    rows = [f"{r['label'][:38]:<38} {'-' if r['value'] is None else format(r['value'], '.2f'):>8} {r['status']}"
            for r in report["ratios"].values()]
    ax_text.text(0, 1, "\n".join(rows), family="monospace", fontsize=8, va="top")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------

def hide_or_check_gpus(choice: str):
    """--device cpu hides the GPUs (before CUDA starts), so the recipes' Accelerator picks the CPU too."""
    if choice == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False)")


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = RECIPES[args.recipe]
    hide_or_check_gpus(args.device)
    t_start, load_start = time.perf_counter(), load_average()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy (load average {load_start[0]} on {os.cpu_count()} CPUs): "
              "other processes share the cores and the numbers will be low and noisy", file=sys.stderr)
    split = synthetic_split(spec["shape"], args.num_images, args.seed)
    transform = build_transform(spec, split)
    accelerator = new_accelerator(args)
    device = accelerator.device
    model_args = {"width": args.width} if spec["model"] == "ConvNet" else {"widths": args.widths}
    n_params = count_parameters(build_model(spec, args))
    print(f"{args.recipe}: {spec['model']} {model_args} {n_params:,} params, {args.num_images} images "
          f"{spec['shape']}, per-process batch {args.batch_size}, {args.repeats} repeats x {args.steps} steps "
          f"after {args.warmup} warm-up, device {accelerator.device}, {torch.get_num_threads()} threads", flush=True)

    measurements, skipped = {}, {}
    phases = [("pure compute, recipe, raw PyTorch, recipe bf16 (interleaved)",
               lambda: measure_training(spec, args, accelerator, split, transform)),
              ("loader alone", lambda: measure_loader(args, accelerator, split)),
              ("1 and 2 processes, 1 thread each", lambda: measure_processes(args, device, skipped)),
              ("seed-style pipeline", lambda: measure_seed_style(spec, args, accelerator, split, transform))]
    for i, (what, measure) in enumerate(phases, 1):
        print(f"[{i}/{len(phases)}] {what} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        measurements.update(measure())
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)

    report = {
        "benchmark": "throughput", "recipe": args.recipe, "created": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "settings": {"model": spec["model"], "model_args": model_args, "params": n_params,
                     "input_shape": list(spec["shape"]), "num_images": args.num_images,
                     "per_process_batch": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                     "repeats": args.repeats, "precision": "fp32 (bf16 row: autocast)", "tiny": args.tiny,
                     "seed_workers": args.seed_workers, "optimizer": spec["optimizer"],
                     "augment": {"translate": spec["translate"], "flip": spec["flip"],
                                 "channels_last": spec["channels_last"]}},
        "machine": {**machine_info(device), "load_average_start": load_start, "load_average_end": load_average()},
        "versions": versions(),
        "measurements": measurements, "ratios": compute_ratios(measurements, spec), "skipped": skipped,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print()
    print(format_table(report))
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=2) + "\n")
    draw_png(report, args.out_png)
    print(f"\nwrote {args.out_json} and {args.out_png} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
