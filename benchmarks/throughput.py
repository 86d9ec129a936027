#!/usr/bin/env python
"""Training-throughput benchmark for one recipe: where do the samples/s go, and what does each lever buy?

It times the recipe's OWN code. The recipe file is imported; its ``Config()`` (defaults, plus
``--recipe-args`` parsed by the recipe's own parser), ``build_model`` and ``build_optimizer`` give every
in-process row its model and optimizer, and the ``recipe*`` rows are the recipe itself, run end to end.
Everything runs on one synthetic dataset (smooth noise, the recipe's image shape, 10 classes) written once
in the Hub parquet layout, all in fp32 unless a row says otherwise.

Rows (samples/s, global over processes):

  recipe                   `python recipes/<r>.py --max-steps N --log-every K` in a subprocess: loader, on-device
                           augmentation, forward/backward, the non-finite guard's all-reduce, gradient norm,
                           optimizer, scheduler, logging; read from the run's metrics.jsonl windows
  raw_torch                the same model and optimizer in a plain PyTorch loop: tensor-indexed batches of the
                           same images, the same BatchTransform, gradient norm, and the guard's 4-number sync
                           (an all-reduce with 2 processes); no Accelerate, no TrainingRun
  pure_compute             the model and optimizer over ONE pre-built batch: forward, cross-entropy, backward,
                           step, zero_grad (the compute bound)
  pure_bf16                pure_compute with the forward under bf16 autocast
  pure_channels_last /     pure_compute in the memory format the recipe does not use (CNNs only)
  pure_contiguous
  pure_compiled            pure_compute with torch.compile(model) (inductor by default); its compile time (cold:
                           inductor's disk cache is a fresh one in the work dir) is reported apart from its
                           steady-state step
  loader                   the recipe's data path alone: common.data.make_loader, device copy, BatchTransform
  seed_loader              a per-sample pipeline: PNG bytes -> PIL -> torchvision transforms, DataLoader workers
  seed_training            raw_torch's step fed by seed_loader
  recipe_1proc_1thread,    1 process with 1 thread (CPU), against which 2 processes are compared
  raw_torch_1proc_1thread
  recipe_2proc             `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml` (1 thread each on a
                           CPU; 2 GPUs with --device cuda), the same global batch
  raw_ddp_2proc            raw_torch in 2 spawned processes under DistributedDataParallel (gloo on CPU)

How rows are timed: the recipe rows and raw rows log a window every --log-every steps over --steps steps;
the first window is warm-up and dropped, the median of the others is reported with its spread
((max - min) / median). The pure rows take turns: --warmup steps each, then --repeats rounds of
--log-every steps, so machine drift hits them alike. Loader rows: --repeats epochs after one warm-up
epoch. Ratios are printed against the project's targets (PASS/MISS, never a failure); a lever or row that
could not run is reported with its reason, not dropped.

    python benchmarks/throughput.py --recipe mnist_convnet              # any recipes/*.py, or a recipe file
    python benchmarks/throughput.py --recipe cifar_cnn --device cuda
    python benchmarks/throughput.py --recipe mnist_convnet --tiny       # smoke test, small model and few steps
    python benchmarks/throughput.py --recipe mnist_convnet --recipe-args "--width 32" --skip processes

Writes a JSON report (--out-json, default benchmarks/results/throughput-<recipe>-<host>.json): every
window and repeat, the machine (CPU model, its bf16 flags, threads, load average), the versions, the run
directories (kept under --work-dir when given). Exit status: 0 when it ran (whatever the ratios), 2 for
bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch
import torch.nn.functional as F

from common.launching import import_recipe, launch_command, read_run, recipe_env
from common.machine import free_port, load_average, machine_info, versions

NUM_CLASSES = 10
# Image shape of each recipe's default Hub dataset (the data's shape, which a recipe reads from the data).
DATASET_SHAPES = {"ylecun/mnist": (1, 28, 28), "mnist": (1, 28, 28), "zalando-datasets/fashion_mnist": (1, 28, 28),
                  "fashion_mnist": (1, 28, 28), "uoft-cs/cifar10": (3, 32, 32), "cifar10": (3, 32, 32)}
# --tiny: a small model of each shipped recipe (recipe flags), batch 32, 4 steps logged one by one.
TINY_MODEL = {"fashion_mnist_mlp": "--hidden 32", "mnist_convnet": "--width 8", "cifar_cnn": "--widths 8,16,16"}
TINY = dict(steps=4, log_every=1, repeats=2, warmup=1, batch_size=32)
NORMAL = dict(steps=30, log_every=5, repeats=5, warmup=2)
SKIPPABLE = ("processes", "bf16", "channels_last", "compile", "seed")


def bad_input(message: str):
    """One paragraph on stderr, exit 2 (the recipes' bad-input code)."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="a recipe name (recipes/<name>.py) or the path of a recipe file")
    p.add_argument("--recipe-args", default="", help="recipe flags for every row, e.g. \"--width 32 --batch-size 256\" "
                   "(--batch-size is the global batch, as in the recipe)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--steps", type=int, help=f"optimizer steps per recipe or raw run (default {NORMAL['steps']})")
    p.add_argument("--log-every", type=int, help=f"steps per timed window (default {NORMAL['log_every']})")
    p.add_argument("--runs", type=int, default=1, help="recipe and raw runs per row; their windows are pooled")
    p.add_argument("--repeats", type=int,
                   help=f"timed rounds of the pure and loader rows (default {NORMAL['repeats']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps of each pure row (default {NORMAL['warmup']})")
    p.add_argument("--skip", default="", help=f"comma-separated groups to leave out: {', '.join(SKIPPABLE)}")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of pure_compiled")
    p.add_argument("--shape", help="C,H,W of the synthetic images (default: the recipe's default dataset's)")
    p.add_argument("--seed-workers", type=int, default=os.cpu_count() or 1,
                   help="DataLoader workers of the per-sample pipeline (default: os.cpu_count())")
    p.add_argument("--work-dir", type=Path, help="keep the dataset, caches, run directories and logs here "
                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one recipe run may take before it is stopped")
    p.add_argument("--tiny", action="store_true", help="smoke test: the recipe's model made small (shipped recipes), "
                   "batch 32, 4 steps, 2 repeats")
    p.add_argument("--out-json", type=Path, help="default benchmarks/results/throughput-<recipe>-<hostname>.json")
    args = p.parse_args(argv)

    path = Path(args.recipe)
    args.recipe_path = (path if path.suffix == ".py" else REPO / "recipes" / f"{args.recipe}.py").resolve()
    if not args.recipe_path.is_file():
        shipped = ", ".join(sorted(f.stem for f in (REPO / "recipes").glob("*.py")))
        bad_input(f"--recipe {args.recipe}: there is no {args.recipe_path}. Name a shipped recipe ({shipped}) or "
                  "give the path of a recipe file.")
    args.recipe_name = args.recipe_path.stem
    preset = TINY if args.tiny else NORMAL
    for key in ("steps", "log_every", "repeats", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    try:
        args.recipe_argv = shlex.split(args.recipe_args)
    except ValueError as err:
        bad_input(f"--recipe-args {args.recipe_args!r} is not a valid command line ({err}).")
    if args.tiny:  # the user's own flags come last and win
        args.recipe_argv = [*TINY_MODEL.get(args.recipe_name, "").split(), "--batch-size", str(TINY["batch_size"]),
                            *args.recipe_argv]
    if min(args.steps, args.log_every, args.repeats, args.runs) < 1 or args.warmup < 0 or args.seed_workers < 0:
        bad_input("--steps, --log-every, --repeats and --runs must be at least 1, --warmup and --seed-workers at "
                  f"least 0 (got {args.steps}, {args.log_every}, {args.repeats}, {args.runs}, {args.warmup}, "
                  f"{args.seed_workers}).")
    if args.steps < 2 * args.log_every or args.steps % args.log_every:
        bad_input(f"--steps {args.steps} must be a multiple of --log-every {args.log_every} and at least twice it: "
                  "the first window is warm-up and is dropped, the others are timed. Pass e.g. "
                  f"--steps {max(2, math.ceil(args.steps / args.log_every)) * args.log_every}.")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(SKIPPABLE):
        bad_input(f"--skip {','.join(sorted(args.skip - set(SKIPPABLE)))}: unknown; the groups are "
                  f"{', '.join(SKIPPABLE)}.")
    if args.shape:
        try:
            args.shape = tuple(int(v) for v in args.shape.split(","))
            assert len(args.shape) == 3 and min(args.shape) >= 1
        except (ValueError, AssertionError):
            bad_input(f"--shape {args.shape!r}: expected three positive integers C,H,W, e.g. 3,32,32.")
    stem = f"throughput-{args.recipe_name}-{socket.gethostname()}"
    args.out_json = args.out_json or REPO / "benchmarks" / "results" / f"{stem}.json"
    return args


# --- the recipe, imported ---------------------------------------------------------------------------

def load_recipe(path: Path):
    """The recipe file as a module (recipes run nothing at import)."""
    module = import_recipe(path, prefix="_bench_recipe")
    missing = [name for name in ("Config", "build_model", "build_optimizer", "main") if not hasattr(module, name)]
    if missing:
        bad_input(f"{path} has no {', '.join(missing)}: the benchmark builds its model and optimizer from the "
                  "recipe's Config, build_model(cfg, in_shape, num_classes) and build_optimizer(cfg, model, device), "
                  "as every shipped recipe defines them.")
    return module


def recipe_config(module, argv: list[str]):
    """The recipe's Config from its own command-line parser: the defaults, overridden by --recipe-args."""
    from common.config import parse_config

    try:
        cfg = parse_config(module.Config, argv)
    except SystemExit:
        bad_input(f"--recipe-args {shlex.join(argv)!r} is not a valid command line for the recipe (its message "
                  "is above).")
    if cfg.grad_accum != 1:
        bad_input(f"--grad-accum {cfg.grad_accum}: the plain-PyTorch rows take one optimizer step per batch; "
                  "benchmark with --grad-accum 1.")
    return cfg


def image_shape(args, cfg) -> tuple[int, int, int]:
    if args.shape:
        return args.shape
    shape = DATASET_SHAPES.get(cfg.dataset)
    if shape is None:
        bad_input(f"the recipe's default dataset {cfg.dataset!r} has no known image shape: pass --shape C,H,W.")
    c, h, w = shape
    return (cfg.channels or c, cfg.image_size or h, cfg.image_size or w)


def new_model(module, cfg, shape, device, channels_last: bool | None = None):
    """build_model from the recipe, in the memory format the recipe uses (cfg.channels_last) unless told."""
    torch.manual_seed(cfg.seed)  # every row starts from the same weights
    model = module.build_model(cfg, shape, NUM_CLASSES)
    if getattr(cfg, "channels_last", False) if channels_last is None else channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.to(device).train()


def is_cnn(model) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


# --- synthetic data -----------------------------------------------------------------------------------

def synthetic_images(shape, n: int, seed: int = 0):
    """uint8 images, smooth (upsampled low-resolution noise) so their PNGs compress and decode like natural
    images, and random labels. Deterministic: the 2-process workers make the same ones."""
    c, h, w = shape
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for start in range(0, n, 2048):
        coarse = torch.rand(min(2048, n - start), c, max(1, h // 4), max(1, w // 4), generator=g)
        fine = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        chunks.append(fine.mul_(255).round_().to(torch.uint8))
    return torch.cat(chunks).contiguous(), torch.randint(0, NUM_CLASSES, (n,), generator=g)


def png_bytes(images: torch.Tensor) -> list[bytes]:
    from PIL import Image

    out = []
    for arr in images.permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_parquet(root: Path, pngs: list[bytes], labels: torch.Tensor) -> Path:
    """A folder laid out like a Hub dataset repo (data/train-00000-of-00001.parquet), what --dataset reads."""
    from datasets import ClassLabel, Dataset, Features, Image

    (root / "data").mkdir(parents=True, exist_ok=True)
    features = Features({"image": Image(), "label": ClassLabel(names=[f"class_{k}" for k in range(NUM_CLASSES)])})
    ds = Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in pngs], "label": labels.tolist()},
                           features=features)
    ds.to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
    return root


# --- timing ---------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_windows(step, steps: int, window: int, device) -> list[float]:
    """Seconds of each window of ``window`` steps over ``steps`` steps, the first (warm-up) one dropped,
    as the recipe rows' metrics.jsonl windows are read."""
    out = []
    for _ in range(steps // window):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(window):
            step()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out[1:]


def time_rounds(runners: dict, warmup: int, repeats: int, steps: int, device) -> dict:
    """``warmup`` steps of each runner, then ``repeats`` rounds in which each runner takes ``steps`` steps
    in turn (drift of the machine hits all of them alike). {name: [seconds per round]}."""
    for step in runners.values():
        for _ in range(warmup):
            step()
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for name, step in runners.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def summarize(samples_per_s: list[float], **info) -> dict:
    """Median samples/s over the timed windows or rounds, their spread ((max - min) / median), and the raw list."""
    med = statistics.median(samples_per_s)
    return {"samples_per_s": med, "spread": (max(samples_per_s) - min(samples_per_s)) / med, "n": len(samples_per_s),
            "samples_per_s_each": [round(v, 3) for v in samples_per_s], **info}


def rate(seconds: list[float], samples: int) -> list[float]:
    return [samples / s for s in seconds]


# --- plain-PyTorch step --------------------------------------------------------------------------------

def tensor_batches(images, labels, batch: int, seed: int, rank: int = 0, world: int = 1):
    """(epoch, index, images, labels) forever: each epoch a seeded permutation cut into global batches,
    rank r taking the r-th slice of each (what a DistributedSampler gives, without a DataLoader)."""
    n, epoch = labels.numel(), 0
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(n // (batch * world)):
            idx = perm[(i * world + rank) * batch:(i * world + rank + 1) * batch]
            yield epoch, i, images[idx], labels[idx]
        epoch += 1


def raw_step(module, cfg, shape, device, stream, transform, rank: int = 0, world: int = 1):
    """The recipe's step in plain PyTorch: the recipe's model and optimizer (DDP when world > 1), the same
    BatchTransform, cross-entropy with the recipe's label smoothing, the gradient norm the recipe logs, and
    the 4-number all-reduce of its non-finite guard (common.guard; a sync point on every step)."""
    from common.augment import batch_generator

    model = new_model(module, cfg, shape, device)
    optimizer = module.build_optimizer(cfg, model, device)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    smoothing = getattr(cfg, "label_smoothing", 0.0)
    zero = torch.zeros((), device=device)

    def step():
        epoch, i, images, labels = next(stream)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        x = transform.train(images, batch_generator(cfg.seed, epoch, i, rank)) if transform else images
        loss = F.cross_entropy(model(x).float(), labels, label_smoothing=smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
        d = loss.detach().float()
        finite = torch.isfinite(d)
        packed = torch.stack([(~finite).float(), torch.where(finite, d, 0.0), finite.float(), zero])
        if world > 1:
            torch.distributed.all_reduce(packed)
        packed.tolist()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def pure_step(module, cfg, shape, device, x, y, bf16=False, channels_last=None, compile_backend=None):
    """The compute bound: the recipe's model and optimizer over ONE pre-built batch."""
    model = new_model(module, cfg, shape, device, channels_last)
    optimizer = module.build_optimizer(cfg, model, device)
    if channels_last if channels_last is not None else getattr(cfg, "channels_last", False):
        x = x.contiguous(memory_format=torch.channels_last)
    else:
        x = x.contiguous()
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    smoothing = getattr(cfg, "label_smoothing", 0.0)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step():
        with autocast():
            logits = forward(x)
        F.cross_entropy(logits.float(), y, label_smoothing=smoothing).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


# --- rows ------------------------------------------------------------------------------------------------

def run_recipe(args, ctx, name: str, nproc: int, threads: int, index: int) -> dict:
    """One real run of the recipe; its metrics.jsonl windows after the first. Raises RuntimeError with the
    run's output when it fails."""
    run_dir = ctx["work"] / "runs" / f"{name}-{index}"
    own = ["--dataset", str(ctx["dataset"]), "--output-dir", str(run_dir), "--cache-dir", str(ctx["work"] / "cache"),
           "--max-steps", str(args.steps), "--log-every", str(args.log_every), "--epochs", "1"]
    cmd = launch_command(args.recipe_path, [*args.recipe_argv, *own], nproc=0 if nproc == 1 else nproc,
                         config="cpu_2proc.yaml", threads=threads, extra_launch=["--num_processes", nproc])
    # fp32 (no launcher precision on the CPU); the recipe's Accelerator would take a visible GPU on --device cpu
    env = recipe_env(ctx["work"], threads=threads, cpu_only=ctx["device"].type == "cpu")
    log = ctx["work"] / "runs" / f"{name}-{index}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(cmd, env=env, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - t0
    written = read_run(run_dir)
    windows, summary = [r for r in written["rows"] if "train/samples_per_sec" in r], written["summary"]
    if code != 0 or len(windows) < 2:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"exit {code}, {len(windows)} logged windows; command: {shlex.join(cmd)}\n{tail}")
    return {"run_dir": str(run_dir), "command": shlex.join(cmd), "log": str(log), "process_wall_s": round(wall, 1),
            "status": summary.get("status"), "precision": summary.get("precision"),
            "processes": summary.get("processes"), "device": summary.get("device"),
            "windows": [w["train/samples_per_sec"] for w in windows[1:]],
            "data_wait_fraction": [w.get("train/data_wait_fraction") for w in windows[1:]]}


def recipe_row(args, ctx, name: str, nproc: int, threads: int) -> dict:
    runs = [run_recipe(args, ctx, name, nproc, threads, k) for k in range(args.runs)]
    windows = [w for r in runs for w in r["windows"]]
    waits = [w for r in runs for w in r["data_wait_fraction"] if w is not None]
    return summarize(windows, source="metrics.jsonl", processes=nproc, threads=threads,
                     data_wait_fraction=statistics.median(waits) if waits else None,
                     global_batch=ctx["cfg"].batch_size, runs=runs)


def raw_row(args, ctx, threads: int, stream_of=None, transform="recipe") -> dict:
    """raw_torch (or seed_training with another batch stream) in this process, at ``threads`` threads."""
    cfg, device = ctx["cfg"], ctx["device"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        windows = []
        for k in range(args.runs):
            stream = stream_of() if stream_of else tensor_batches(ctx["images"], ctx["labels"], cfg.batch_size,
                                                                  cfg.seed + k)
            step = raw_step(ctx["module"], cfg, ctx["shape"], device, stream,
                            ctx["transform"] if transform == "recipe" else None)
            windows += rate(time_windows(step, args.steps, args.log_every, device), args.log_every * cfg.batch_size)
    finally:
        torch.set_num_threads(before)
    return summarize(windows, source="timed in the benchmark", processes=1, threads=threads,
                     global_batch=cfg.batch_size)


def _ddp_worker(rank: int, world: int, port: int, job: dict, out_dir: str):
    """One rank of raw_ddp_2proc (torch.multiprocessing, spawn): the recipe's model under DDP, 1 thread."""
    from common.augment import BatchTransform, channel_stats

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = job["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(job["threads"])
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    module = load_recipe(Path(job["recipe_path"]))
    from common.config import parse_config

    cfg = parse_config(module.Config, job["recipe_argv"])
    shape = tuple(job["shape"])
    images, labels = synthetic_images(shape, job["num_images"])
    mean, std = channel_stats(images)
    transform = BatchTransform(mean, std, translate=getattr(cfg, "translate", 0), flip=getattr(cfg, "flip", False),
                               channels_last=getattr(cfg, "channels_last", False))
    per_rank = cfg.batch_size // world
    windows = []
    for k in range(job["runs"]):
        stream = tensor_batches(images, labels, per_rank, cfg.seed + k, rank, world)
        step = raw_step(module, cfg, shape, device, stream, transform, rank, world)
        torch.distributed.barrier()
        windows += time_windows(step, job["steps"], job["log_every"], device)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"seconds": windows, "backend": torch.distributed.get_backend()}))
    torch.distributed.destroy_process_group()


def raw_ddp_row(args, ctx, world: int, threads: int) -> dict:
    import torch.multiprocessing as mp

    job = {"device": ctx["device"].type, "threads": threads, "recipe_path": str(args.recipe_path),
           "recipe_argv": args.recipe_argv, "shape": list(ctx["shape"]), "num_images": ctx["labels"].numel(),
           "runs": args.runs, "steps": args.steps, "log_every": args.log_every}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ddp_worker, args=(world, free_port(), job, tmp), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    seconds = [max(ts) for ts in zip(*(r["seconds"] for r in ranks))]  # a window lasts as long as its slowest rank
    cfg = ctx["cfg"]
    return summarize(rate(seconds, args.log_every * cfg.batch_size), source="timed in the benchmark",
                     processes=world, threads=threads, global_batch=cfg.batch_size, backend=ranks[0]["backend"])


def pure_rows(args, ctx, skipped: dict, levers: dict) -> dict:
    """pure_compute and the levers on it, in turns. A lever that fails is reported with its reason."""
    from common.accelerator import cpu_bf16_support
    from common.augment import batch_generator

    module, cfg, shape, device = ctx["module"], ctx["cfg"], ctx["shape"], ctx["device"]
    batch = cfg.batch_size
    x = ctx["transform"].train(ctx["images"][:batch].to(device), batch_generator(cfg.seed, 0, 0, 0))
    y = ctx["labels"][:batch].to(device)
    runners = {"pure_compute": pure_step(module, cfg, shape, device, x, y)}
    cl_default = bool(getattr(cfg, "channels_last", False))

    if "bf16" in args.skip:
        skipped["bf16"] = "--skip bf16"
    else:
        native = (torch.cuda.is_bf16_supported() if device.type == "cuda" else bool(cpu_bf16_support()))
        levers["bf16"] = {"row": "pure_bf16", "baseline": "pure_compute", "native_bf16": native,
                          "cpu_bf16_support": cpu_bf16_support() if device.type == "cpu" else None}
        first_step(levers["bf16"], runners, skipped, device,
                   lambda: pure_step(module, cfg, shape, device, x, y, bf16=True))

    if "channels_last" in args.skip:
        skipped["channels_last"] = "--skip channels_last"
    elif not is_cnn(module.build_model(cfg, shape, NUM_CLASSES)):
        levers["channels_last"] = {"status": "n/a", "reason": "the model has no convolutions"}
    else:
        other = "pure_contiguous" if cl_default else "pure_channels_last"
        levers["channels_last"] = {"row": other, "baseline": "pure_compute", "recipe_default": cl_default}
        first_step(levers["channels_last"], runners, skipped, device,
                   lambda: pure_step(module, cfg, shape, device, x, y, channels_last=not cl_default))

    if "compile" in args.skip:
        skipped["compile"] = "--skip compile"
    else:
        # The first step compiles (forward and backward graphs; the optimizer step stays eager). Cold:
        # main() points inductor's on-disk cache at the work directory, as a user's first run finds it.
        levers["compile"] = {"row": "pure_compiled", "baseline": "pure_compute", "backend": args.compile_backend,
                             "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
        first_step(levers["compile"], runners, skipped, device,
                   lambda: pure_step(module, cfg, shape, device, x, y, compile_backend=args.compile_backend))

    seconds = time_rounds(runners, args.warmup, args.repeats, args.log_every, device)
    out = {name: summarize(rate(s, args.log_every * batch), source="timed in the benchmark", processes=1,
                           threads=torch.get_num_threads(), global_batch=batch,
                           ms_per_step=1000 * statistics.median(s) / args.log_every)
           for name, s in seconds.items()}
    for name, lever in levers.items():
        if lever.get("status") in ("n/a", "failed"):
            continue
        lever["status"] = "ok"
        lever["speedup"] = out[lever["row"]]["samples_per_s"] / out["pure_compute"]["samples_per_s"]
        if name == "channels_last" and lever["recipe_default"]:
            lever["speedup"] = 1 / lever["speedup"]  # always channels_last / contiguous
    if "pure_compiled" in out:
        steady = out["pure_compiled"]["ms_per_step"] / 1000
        levers["compile"]["compile_s"] = max(0.0, levers["compile"]["first_step_s"] - steady)
    return out


def first_step(lever: dict, runners: dict, skipped: dict, device, make) -> None:
    """Build a lever's step and take its first step, timed (for torch.compile: the compile). A lever
    that fails there is reported with its reason, not hidden; the other rows still count."""
    try:
        step = make()
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        lever["first_step_s"] = time.perf_counter() - t0
        runners[lever["row"]] = step
    except Exception as err:
        lever.update(status="failed", reason=f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}")
        skipped[lever["row"]] = f"failed: {lever['reason']}"


def loader_rows(args, ctx, skipped: dict) -> dict:
    """The recipe's data path alone, and the per-sample pipeline (alone, and feeding raw_torch's step)."""
    from common.augment import batch_generator
    from common.data import ImageSplit, make_loader

    cfg, device = ctx["cfg"], ctx["device"]
    pin = device.type == "cuda"
    loader = make_loader(ImageSplit(ctx["images"], ctx["labels"]), cfg.batch_size, train=True, pin=pin)
    n = len(loader)

    def epochs(loader):
        epoch = 0
        while True:
            for i, batch in enumerate(loader):
                yield epoch, i, *batch
            epoch += 1

    stream = epochs(loader)

    def data_path():
        epoch, i, images, labels = next(stream)
        x = ctx["transform"].train(images.to(device, non_blocking=pin), batch_generator(cfg.seed, epoch, i, 0))
        labels.to(device, non_blocking=pin)
        x.sum().item()  # waits for the batch to be really made (a device sync on a GPU)

    seconds = time_rounds({"loader": data_path}, n, args.repeats, n, device)
    out = {"loader": summarize(rate(seconds["loader"], n * cfg.batch_size), source="timed in the benchmark",
                               processes=1, threads=torch.get_num_threads(), batches_per_round=n)}
    if "seed" in args.skip:
        skipped["seed_loader"] = skipped["seed_training"] = "--skip seed"
        return out

    seed_loader = per_sample_loader(args, ctx)
    seed_stream = epochs(seed_loader)

    def seed_batch():
        _, _, images, labels = next(seed_stream)
        images.to(device, non_blocking=pin).sum().item()
        labels.to(device, non_blocking=pin)

    seconds = time_rounds({"seed_loader": seed_batch}, len(seed_loader), args.repeats, len(seed_loader), device)
    info = dict(source="timed in the benchmark", processes=1, loader_workers=args.seed_workers)
    out["seed_loader"] = summarize(rate(seconds["seed_loader"], len(seed_loader) * cfg.batch_size),
                                   threads=torch.get_num_threads(), **info)
    out["seed_training"] = raw_row(args, ctx, torch.get_num_threads(), stream_of=lambda: epochs(seed_loader),
                                   transform=None)
    out["seed_training"].update(info)
    return out


class PerSampleImages(torch.utils.data.Dataset):
    """What a first version typically does: one PNG decode and one torchvision transform per sample."""

    def __init__(self, pngs: list[bytes], labels: list[int], transform):
        self.pngs, self.labels, self.transform = pngs, labels, transform

    def __len__(self):
        return len(self.pngs)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.open(io.BytesIO(self.pngs[i]))), self.labels[i]


def per_sample_loader(args, ctx):
    """The same PNGs the recipe decoded, decoded per sample with PIL, torchvision's versions of the
    recipe's augmentation, a shuffling DataLoader with --seed-workers workers."""
    from torchvision import transforms as T

    cfg, t = ctx["cfg"], ctx["transform"]
    augment = []
    if getattr(cfg, "translate", 0):
        augment.append(T.RandomCrop(ctx["shape"][1:], padding=cfg.translate, padding_mode="reflect"))
    if getattr(cfg, "flip", False):
        augment.append(T.RandomHorizontalFlip())
    tf = T.Compose([*augment, T.ToTensor(), T.Normalize(t.mean, t.std)])
    workers = args.seed_workers
    return torch.utils.data.DataLoader(PerSampleImages(ctx["pngs"], ctx["labels"].tolist(), tf),
                                       batch_size=cfg.batch_size, shuffle=True, drop_last=True, num_workers=workers,
                                       persistent_workers=workers > 0, pin_memory=ctx["device"].type == "cuda")


# --- ratios, machine, table --------------------------------------------------------------------------------

def compute_ratios(rows: dict, levers: dict, cnn: bool, device) -> dict:
    sps = {k: v["samples_per_s"] for k, v in rows.items()}

    def ratio(a, b, scale=1.0):
        return sps[a] / (scale * sps[b]) if a in sps and b in sps else None

    def overhead_pct(recipe, raw):  # extra time per step over the plain-PyTorch step, in %
        return (sps[raw] / sps[recipe] - 1) * 100 if recipe in sps and raw in sps else None

    one = ("recipe_1proc_1thread", "raw_torch_1proc_1thread") if device.type == "cpu" else ("recipe", "raw_torch")
    bf16 = levers.get("bf16", {})
    bf16_note = "" if bf16.get("native_bf16", True) else " (emulated: no native bf16)"
    table = {
        "recipe_vs_pure_compute": ("recipe / pure compute", ratio("recipe", "pure_compute"), ">=", 0.90),
        "accelerate_overhead_1proc_pct": ("recipe overhead vs raw PyTorch, 1 proc (%)",
                                          overhead_pct("recipe", "raw_torch"), "<=", 3.0),
        "accelerate_overhead_1proc_1thread_pct": ("recipe overhead vs raw PyTorch, 1 proc 1 thread (%)",
                                                  overhead_pct("recipe_1proc_1thread", "raw_torch_1proc_1thread"),
                                                  None, None),
        "accelerate_overhead_2proc_pct": ("recipe overhead vs raw DDP, 2 procs (%)",
                                          overhead_pct("recipe_2proc", "raw_ddp_2proc"), "<=", 3.0),
        "scaling_efficiency_2proc": ("2-proc scaling efficiency (recipe)", ratio("recipe_2proc", one[0], 2.0),
                                     ">=", 0.85 if cnn else 0.75),
        "scaling_efficiency_2proc_raw": ("2-proc scaling efficiency (raw DDP)", ratio("raw_ddp_2proc", one[1], 2.0),
                                         None, None),
        "loader_vs_recipe": ("loader / recipe training", ratio("loader", "recipe"), ">=", 10.0),
        "loader_vs_seed_loader": ("loader / per-sample loader", ratio("loader", "seed_loader"), ">=", 20.0),
        "raw_vs_seed_training": ("raw step: tensor batches / per-sample pipeline", ratio("raw_torch", "seed_training"),
                                 None, None),
        "bf16_vs_fp32": (f"bf16 autocast / fp32, pure step{bf16_note}", ratio("pure_bf16", "pure_compute"),
                         *((">=", 1.3 if cnn else 1.0) if bf16.get("native_bf16") else (None, None))),
        "channels_last_vs_contiguous": ("channels_last / contiguous, pure step",
                                        levers.get("channels_last", {}).get("speedup"), None, None),
        "compile_vs_eager": ("torch.compile / eager, pure step (steady)", ratio("pure_compiled", "pure_compute"),
                             None, None),
    }
    out = {}
    for key, (label, value, op, target) in table.items():
        ok = None if value is None or op is None else (value >= target if op == ">=" else value <= target)
        out[key] = {"label": label, "value": value, "op": op, "target": target,
                    "status": "n/a" if value is None else "info" if op is None else "PASS" if ok else "MISS"}
    return out


def format_table(report: dict) -> str:
    m = report["machine"]
    lines = [f"machine: {m['gpu'] or m['cpu']}, {m['cpus_usable']} CPUs, {m['torch_num_threads']} torch threads, "
             f"flags {' '.join(m['cpu_flags']) or '-'}, native bf16: {m['cpu_bf16_support']}, load average "
             f"{report['machine']['load_average_start']} -> {report['machine']['load_average_end']}", "",
             f"{'row':<26}{'samples/s':>12}{'spread':>8}{'n':>4}{'procs':>6}{'thr':>5}  source"]
    for key, v in report["rows"].items():
        lines.append(f"{key:<26}{v['samples_per_s']:>12,.1f}{v['spread']:>8.1%}{v['n']:>4}{v['processes']:>6}"
                     f"{v['threads']:>5}  {v['source']}")
    lines.append("")
    for name, lever in report["levers"].items():
        if lever.get("status") != "ok":
            lines.append(f"lever {name}: {lever.get('status', 'not measured')}: {lever.get('reason', 'see above')}")
        elif name == "compile":
            lines.append(f"lever compile ({lever['backend']}): {lever['speedup']:.2f}x steady state, compile "
                         f"{lever['compile_s']:.1f} s (first step {lever['first_step_s']:.1f} s), excluded")
        elif name == "bf16":
            lines.append(f"lever bf16 autocast: {lever['speedup']:.2f}x fp32 "
                         f"({'native' if lever['native_bf16'] else 'emulated: this device has no native bf16'})")
        else:
            lines.append(f"lever channels_last: {lever['speedup']:.2f}x contiguous "
                         f"(the recipe uses {'channels_last' if lever['recipe_default'] else 'contiguous'})")
    lines.append("")
    lines.append(f"{'ratio':<52}{'value':>9}  {'target':<8}result")
    for r in report["ratios"].values():
        value = "-" if r["value"] is None else f"{r['value']:.2f}"
        target = "" if r["op"] is None else f"{r['op']} {r['target']:g}"
        lines.append(f"{r['label']:<52}{value:>9}  {target:<8}{r['status']}")
    for what, why in report["skipped"].items():
        lines.append(f"not measured {what}: {why}")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------

def pick_device(choice: str) -> torch.device:
    """--device cpu hides the GPUs (before CUDA starts), so the recipe's Accelerator picks the CPU too."""
    if choice == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if choice == "cuda" and not torch.cuda.is_available():
        bad_input("--device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False). Use --device cpu.")
    return torch.device("cuda", 0) if choice != "cpu" and torch.cuda.is_available() else torch.device("cpu")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    from common.augment import BatchTransform, channel_stats

    module = load_recipe(args.recipe_path)
    cfg = recipe_config(module, args.recipe_argv)
    shape = image_shape(args, cfg)
    t_start, load_start = time.perf_counter(), load_average()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy (load average {load_start[0]} on {os.cpu_count()} CPUs): the numbers "
              "will be low and noisy; compare only ratios measured in one run", file=sys.stderr)

    # Enough images that --steps fit in the recipe's first epoch after it holds out --val-fraction: an
    # epoch end (evaluation, checkpoint) inside a timed window would be timed too.
    n = math.ceil((args.steps + 1) * cfg.batch_size / (1 - cfg.val_fraction)) + 1
    images, labels = synthetic_images(shape, n)
    mean, std = channel_stats(images)
    transform = BatchTransform(mean, std, translate=getattr(cfg, "translate", 0), flip=getattr(cfg, "flip", False),
                               channels_last=getattr(cfg, "channels_last", False))
    work_ctx = contextlib.nullcontext(args.work_dir) if args.work_dir else tempfile.TemporaryDirectory()
    with work_ctx as work:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        # inductor keeps compiled kernels on disk across processes: a cache of its own (empty unless a
        # --work-dir is reused) makes compile_s what a first run pays, not a cache read
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))
        t0 = time.perf_counter()
        pngs = png_bytes(images)
        dataset = write_parquet(work / "dataset", pngs, labels)
        write_s = time.perf_counter() - t0
        ctx = dict(module=module, cfg=cfg, shape=shape, device=device, images=images, labels=labels, pngs=pngs,
                   transform=transform, work=work, dataset=dataset)
        model = new_model(module, cfg, shape, torch.device("cpu"))
        cnn, params = is_cnn(model), sum(p.numel() for p in model.parameters())
        threads = torch.get_num_threads()
        print(f"{args.recipe_name}: {type(model).__name__} {params:,} params, {n} synthetic images {shape}, "
              f"global batch {cfg.batch_size}, {args.steps} steps in windows of {args.log_every} (first dropped), "
              f"{args.repeats} rounds for pure/loader rows, device {device}, {threads} threads", flush=True)

        rows, levers, skipped = {}, {}, {}

        def measure(name: str, fn):
            print(f"  {name} ...", end=" ", flush=True)
            t = time.perf_counter()
            try:
                got = fn()
            except Exception as err:  # a row that failed is reported with its reason; the others still count
                why = (str(err).strip().splitlines() or [type(err).__name__])
                skipped[name] = f"{type(err).__name__}: {why[0]}"
                print(f"FAILED ({time.perf_counter() - t:.1f} s)\n{err}", flush=True)
                return
            rows.update(got if isinstance(got, dict) and "samples_per_s" not in got else {name: got})
            print(f"{time.perf_counter() - t:.1f} s", flush=True)

        measure("recipe", lambda: recipe_row(args, ctx, "recipe", 1, threads))
        measure("raw_torch", lambda: raw_row(args, ctx, threads))
        measure("pure rows and levers", lambda: pure_rows(args, ctx, skipped, levers))
        measure("loader rows", lambda: loader_rows(args, ctx, skipped))
        if "processes" in args.skip:
            skipped["processes"] = "--skip processes"
        else:
            if device.type == "cpu":
                measure("recipe_1proc_1thread", lambda: recipe_row(args, ctx, "recipe_1proc_1thread", 1, 1))
                measure("raw_torch_1proc_1thread", lambda: raw_row(args, ctx, 1))
            if device.type == "cuda" and torch.cuda.device_count() < 2:
                skipped["recipe_2proc"] = skipped["raw_ddp_2proc"] = (
                    f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
            elif cfg.batch_size % 2:
                skipped["recipe_2proc"] = skipped["raw_ddp_2proc"] = (
                    f"the global batch {cfg.batch_size} does not split over 2 processes")
            else:
                per_proc = 1 if device.type == "cpu" else threads
                measure("recipe_2proc", lambda: recipe_row(args, ctx, "recipe_2proc", 2, per_proc))
                measure("raw_ddp_2proc", lambda: raw_ddp_row(args, ctx, 2, per_proc))

        report = {
            "benchmark": "throughput", "recipe": args.recipe_name, "recipe_file": str(args.recipe_path),
            "created": datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
            "settings": {"recipe_args": args.recipe_argv, "config": {k: v for k, v in vars(cfg).items()
                                                                     if k != "explicit"},
                         "model": type(model).__name__, "params": params, "input_shape": list(shape),
                         "num_images": n, "global_batch": cfg.batch_size, "steps": args.steps,
                         "log_every": args.log_every, "runs": args.runs, "repeats": args.repeats,
                         "warmup": args.warmup, "precision": "fp32 (levers: as named)", "tiny": args.tiny,
                         "seed_workers": args.seed_workers, "compile_backend": args.compile_backend,
                         "skip": sorted(args.skip), "dataset_write_s": round(write_s, 1),
                         "work_dir": str(work) if args.work_dir else None},
            "machine": {**machine_info(device), "load_average_start": load_start, "load_average_end": load_average()},
            "versions": versions(), "rows": rows, "levers": levers,
            "ratios": compute_ratios(rows, levers, cnn, device), "skipped": skipped,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
    print()
    print(format_table(report))
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out_json} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    from common.launching import stop_children_on_term

    stop_children_on_term()  # a stopped benchmark leaves no recipe training
    sys.exit(main())
