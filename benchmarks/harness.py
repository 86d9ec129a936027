"""What the benchmarks share. For the throughput studies (throughput.py, scaling.py): the recipe
imported from its file with its Config from its own parser; synthetic data of its image shape written once as a Hub
parquet dataset; the recipe run end to end and read back; its step in plain PyTorch; the timing; the ratios
(PASS/MISS, never a failure); the report. For every benchmark: the per-sample PIL dataset a first version has, the
busy-machine warning, the machine and versions of each report, bad input as one paragraph and exit 2.
"""

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from launching import (  # noqa: E402
    import_recipe,
    launch_command,
    read_run,
    recipe_config,
    recipe_env,
    recipe_path,
    run_logged,
    shipped_recipes,
    stop_children_on_term,
)
from machine import load_average, machine_info, versions  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from common.data.augment import BatchTransform, batch_generator, channel_stats  # noqa: E402

NUM_CLASSES = 10
# Image shape of each recipe's default Hub dataset (a recipe reads its shape from the data).
DATASET_SHAPES = {
    "ylecun/mnist": (1, 28, 28),
    "mnist": (1, 28, 28),
    "zalando-datasets/fashion_mnist": (1, 28, 28),
    "fashion_mnist": (1, 28, 28),
    "uoft-cs/cifar10": (3, 32, 32),
    "cifar10": (3, 32, 32),
}
# --tiny: a small model of each shipped recipe (recipe flags), batch 32, 4 steps logged one by one.
TINY_MODEL = {"fashion_mnist_mlp": "--hidden 32", "mnist_convnet": "--width 8", "cifar_cnn": "--widths 8,16,16"}
PRESETS = {
    False: dict(steps=30, log_every=5, repeats=5, warmup=2),
    True: dict(steps=4, log_every=1, repeats=2, warmup=1),
}


def bad_input(message: str):
    """One paragraph on stderr, exit 2 (the recipes' bad-input code)."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


def warn_if_busy() -> list | None:
    """The load average now, with a warning when other work shares the cores (the numbers are then low and noisy)."""
    load = load_average()
    if load and load[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: the machine is busy (load average {load[0]} on {os.cpu_count()} CPUs): the numbers will be "
            "low and noisy; compare only what was measured in one run, on an idle machine",
            file=sys.stderr,
        )
    return load


def split_recipe_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:
        bad_input(
            f"--recipe-args {text!r} cannot be split like a shell line ({err}). Quote it as one string, e.g. "
            '--recipe-args "--channels 3 --image-size 32".'
        )


REVISION_VAR = "ACCELERATE_RECIPES_REVISION"  # where git is absent (the GPU machine's copy of the tree): the revision


def revision() -> str:
    """The repository's revision the benchmark runs: git's short hash, with '+ uncommitted changes' when tracked files
    differ from it; on a copy of the tree without git, ``$ACCELERATE_RECIPES_REVISION`` (the device command sets it,
    ``gpu_report.py --dry-run`` prints it filled in), else 'not known'."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        head = None
    if head is not None and head.returncode == 0 and head.stdout.strip():
        return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    given = os.environ.get(REVISION_VAR, "").strip()
    return f"{given} (as {REVISION_VAR} says: no git here)" if given else f"not known (no git here, no {REVISION_VAR})"


def provenance(study: str, argv, device, load_start) -> dict:
    """The command, when, the repository's revision, the machine (load average at the start and now, the end) and the
    library versions."""
    return {
        "benchmark": study,
        "created": datetime.now().isoformat(timespec="seconds"),
        "revision": revision(),
        "command": shlex.join([f"benchmarks/{study}.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {**machine_info(device), "load_average_start": load_start, "load_average_end": load_average()},
        "versions": versions(),
    }


def machine_line(m: dict) -> str:
    return (
        f"machine: {m['gpu'] or m['cpu']}, {m['cpus_usable']} CPUs, {m['torch_num_threads']} torch threads, flags "
        f"{' '.join(m['cpu_flags']) or '-'}, native bf16: {m['cpu_bf16_support']}, load average "
        f"{m['load_average_start']} -> {m['load_average_end']}"
    )


def save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")


class PerSampleImages(torch.utils.data.Dataset):
    """What a first version typically does, as torchvision's datasets do: one PIL image and one transform per
    sample, in Python, from PNG bytes (an image folder) or a uint8 (N, C, H, W) tensor (torchvision's MNIST)."""

    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        item = self.images[i]
        if isinstance(item, bytes):
            return self.transform(Image.open(io.BytesIO(item))), int(self.labels[i])
        arr = item.numpy()
        return self.transform(Image.fromarray(arr[0] if arr.shape[0] == 1 else arr.transpose(1, 2, 0))), int(
            self.labels[i]
        )


def first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def main(study: str, doc: str, argv, measure, add_args=lambda p: None) -> int:
    """A study's command line: the shared flags plus ``add_args``'s, then ``measure(bench)`` fills the rows and
    returns its ratios, {key: (label, value, op, target)}."""
    if argv is None:
        stop_children_on_term()  # a stopped benchmark leaves no recipe training
    p = argparse.ArgumentParser(
        prog=f"{study}.py", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", required=True, help="a recipe name (recipes/<name>.py) or a recipe file")
    p.add_argument("--recipe-args", default="", help='recipe flags for every row, e.g. "--width 32 --batch-size 256"')
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when a GPU is visible")
    p.add_argument("--steps", type=int, help="optimizer steps per recipe or plain-PyTorch run (default 30, --tiny 4)")
    p.add_argument("--log-every", type=int, help="steps per timed window (default 5, --tiny 1)")
    p.add_argument("--runs", type=int, default=1, help="runs per recipe or plain-PyTorch row; windows pooled")
    p.add_argument("--work-dir", type=Path, help="keep the dataset, runs and logs here (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one recipe run may take")
    p.add_argument("--tiny", action="store_true", help="smoke test: a small model, batch 32, 4 steps, 2 repeats")
    p.add_argument("--out-json", type=Path, help=f"default benchmarks/results/{study}-<recipe>-<hostname>.json")
    add_args(p)
    args = p.parse_args(argv)
    args.recipe_path = recipe_path(args.recipe)
    if not args.recipe_path.is_file():
        bad_input(
            f"--recipe {args.recipe}: there is no {args.recipe_path}. Name a shipped recipe "
            f"({', '.join(shipped_recipes())}) or give the path of a recipe file."
        )
    for key, value in PRESETS[args.tiny].items():
        if getattr(args, key, 0) is None:
            setattr(args, key, value)
    args.recipe_argv = split_recipe_args(args.recipe_args)
    if args.tiny:  # the user's own flags come last and win
        args.recipe_argv = [*TINY_MODEL.get(args.recipe_path.stem, "").split(), "--batch-size", "32", *args.recipe_argv]
    counts = {
        f"--{k.replace('_', '-')}": v
        for k, v in vars(args).items()
        if k in ("steps", "log_every", "runs", "repeats", "timeout", "warmup")
    }
    if min(v - (k != "--warmup") for k, v in counts.items()) < 0:
        bad_input(
            f"{', '.join(f'{k} {v}' for k, v in counts.items())}: --warmup must be at least 0, the others at least 1."
        )
    if args.steps < 2 * args.log_every or args.steps % args.log_every:
        bad_input(
            f"--steps {args.steps} must be a multiple of --log-every {args.log_every} and at least twice it: "
            "the first window is warm-up and is dropped, the others are timed. Pass e.g. "
            f"--steps {max(2, math.ceil(args.steps / args.log_every)) * args.log_every}."
        )
    args.out_json = (
        args.out_json
        or REPO / "benchmarks" / "results" / f"{study}-{args.recipe_path.stem}-{socket.gethostname()}.json"
    )
    return Bench(study, args).run(measure, argv)


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


def write_parquet(root: Path, images: torch.Tensor, labels: torch.Tensor) -> list[bytes]:
    """The images as PNGs in a folder laid out like a Hub dataset repo (data/train-00000-of-00001.parquet), what
    the recipe's --dataset reads; returns the PNGs."""
    from datasets import ClassLabel, Dataset, Features, Image
    from PIL import Image as PILImage

    pngs = []
    for arr in images.permute(0, 2, 3, 1).numpy():
        buf = io.BytesIO()
        PILImage.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    (root / "data").mkdir(parents=True, exist_ok=True)
    features = Features({"image": Image(), "label": ClassLabel(names=[f"class_{k}" for k in range(NUM_CLASSES)])})
    Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in pngs], "label": labels.tolist()}, features=features
    ).to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
    return pngs


def batch_transform(cfg, images):
    """The recipe's on-device augmentation (common.data.augment.BatchTransform), from its config and these images
    (cifar_cnn's alternating flip, made in its loader, is timed here as a random flip on the device)."""
    return BatchTransform(
        *channel_stats(images),
        translate=getattr(cfg, "translate", 0),
        flip=getattr(cfg, "flip", "none") != "none",
        channels_last=getattr(cfg, "channels_last", False),
    )


def time_rounds(runners: dict, warmup: int, repeats: int, steps: int, device) -> dict:
    """``warmup`` steps of each runner, then ``repeats`` rounds in which each runner takes ``steps`` steps in
    turn (drift of the machine hits all of them alike). {name: [seconds per round]}."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for step in runners.values():
        for _ in range(warmup):
            step()
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for name, step in runners.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def time_windows(step, steps: int, window: int, device) -> list[float]:
    """Seconds of each window of ``window`` steps, the first (warm-up) one dropped, as a recipe's windows are read."""
    return time_rounds({"": step}, 0, steps // window, window, device)[""][1:]


def recipe_windows(rows: list[dict]) -> list[dict]:
    """A recipe run's throughput windows (its metrics.jsonl rows with samples/s) after the first, the warm-up."""
    return [r for r in rows if "train/samples_per_sec" in r][1:]


def summarize(samples_per_s: list[float], **info) -> dict:
    """Median samples/s over the timed windows or rounds, their spread ((max - min) / median), and the list."""
    med = statistics.median(samples_per_s)
    return {
        "samples_per_s": med,
        "spread": (max(samples_per_s) - min(samples_per_s)) / med,
        "n": len(samples_per_s),
        "samples_per_s_each": [round(v, 3) for v in samples_per_s],
        **info,
    }


def timed_row(seconds: list[float], samples: int, processes: int = 1, threads: int | None = None, **info) -> dict:
    """A row timed in this process (or its spawned ranks): ``samples`` samples in each of ``seconds``."""
    return summarize(
        [samples / s for s in seconds],
        source="timed in the benchmark",
        processes=processes,
        threads=threads or torch.get_num_threads(),
        **info,
    )


def new_model(module, cfg, shape, device, channels_last: bool | None = None):
    """build_model from the recipe, in the memory format the recipe uses (cfg.channels_last) unless told."""
    torch.manual_seed(cfg.seed)  # every row starts from the same weights
    model = module.build_model(cfg, shape, NUM_CLASSES)
    if getattr(cfg, "channels_last", False) if channels_last is None else channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.to(device).train()


def tensor_batches(images, labels, batch: int, seed: int, rank: int = 0, world: int = 1):
    """(epoch, index, images, labels) forever: each epoch a seeded permutation cut into global batches, rank r
    taking the r-th slice of each (what a DistributedSampler gives, without a DataLoader)."""
    n, epoch = labels.numel(), 0
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(n // (batch * world)):
            idx = perm[(i * world + rank) * batch : (i * world + rank + 1) * batch]
            yield epoch, i, images[idx], labels[idx]
        epoch += 1


def raw_step(module, cfg, shape, device, stream, transform, rank: int = 0, world: int = 1):
    """The recipe's step in plain PyTorch: its model and optimizer (DDP when world > 1), the same BatchTransform,
    cross-entropy with its label smoothing, the gradient norm and the 4-number all-reduce of the non-finite guard,
    both on every step and read at once. The recipe measures the norm at log steps only and reads the guard a step
    late, so this loop pays a little more than the recipe does: overheads against it lean in the recipe's favour."""
    model = new_model(module, cfg, shape, device)
    optimizer = module.build_optimizer(cfg, model)
    if world > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    zero = torch.zeros((), device=device)

    def step():
        epoch, i, images, labels = next(stream)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        x = transform.train(images, batch_generator(cfg.seed, epoch, i, rank)) if transform else images
        loss = F.cross_entropy(model(x).float(), labels, label_smoothing=getattr(cfg, "label_smoothing", 0.0))
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


class Bench:
    """The recipe (module, config, image shape), its synthetic data and transform, and what was measured."""

    def __init__(self, study: str, args):
        self.study, self.args = study, args
        if args.device == "cpu":  # before CUDA starts: the recipe's Accelerator then picks the CPU too
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if args.device == "cuda" and not torch.cuda.is_available():
            bad_input("--device cuda, but torch sees no CUDA GPU. Use --device cpu.")
        self.device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
        self.module = import_recipe(args.recipe_path, prefix="_bench_recipe")
        missing = [n for n in ("Config", "build_model", "build_optimizer", "main") if not hasattr(self.module, n)]
        if missing:
            bad_input(
                f"{args.recipe_path} has no {', '.join(missing)}: the benchmark uses the recipe's Config, "
                "build_model(cfg, in_shape, num_classes) and build_optimizer(cfg, model)."
            )
        try:
            self.cfg = cfg = recipe_config(args.recipe_path, args.recipe_argv)
        except SystemExit:
            bad_input(
                f"--recipe-args {shlex.join(args.recipe_argv)!r} is not a valid command line for the recipe "
                "(its message is above)."
            )
        if cfg.grad_accum != 1:
            bad_input(
                f"--grad-accum {cfg.grad_accum}: the plain-PyTorch rows take one optimizer step per batch; "
                "benchmark with --grad-accum 1."
            )
        c, h, w = DATASET_SHAPES.get(cfg.dataset, (0, 0, 0))  # the recipe's flags, where given, say otherwise
        self.shape = (cfg.channels or c, cfg.image_size or h, cfg.image_size or w)
        if not min(self.shape):
            bad_input(
                f"the recipe's default dataset {cfg.dataset!r} has no known image shape: give the synthetic "
                'images one with --recipe-args "--channels C --image-size S".'
            )
        # Enough images that --steps fit in the recipe's first epoch after it holds out --val-fraction: an epoch
        # end (evaluation, checkpoint) inside a timed window would be timed too.
        self.num_images = math.ceil((args.steps + 1) * cfg.batch_size / (1 - cfg.val_fraction)) + 1
        self.images, self.labels = synthetic_images(self.shape, self.num_images)
        self.transform = batch_transform(cfg, self.images)
        self.rows, self.skipped, self.extra = {}, {}, {}

    def measure(self, name: str, fn) -> None:
        """Run one row (or a dict of rows); one that fails is reported with its reason, the others still count."""
        print(f"  {name} ...", end=" ", flush=True)
        t = time.perf_counter()
        try:
            got = fn()
            self.rows.update(got if "samples_per_s" not in got else {name: got})
            print(f"{time.perf_counter() - t:.1f} s", flush=True)
        except Exception as err:
            self.skipped[name] = first_line(err)
            print(f"FAILED ({time.perf_counter() - t:.1f} s)\n{err}", flush=True)

    def recipe_row(self, name: str, nproc: int, threads: int) -> dict:
        """The recipe itself, end to end (`python recipes/<r>.py`, or `accelerate launch` with cpu_2proc.yaml for
        2 processes), fp32; samples/s from its metrics.jsonl windows after the first."""
        args, runs = self.args, []
        for k in range(args.runs):
            run_dir, log = self.work / "runs" / f"{name}-{k}", self.work / "runs" / f"{name}-{k}.log"
            own = ["--dataset", self.dataset, "--output-dir", run_dir, "--cache-dir", self.work / "cache"]
            own += ["--max-steps", args.steps, "--log-every", args.log_every, "--epochs", 1]
            cmd = launch_command(
                args.recipe_path,
                [*args.recipe_argv, *own],
                nproc=0 if nproc == 1 else nproc,
                config="cpu_2proc.yaml",
                threads=threads,
                extra_launch=["--num_processes", nproc],
            )
            env = recipe_env(self.work, threads=threads, cpu_only=self.device.type == "cpu")
            code, wall = run_logged(cmd, env, log, args.timeout)
            written = read_run(run_dir)
            windows = recipe_windows(written["rows"])
            if code != 0 or not windows:
                tail = "\n".join(log.read_text().splitlines()[-15:])
                raise RuntimeError(f"exit {code}, {len(windows)} timed windows; command: {shlex.join(cmd)}\n{tail}")
            runs.append(
                {
                    "run_dir": str(run_dir),
                    "command": shlex.join(cmd),
                    "log": str(log),
                    "process_wall_s": round(wall, 1),
                    "windows": [w["train/samples_per_sec"] for w in windows],
                    "data_wait_fraction": [w.get("train/data_wait_fraction") for w in windows],
                    **{k: written["summary"].get(k) for k in ("status", "precision", "processes", "device")},
                }
            )
        waits = [w for r in runs for w in r["data_wait_fraction"] if w is not None]
        return summarize(
            [w for r in runs for w in r["windows"]],
            source="metrics.jsonl",
            processes=nproc,
            threads=threads,
            data_wait_fraction=statistics.median(waits) if waits else None,
            global_batch=self.cfg.batch_size,
            runs=runs,
        )

    def raw_row(self, threads: int, stream_of=None, transform=True) -> dict:
        """raw_step in this process at ``threads`` threads, over tensor batches of the images (or ``stream_of()``)."""
        args, cfg, before, windows = self.args, self.cfg, torch.get_num_threads(), []
        torch.set_num_threads(threads)
        try:
            for k in range(args.runs):
                stream = (
                    stream_of() if stream_of else tensor_batches(self.images, self.labels, cfg.batch_size, cfg.seed + k)
                )
                step = raw_step(self.module, cfg, self.shape, self.device, stream, transform and self.transform)
                windows += time_windows(step, args.steps, args.log_every, self.device)
        finally:
            torch.set_num_threads(before)
        return timed_row(windows, args.log_every * cfg.batch_size, threads=threads, global_batch=cfg.batch_size)

    def ratio(self, a: str, b: str, scale: float = 1.0):
        rows = self.rows
        return rows[a]["samples_per_s"] / (scale * rows[b]["samples_per_s"]) if a in rows and b in rows else None

    def overhead_pct(self, recipe: str, raw: str):
        """Extra time per step of the recipe over the plain-PyTorch step, in %."""
        r = self.ratio(raw, recipe)
        return None if r is None else (r - 1) * 100

    def run(self, measure, argv) -> int:
        args, cfg = self.args, self.cfg
        t_start, load_start = time.perf_counter(), warn_if_busy()
        with contextlib.nullcontext(args.work_dir) if args.work_dir else tempfile.TemporaryDirectory() as work:
            self.work = Path(work)
            self.work.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            self.dataset = self.work / "dataset"
            write_parquet(self.dataset, self.images, self.labels)
            write_s = time.perf_counter() - t0
            model = new_model(self.module, cfg, self.shape, torch.device("cpu"))
            self.cnn = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
            params = sum(p.numel() for p in model.parameters())
            print(
                f"{self.study}: {args.recipe_path.stem}, {type(model).__name__} {params:,} params, {self.num_images} "
                f"synthetic images {self.shape}, global batch {cfg.batch_size}, {args.steps} steps in windows of "
                f"{args.log_every} (first dropped), device {self.device}, {torch.get_num_threads()} threads"
            )
            ratios = judge(measure(self))
            keep = ("steps", "log_every", "runs", "repeats", "warmup", "tiny", "compile_backend", "skip")
            report = {
                **provenance(self.study, argv, self.device, load_start),
                "recipe": args.recipe_path.stem,
                "recipe_file": str(args.recipe_path),
                "settings": {
                    "recipe_args": args.recipe_argv,
                    "config": {k: v for k, v in vars(cfg).items() if k != "explicit"},
                    "model": type(model).__name__,
                    "params": params,
                    "input_shape": list(self.shape),
                    "num_images": self.num_images,
                    "global_batch": cfg.batch_size,
                    "precision": "fp32 (levers: as named)",
                    "dataset_write_s": round(write_s, 1),
                    "work_dir": str(self.work) if args.work_dir else None,
                    **{k: v for k, v in vars(args).items() if k in keep},
                },
                "rows": self.rows,
                **self.extra,
                "ratios": ratios,
                "skipped": self.skipped,
                "wall_s": round(time.perf_counter() - t_start, 1),
            }
        print(f"\n{format_table(report)}\n")
        save(report, args.out_json)
        return 0


def judge(table: dict) -> dict:
    """{key: (label, value, op, target)} -> each with its status: PASS/MISS against a target, info, or n/a."""
    out = {}
    for key, (label, value, op, target) in table.items():
        ok = op is not None and value is not None and (value >= target if op == ">=" else value <= target)
        out[key] = {
            "label": label,
            "value": value,
            "op": op,
            "target": target,
            "status": "n/a" if value is None else "info" if op is None else "PASS" if ok else "MISS",
        }
    return out


def ratio_lines(ratios: dict) -> list[str]:
    """The judged ratios (``judge``'s) as table lines: label, value, target, result."""
    width = max(len(r["label"]) for r in ratios.values())
    lines = ["", f"{'ratio':<{width}}{'value':>9}  {'target':<8}result"]
    for r in ratios.values():
        value = "-" if r["value"] is None else f"{r['value']:.2f}"
        target = "" if r["op"] is None else f"{r['op']} {r['target']:g}"
        lines.append(f"{r['label']:<{width}}{value:>9}  {target:<8}{r['status']}")
    return lines


def format_table(report: dict) -> str:
    lines = [
        machine_line(report["machine"]),
        "",
        f"{'row':<26}{'samples/s':>12}{'spread':>8}{'n':>4}{'procs':>6}{'thr':>5}  source",
    ]
    lines += [
        f"{key:<26}{v['samples_per_s']:>12,.1f}{v['spread']:>8.1%}{v['n']:>4}{v['processes']:>6}{v['threads']:>5}"
        f"  {v['source']}"
        for key, v in report["rows"].items()
    ]
    lines += ratio_lines(report["ratios"])
    return "\n".join(lines + [f"not measured {what}: {why}" for what, why in report["skipped"].items()])
