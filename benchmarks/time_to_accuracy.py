#!/usr/bin/env python
"""Time-to-accuracy benchmark: wall time until a recipe first reaches a validation accuracy, side by side
with the script a user would otherwise run, on the same split, threads and machine, over several seeds.

For each seed:

  recipe    the real recipe, launched as users launch it (a subprocess: `python recipes/<recipe>.py` for
            1 process, `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml ...` for 2),
            with --dataset D --output-dir <tmp run> --seed S --eval-every-steps N and --recipe-args. The
            benchmark reads what the run wrote: <run>/metrics.jsonl (eval/accuracy rows, unix "time")
            and <run>/summary.json ("status", "timing": {"train_start", "compile_s"}).
            time to target = "time" of the first row with eval/accuracy >= target - train_start - compile_s
  baseline  for cifar_cnn: the CIFAR-10 notebook this project grew from (BASELINES["cifar_notebook"]: a
            64-128-256 BatchNorm CNN with a 512 hidden layer and dropout, SGD lr 0.1 momentum 0.9 weight
            decay 5e-4, cosine over 10 epochs of which it runs 3, batch 128, per-sample torchvision random
            crop and flip). With --target baseline it runs all its epochs and both sides are timed to the
            accuracy it ends with.
            For the MNIST recipes: the pytorch/examples MNIST script (mnist/main.py) as published: Net = conv(C->32,3x3) ReLU,
            conv(32->64,3x3) ReLU, maxpool 2, dropout 0.25, fc(->128) ReLU, dropout 0.5, fc(->classes),
            log_softmax + nll_loss; Adadelta lr 1.0; StepLR(step_size=1, gamma=0.7) per epoch; batch 64,
            eval batch 1000; a torch DataLoader over per-sample PIL images with ToTensor() +
            Normalize((0.1307,), (0.3081,)) (what torchvision's MNIST dataset does). It trains in this
            process on the recipe's own split (common.data.load_image_data with the same --seed and
            --val-fraction), with torch.set_num_threads(--threads), until --baseline-target or
            --max-baseline-epochs.
            time to target = end of the first evaluation with accuracy >= target - start of its first step

What both times include and exclude, alike on both sides:
  - included: training and every evaluation up to the crossing. Both sides evaluate at the end of each
    epoch and, with --eval-every-steps N, also every N recipe optimizer steps; the baseline then
    evaluates after the same number of training images (N x the recipe's global batch / 64 of its steps).
    The seconds spent evaluating are reported next to each time (measured for the baseline; estimated
    for the recipe from the gaps between its metrics.jsonl rows, counting what it does after logging an
    evaluation: TensorBoard images, best/ weights).
  - the recipe's eval row is time-stamped when its scalars are logged. Its final evaluation is logged at
    the last step, into the line of the last epoch's evaluation, and moves that line's time past the
    epoch-end bookkeeping and the final evaluation: a crossing there is flagged (time_is_upper_bound)
    and warned about.
  - excluded: the one-time dataset decode (measured once here, first load into a fresh recipe cache,
    reported as decode_s; the recipe runs then read that cache), the recipe's compile time (reported
    as compile_s), process start, imports, and setup before the first training step. The recipe also
    writes checkpoints at epoch ends; that is part of its time (users pay it too).

It prints a table per seed (recipe time, baseline time or "not reached in N epochs" with its best
accuracy, ratio = baseline / recipe), then median, mean and spread (min-max) over the seeds and the
machine, and writes everything, eval curves included, to JSON (default
benchmarks/results/time_to_accuracy-<recipe>.json). It never fails on a slow result.

    python benchmarks/time_to_accuracy.py --recipe mnist_convnet --dataset ../shared/data/mnist \\
        --target 0.993 --baseline-target 0.99 --seeds 1,2,3
    python benchmarks/time_to_accuracy.py --recipe fashion_mnist_mlp --dataset ../shared/data/fashion_mnist \\
        --target 0.90 --baseline off
    python benchmarks/time_to_accuracy.py --recipe cifar_cnn --dataset ../shared/data/cifar10 --target baseline \\
        --eval-every-steps 10 --nproc 2
    python benchmarks/time_to_accuracy.py --recipe mnist_convnet --dataset ../shared/data/mnist \\
        --target 0.993 --baseline-target 0.99 --device cuda                  # the same, on a GPU

Numbers are only comparable on an otherwise idle machine: the load average is recorded at the start
and the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.launching import launch_command, read_run  # noqa: E402
from common.launching import recipe_env as shared_recipe_env  # noqa: E402
from common.machine import load_average, machine_info, versions  # noqa: E402

EXIT_BAD_INPUT = 2
RECIPES = ("fashion_mnist_mlp", "mnist_convnet", "cifar_cnn")
# Flags the benchmark sets itself on the recipe command line (per seed, per run directory).
OWN_FLAGS = ("--dataset", "--output-dir", "--seed", "--eval-every-steps", "--resume-from")
# The recipe flags that decide what the decoded data and the held-out split are; the benchmark must
# decode and split exactly as the recipe does, so it reads these from --recipe-args.
DATA_FLAGS = {"--val-fraction": float, "--image-size": int, "--channels": int, "--image-column": str,
              "--label-column": str, "--cache-dir": str}
# The script a user would otherwise run, per recipe: pytorch/examples mnist/main.py's defaults for the MNIST
# recipes; for cifar_cnn the CIFAR-10 notebook this project grew from (a 64-128-256 BatchNorm CNN).
BASELINES = {
    "mnist_example": dict(batch_size=64, test_batch_size=1000, lr=1.0, gamma=0.7, mean=0.1307, std=0.3081,
                          log_interval=10, epochs=14, model="pytorch/examples mnist Net", optimizer="Adadelta",
                          schedule="StepLR(step_size=1, gamma=0.7) per epoch",
                          pipeline="per-sample PIL + ToTensor + Normalize in a torch DataLoader"),
    "cifar_notebook": dict(batch_size=128, test_batch_size=1000, lr=0.1, momentum=0.9, weight_decay=5e-4, t_max=10,
                           mean=0.5, std=0.5, log_interval=10, epochs=3,
                           model="SimpleCNN: 3 x (conv3x3 BN ReLU maxpool) 64-128-256, fc 512 dropout 0.5, fc",
                           optimizer="SGD lr 0.1 momentum 0.9 weight decay 5e-4",
                           schedule="CosineAnnealingLR(T_max=10) per epoch, 3 epochs run",
                           pipeline="per-sample PIL + RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor "
                                    "+ Normalize(0.5, 0.5) in a torch DataLoader"),
}


def baseline_kind(recipe: str) -> str:
    return "cifar_notebook" if recipe == "cifar_cnn" else "mnist_example"


# summary.json statuses of a run that trained to its end (target_missed: its --target-accuracy check failed).
FINISHED = ("completed", "target_missed")
# Keys of the recipes' final evaluation. It is logged at the last step, into the line of the last epoch's
# evaluation, and moves that line's "time" past itself: such a point's time is an upper bound.
FINAL_EVAL_KEYS = ("val/accuracy", "test/accuracy")


class BadInput(Exception):
    """A one-paragraph message about the command line; main() prints it and exits 2."""


# --- the crossing: pure functions ------------------------------------------------------------------

def first_crossing(points, target: float) -> int | None:
    """Index of the first point (in the order given: evaluation order) whose "accuracy" is >= target;
    None if none is. Equality counts as reached. Missing or NaN accuracies never count. A later dip
    below the target does not matter: the first crossing is when a user could have stopped."""
    for i, p in enumerate(points):
        acc = p.get("accuracy")
        if acc is not None and not math.isnan(acc) and acc >= target:
            return i
    return None


def crossing_report(points: list[dict], target: float) -> dict:
    """The crossing summarized: reached, time_to_target_s (the point's time_s), its step and accuracy,
    the number of evaluations up to and including it, the best accuracy seen, and eval_s_included: the
    evaluation seconds inside the time to target, i.e. every point's eval_s up to the crossing plus the
    post_eval_s (work done after an evaluation was logged) of the points before it. None when a point
    lacks them."""
    i = first_crossing(points, target)
    accs = [p["accuracy"] for p in points if p.get("accuracy") is not None and not math.isnan(p["accuracy"])]
    upto = points[: i + 1] if i is not None else points
    parts = [p.get("eval_s") for p in upto] + [p.get("post_eval_s", 0.0) for p in upto[:-1]]
    if i is None and upto:
        parts.append(upto[-1].get("post_eval_s", 0.0))
    return {"reached": i is not None, "time_to_target_s": points[i]["time_s"] if i is not None else None,
            "step": points[i].get("step") if i is not None else None,
            "accuracy": points[i]["accuracy"] if i is not None else None,
            "evals": len(upto), "best_accuracy": max(accs) if accs else None,
            "eval_s_included": sum(parts) if upto and None not in parts else None}


def recipe_eval_points(rows: list[dict], train_start: float, compile_s: float = 0.0) -> list[dict]:
    """The eval rows of a recipe's metrics.jsonl as points: time_s = row "time" - train_start - compile_s
    (the row's time is taken when the evaluation's scalars were logged, after it ran), step, accuracy,
    loss, eval_s and post_eval_s (estimates, see estimate_eval_seconds), and time_includes_final_eval
    (the final evaluation was merged into the row, so its time is late by that evaluation)."""
    estimates = estimate_eval_seconds(rows, train_start)
    points = []
    for row, (eval_s, post_s) in zip(rows, estimates):
        if "eval/accuracy" not in row:
            continue
        exact = "eval_time" in row  # the recipes record when each evaluation finished and how long it took
        points.append({"time_s": row.get("eval_time", row["time"]) - train_start - compile_s, "step": row.get("step"),
                       "accuracy": float(row["eval/accuracy"]), "loss": row.get("eval/loss"),
                       "eval_s": row.get("eval_seconds", eval_s), "post_eval_s": post_s,
                       "time_includes_final_eval": not exact and any(k in row for k in FINAL_EVAL_KEYS)})
    return points


def estimate_eval_seconds(rows: list[dict], train_start: float) -> list[tuple[float | None, float | None]]:
    """Per row, for an eval row: (eval_s, post_eval_s), the seconds beyond training in its own gap to the
    previous row (the evaluation itself) and in the next row's gap (what the recipe does after logging an
    evaluation: its images for TensorBoard, the best/ weights, at epoch ends the checkpoint). Training is
    counted at the median seconds per step of the gaps with no evaluation on either side. (None, None)
    for other rows, and for all rows when no such gap exists. Estimates: metrics.jsonl holds no
    evaluation durations."""
    gaps, prev_t, prev_step = [], train_start, 0
    for row in rows:
        step = row.get("step", prev_step)
        gaps.append((row["time"] - prev_t, step - prev_step))
        prev_t, prev_step = row["time"], step
    is_eval = ["eval/accuracy" in row for row in rows]
    rates = [dt / ds for k, (dt, ds) in enumerate(gaps)
             if k > 0 and ds > 0 and not is_eval[k] and not is_eval[k - 1]]  # gap 0 holds the warm-up
    if not rates:
        return [(None, None)] * len(rows)
    rate = statistics.median(rates)

    def excess(k):
        dt, ds = gaps[k]
        return max(0.0, dt - rate * max(ds, 0))

    return [(excess(k), excess(k + 1) if k + 1 < len(rows) else 0.0) if is_eval[k] else (None, None)
            for k in range(len(rows))]


def read_recipe_run(run_dir: Path) -> dict:
    """What a finished recipe run wrote, checked: summary (status, timing), metrics rows, config."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise RuntimeError(f"the recipe run {run_dir} wrote no summary.json, so it did not finish.")
    summary = json.loads(summary_path.read_text())
    if summary.get("status", "completed") not in FINISHED:
        raise RuntimeError(f"the recipe run {run_dir} ended with status {summary.get('status')!r}, so it did not "
                           "train to the end.")
    timing = summary.get("timing") or {}
    if "train_start" not in timing:
        raise RuntimeError(f"{summary_path} has no timing.train_start (the unix time just before the first "
                           "training step), which the time to target is measured from.")
    written = read_run(run_dir)
    rows, config = written["rows"], written["config"]
    return {"summary": summary, "rows": rows, "config": config, "train_start": float(timing["train_start"]),
            "compile_s": float(timing.get("compile_s") or 0.0)}


def spread(values: list[float]) -> dict | None:
    """median, mean, min, max, n of the values (None when there are none)."""
    if not values:
        return None
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "min": min(values),
            "max": max(values), "n": len(values)}


# --- command line ------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, choices=RECIPES)
    p.add_argument("--dataset", required=True, help="dataset folder (or Hub id), e.g. ../shared/data/mnist")
    p.add_argument("--target", required=True,
                   help="validation accuracy for the recipe, e.g. 0.993; or 'baseline': each seed's baseline runs "
                        "all its epochs and the target on both sides is the accuracy it ends with")
    p.add_argument("--baseline-target", type=float, help="validation accuracy for the baseline (default: --target)")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (>= 3 for a median worth quoting)")
    p.add_argument("--nproc", type=int, default=1, choices=[1, 2],
                   help="recipe processes: 1 = python recipes/<recipe>.py, 2 = accelerate launch with "
                        "accelerate_configs/cpu_2proc.yaml (2 GPUs with --device cuda)")
    p.add_argument("--accelerate-config", help="launch the recipe with `accelerate launch --config_file` this "
                                               "file instead (e.g. for bf16); --nproc must match it")
    p.add_argument("--recipe-args", default="",
                   help='extra recipe flags, one string, e.g. "--channels 3 --image-size 32"')
    p.add_argument("--eval-every-steps", type=int, default=0,
                   help="also evaluate every N recipe optimizer steps (0 = at epoch ends only, on both sides)")
    p.add_argument("--baseline-eval-every-steps", type=int,
                   help="baseline steps between evaluations (default: the same number of training images as "
                        "--eval-every-steps recipe steps)")
    p.add_argument("--max-baseline-epochs", type=int,
                   help="default: the baseline script's own (14 for the MNIST example, 3 for the CIFAR notebook)")
    p.add_argument("--baseline", default="on", choices=["on", "off"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads in all: the baseline's, split evenly over the recipe's processes "
                        "(default: every CPU)")
    p.add_argument("--goal-seconds", type=float, help="print PASS/MISS for the mean recipe time against this")
    p.add_argument("--goal-ratio", type=float, help="print PASS/MISS for the mean ratio against this")
    p.add_argument("--timeout", type=int, default=3600, help="seconds one recipe run may take")
    p.add_argument("--work-dir", type=Path, help="keep the decoded cache and the run folders here "
                                                 "(default: a temporary folder, deleted at the end)")
    p.add_argument("--out", type=Path, help="JSON report (default benchmarks/results/time_to_accuracy-<recipe>.json)")
    args = p.parse_args(argv)
    try:
        validate(args)
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    return args


def validate(args) -> None:
    args.baseline_kind = baseline_kind(args.recipe)
    if args.max_baseline_epochs is None:
        args.max_baseline_epochs = BASELINES[args.baseline_kind]["epochs"]
    args.target_from_baseline = args.target == "baseline"
    if args.target_from_baseline:
        if args.baseline != "on" or args.baseline_target is not None:
            raise BadInput("--target baseline takes the target from the baseline's final accuracy: it needs "
                           "--baseline on and no --baseline-target.")
        args.target = args.baseline_target = math.inf  # set per seed, once the baseline has run
    else:
        try:
            args.target = float(args.target)
        except ValueError:
            raise BadInput(f"--target {args.target!r} is neither an accuracy (e.g. 0.99) nor 'baseline'.") from None
    if args.baseline_target is None:
        args.baseline_target = args.target
    for flag, value in (("--target", args.target), ("--baseline-target", args.baseline_target)):
        if args.target_from_baseline:
            break
        if 1 < value <= 100:
            raise BadInput(f"{flag} {value:g} looks like a percentage; accuracies here are fractions. "
                           f"Pass {flag} {value / 100:g}.")
        if not 0 < value <= 1:
            raise BadInput(f"{flag} {value:g} is not an accuracy: pass a fraction in (0, 1], e.g. 0.99.")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        args.seed_list = []
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        raise BadInput(f"--seeds {args.seeds!r} is not a list of distinct integers. Pass e.g. --seeds 1,2,3.")
    if args.eval_every_steps < 0 or (args.baseline_eval_every_steps or 0) < 0:
        raise BadInput("--eval-every-steps and --baseline-eval-every-steps must be >= 0 (0 = at epoch ends only).")
    if args.max_baseline_epochs < 1 or args.threads < 1 or args.timeout < 1:
        raise BadInput("--max-baseline-epochs, --threads and --timeout must be >= 1.")
    if args.threads < args.nproc:
        raise BadInput(f"--threads {args.threads} is fewer than --nproc {args.nproc}: every recipe process needs "
                       "at least one thread. Raise --threads or lower --nproc.")
    try:
        args.recipe_argv = shlex.split(args.recipe_args)
    except ValueError as err:
        raise BadInput(f"--recipe-args {args.recipe_args!r} cannot be split like a shell line ({err}). "
                       "Quote it as one string, e.g. --recipe-args \"--channels 3 --image-size 32\".") from None
    own = [a for a in args.recipe_argv if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        raise BadInput(f"--recipe-args sets {', '.join(own)}, which the benchmark sets itself for every seed. "
                       "Use the benchmark's --dataset, --seeds and --eval-every-steps instead.")
    if args.accelerate_config and not Path(args.accelerate_config).is_file():
        raise BadInput(f"--accelerate-config {args.accelerate_config} is not a file. Pass one of the shipped "
                       "configs under accelerate_configs/ or your own.")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInput("--device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False). "
                           "Run on a GPU machine, or pass --device cpu.")
        if torch.cuda.device_count() < args.nproc:
            raise BadInput(f"--nproc {args.nproc} with --device cuda needs {args.nproc} GPUs; this machine shows "
                           f"{torch.cuda.device_count()}. Pass --nproc 1.")
    args.out = args.out or REPO / "benchmarks" / "results" / f"time_to_accuracy-{args.recipe}.json"


def data_settings(recipe_argv: list[str]) -> dict:
    """The data flags among the recipe arguments (--val-fraction 0.2 or --val-fraction=0.2), typed."""
    found = {}
    for i, arg in enumerate(recipe_argv):
        name, eq, value = arg.partition("=")
        if name in DATA_FLAGS:
            if not eq:
                if i + 1 >= len(recipe_argv):
                    raise BadInput(f"--recipe-args ends with {name} and no value. Give it one, e.g. {name} 0.1.")
                value = recipe_argv[i + 1]
            try:
                found[name[2:].replace("-", "_")] = DATA_FLAGS[name](value)
            except ValueError:
                raise BadInput(f"--recipe-args has {name} {value!r}, which is not a "
                               f"{DATA_FLAGS[name].__name__}.") from None
    return found


def data_config(args, seed: int, cache_dir: Path):
    """The settings load_image_data reads, as the recipe will have them: the common defaults, the data
    flags of --recipe-args, this dataset and seed."""
    from common.config import CommonConfig

    values = {f.name: f.default for f in dataclasses.fields(CommonConfig)
              if f.default is not dataclasses.MISSING}
    values.update(data_settings(args.recipe_argv), dataset=args.dataset, seed=seed)
    values["cache_dir"] = values.get("cache_dir") or str(cache_dir)
    return types.SimpleNamespace(**values)


def load_split(args, seed: int, cache_dir: Path):
    """The recipe's data for this seed: its loader, its cache, its hold-out. Returns (train, val)."""
    from common.data import load_image_data
    from common.errors import RecipeError

    try:
        data = load_image_data(data_config(args, seed, cache_dir), args.dataset, True, log=lambda *a: None)
    except RecipeError as err:
        raise BadInput(str(err)) from None
    if data.val is None:
        raise BadInput(f"{args.dataset} has no validation split and --val-fraction is 0, so there is nothing to "
                       "measure accuracy on. Drop --val-fraction 0 from --recipe-args.")
    return data.train, data.val


# --- the baseline: pytorch/examples mnist/main.py, written from its description ------------------------

def baseline_net(in_channels: int, height: int, width: int, num_classes: int):
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128)  # 9216 for 28x28
            self.fc2 = nn.Linear(128, num_classes)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = self.dropout1(F.max_pool2d(x, 2))
            x = F.relu(self.fc1(x.flatten(1)))
            return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)

    return Net()


class PerSampleImages:
    """torchvision's MNIST dataset, on the recipe's decoded uint8 tensors: every __getitem__ makes a
    PIL image and runs the transforms on it, one sample at a time in Python."""

    def __init__(self, split, transform):
        # One private in-memory copy of the split's rows, as torchvision's MNIST holds its tensor.
        self.images, self.labels, self.transform = split.images.contiguous(), split.labels.contiguous(), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        arr = self.images[i].numpy()
        img = Image.fromarray(arr[0] if arr.shape[0] == 1 else arr.transpose(1, 2, 0))
        return self.transform(img), int(self.labels[i])


def cifar_notebook_net(in_channels: int, height: int, width: int, num_classes: int):
    """The CIFAR notebook's SimpleCNN (logits out; its loss is CrossEntropyLoss)."""
    import torch.nn as nn

    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2, 2)]

    return nn.Sequential(*block(in_channels, 64), *block(64, 128), *block(128, 256), nn.Flatten(),
                         nn.Linear(256 * (height // 8) * (width // 8), 512), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(512, num_classes))


def run_baseline(train, val, target: float, *, seed: int, max_epochs: int, eval_every_steps: int = 0,
                 device: str = "cpu", log=lambda msg: None, kind: str = "mnist_example") -> dict:
    """Train the baseline ``kind`` (``BASELINES``) on ``train`` (an ImageSplit), evaluating on ``val`` at
    every epoch end and every ``eval_every_steps`` steps, until the first evaluation at >= target or
    ``max_epochs``. Returns the crossing report plus the curve, epochs run and training seconds."""
    import torch
    import torch.nn.functional as F
    from torchvision import transforms

    spec = BASELINES[kind]
    dev = torch.device(device)
    channels, height, width = train.image_shape if hasattr(train, "image_shape") else train.images.shape[1:]
    normalize = transforms.Normalize((spec["mean"],) * channels, (spec["std"],) * channels)
    transform = eval_transform = transforms.Compose([transforms.ToTensor(), normalize])
    if kind == "cifar_notebook":
        transform = transforms.Compose([transforms.RandomCrop(height, padding=4), transforms.RandomHorizontalFlip(),
                                        transforms.ToTensor(), normalize])
    # The script's loader settings: on CUDA 1 worker and pinned memory. It shuffles the training set
    # only on CUDA (a quirk of its kwargs); this baseline shuffles on every device, as any user would.
    extra = {"num_workers": 1, "pin_memory": True} if dev.type == "cuda" else {}
    train_set, val_set = PerSampleImages(train, transform), PerSampleImages(val, eval_transform)
    num_classes = int(max(train_set.labels.max(), val_set.labels.max())) + 1
    torch.manual_seed(seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, **extra)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=spec["test_batch_size"], **extra)
    if kind == "cifar_notebook":
        model = cifar_notebook_net(channels, height, width, num_classes).to(dev)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"],
                                    weight_decay=spec["weight_decay"])
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=spec["t_max"])
        loss_fn = F.cross_entropy
    else:
        model = baseline_net(channels, height, width, num_classes).to(dev)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=spec["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=spec["gamma"])
        loss_fn = F.nll_loss

    def evaluate():
        model.eval()
        loss, correct = 0.0, 0
        with torch.no_grad():
            for data, labels in val_loader:
                data, labels = data.to(dev), labels.to(dev)
                output = model(data)
                loss += loss_fn(output, labels, reduction="sum").item()
                correct += output.argmax(dim=1).eq(labels).sum().item()
        model.train()
        return correct / len(val), loss / len(val)

    curve, step, eval_s, reached = [], 0, 0.0, False
    t0 = time.perf_counter()  # just before the first training step, as the recipe's train_start

    def eval_point(epochs_done: float) -> bool:
        nonlocal eval_s
        e0 = time.perf_counter()
        acc, loss = evaluate()
        now = time.perf_counter()
        eval_s += now - e0
        curve.append({"time_s": now - t0, "step": step, "epoch": round(epochs_done, 3), "accuracy": acc,
                      "loss": loss, "eval_s": now - e0})
        log(f"  baseline step {step} (epoch {epochs_done:.2f}): accuracy {acc:.4f} at {now - t0:.1f} s")
        return acc >= target

    model.train()
    for epoch in range(max_epochs):
        for batch_idx, (data, labels) in enumerate(train_loader):
            data, labels = data.to(dev), labels.to(dev)
            optimizer.zero_grad()
            loss = loss_fn(model(data), labels)
            loss.backward()
            optimizer.step()
            step += 1
            if batch_idx % spec["log_interval"] == 0:
                loss.item()  # the script prints the loss here: a device sync it pays for
            if eval_every_steps and step % eval_every_steps == 0 and batch_idx + 1 < len(train_loader):
                reached = eval_point(epoch + (batch_idx + 1) / len(train_loader))
                if reached:
                    break
        if reached:
            break
        scheduler.step()
        if eval_point(epoch + 1):
            break
    crossing = crossing_report(curve, target)
    return {**crossing, "eval_s_total": eval_s, "epochs_run": round(step / len(train_loader), 3), "steps": step,
            "train_wall_s": time.perf_counter() - t0, "eval_every_steps": eval_every_steps, "curve": curve,
            "max_epochs": max_epochs}


# --- the recipe side --------------------------------------------------------------------------------

def recipe_command(args, seed: int, run_dir: Path) -> list[str]:
    own = ["--dataset", args.dataset, "--output-dir", str(run_dir), "--seed", str(seed)]
    if args.eval_every_steps:  # only when asked: 0 is the recipes' epoch-end default anyway
        own += ["--eval-every-steps", str(args.eval_every_steps)]
    config = args.accelerate_config or ("cpu_2proc.yaml" if args.nproc == 2 else None)
    return launch_command(args.recipe, [*own, *args.recipe_argv], nproc=args.nproc if config else 0, config=config,
                          precision=None, threads=args.threads // args.nproc)  # the config's precision


def recipe_env(args, cache_dir: Path) -> dict:
    """Threads per process, the benchmark's decoded cache; the recipe's Accelerator sees no GPU on --device cpu."""
    return shared_recipe_env(threads=args.threads // args.nproc, cache_dir=cache_dir, cpu_only=args.device == "cpu",
                             offline=False)


def run_recipe(args, seed: int, run_dir: Path, cache_dir: Path) -> dict:
    cmd = recipe_command(args, seed, run_dir)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=recipe_env(args, cache_dir), cwd=str(REPO), capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the recipe run for seed {seed} took over --timeout {args.timeout} s and was stopped.")
    wall = time.perf_counter() - t0
    try:
        run = read_recipe_run(run_dir)
    except (RuntimeError, json.JSONDecodeError) as err:
        raise RuntimeError(f"{err}\ncommand: {shlex.join(cmd)}\nexit {proc.returncode}\n"
                           f"stdout (end):\n{proc.stdout[-3000:]}\nstderr (end):\n{proc.stderr[-5000:]}") from None
    points = recipe_eval_points(run["rows"], run["train_start"], run["compile_s"])
    crossing = crossing_report(points, args.target)
    i = first_crossing(points, args.target)
    late = i is not None and points[i]["time_includes_final_eval"]
    if late:
        print(f"warning: seed {seed}: the recipe's final evaluation was logged into the line of the crossing "
              "evaluation, so its time includes that final evaluation (an upper bound)", file=sys.stderr)
    return {**crossing, "compile_s": run["compile_s"],
            "time_to_target_with_compile_s": (crossing["time_to_target_s"] + run["compile_s"]
                                              if crossing["reached"] else None),
            "eval_s_included_is_estimate": True, "time_is_upper_bound": late, "process_wall_s": wall,
            "exit_code": proc.returncode,
            "status": run["summary"].get("status", "completed"), "global_batch": run["config"].get("batch_size"),
            "config": {k: run["config"].get(k) for k in ("val_fraction", "channels", "image_size", "seed", "epochs",
                                                          "batch_size") if k in run["config"]},
            "command": shlex.join(cmd), "curve": points}


def check_same_split(recipe: dict, cfg) -> None:
    """The recipe must have split the data as the baseline did; its config.json says how it did."""
    for key in ("val_fraction", "channels", "image_size", "seed"):
        theirs = recipe["config"].get(key)
        if theirs is not None and theirs != getattr(cfg, key, theirs):
            raise RuntimeError(f"the recipe ran with {key}={theirs!r} but the baseline's split used "
                               f"{getattr(cfg, key)!r}, so the two would not be measured on the same data.")


def baseline_cadence(args, recipe: dict | None) -> int:
    """Baseline steps between mid-epoch evaluations: the same training images as the recipe's cadence."""
    if args.baseline_eval_every_steps is not None:
        return args.baseline_eval_every_steps
    if not args.eval_every_steps:
        return 0
    batch = (recipe or {}).get("global_batch")
    if not batch:
        print("warning: the recipe's global batch is unknown (no batch_size in its config.json), so the baseline "
              "evaluates at epoch ends only; pass --baseline-eval-every-steps to set its cadence", file=sys.stderr)
        return 0
    return max(1, round(args.eval_every_steps * batch / BASELINES[args.baseline_kind]["batch_size"]))


# --- report -------------------------------------------------------------------------------------------

def fmt_side(side: dict | None, target: float, unit_epochs: bool = False) -> str:
    if side is None:
        return "-"
    if side["reached"]:
        return f"{side['time_to_target_s']:.1f} s (step {side['step']}, {side['accuracy']:.4f})"
    best = side["best_accuracy"]
    where = f"in {side['max_epochs']} epochs" if unit_epochs else "in the run"
    return f"not reached {where} (best {best:.4f})" if best is not None else f"not reached {where} (no eval)"


def ratio_of(recipe: dict, baseline: dict | None) -> tuple[float | None, bool]:
    """baseline time / recipe time, and whether it is only a lower bound (baseline never reached)."""
    if baseline is None or not recipe["reached"] or recipe["time_to_target_s"] <= 0:
        return None, False
    if baseline["reached"]:
        return baseline["time_to_target_s"] / recipe["time_to_target_s"], False
    return baseline["train_wall_s"] / recipe["time_to_target_s"], True


def print_report(report: dict) -> None:
    s = report["settings"]
    if s["target"] == "baseline":
        goal = "each seed's baseline final accuracy (both sides)"
    else:
        goal = f"{s['target']:.2%} vs the baseline to {s['baseline_target']:.2%}"
    print(f"\ntime to accuracy: {s['recipe']} to {goal}; baseline {s['baseline_recipe']['model']}; validation "
          f"split of {s['dataset']}")
    rows = [("seed", "recipe", "baseline", "ratio")]
    for r in report["seeds"]:
        ratio = "-" if r["ratio"] is None else f"{'>=' if r['ratio_is_lower_bound'] else ''}{r['ratio']:.1f}x"
        rows.append((str(r["seed"]), fmt_side(r["recipe"], None), fmt_side(r["baseline"], None, True), ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    sm = report["summary"]
    for name, key, unit in (("recipe time", "recipe_time_s", " s"), ("baseline time", "baseline_time_s", " s"),
                            ("ratio", "ratio", "x")):
        v = sm[key]
        if v is None:
            print(f"  {name}: no seed reached the target")
            continue
        bound = (" (lower bound: the baseline missed its target)"
                 if key == "ratio" and sm["ratio_is_lower_bound"] else "")
        print(f"  {name}: median {v['median']:.2f}{unit}, mean {v['mean']:.2f}{unit}, spread {v['min']:.2f}-"
              f"{v['max']:.2f}{unit} over {v['n']} of {len(report['seeds'])} seeds{bound}")
    def seconds(values):
        return ", ".join("-" if v is None else f"{v:.1f}" for v in values) + " s"

    seeds = report["seeds"]
    print(f"  excluded: decode {report['decode_s']:.1f} s (once), recipe compile "
          f"{seconds(r['recipe']['compile_s'] for r in seeds)}")
    print(f"  evaluation included: recipe {seconds(r['recipe']['eval_s_included'] for r in seeds)} (estimated), "
          f"baseline {seconds(r['baseline']['eval_s_included'] if r['baseline'] else None for r in seeds)}")
    m = report["machine"]
    print(f"  machine: {m['gpu'] or m['cpu']} ({m['cpu_count']} CPUs), {s['threads']} torch threads in all "
          f"({s['nproc']} recipe process(es) x {s['threads'] // s['nproc']}), load average {m['load_average_start']} "
          f"-> {m['load_average_end']}")
    for name, goal, key, better in (("recipe time", s["goal_seconds"], "recipe_time_s", "le"),
                                    ("ratio", s["goal_ratio"], "ratio", "ge")):
        if goal is None:
            continue
        mean = sm[key]["mean"] if sm[key] and sm[key]["n"] == len(report["seeds"]) else None
        ok = mean is not None and (mean <= goal if better == "le" else mean >= goal)
        print(f"  goal {name} {'<=' if better == 'le' else '>='} {goal:g}: {'PASS' if ok else 'MISS'} (mean "
              f"{'-' if mean is None else f'{mean:.2f}'})")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    load_start = load_average()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy (load average {load_start[0]} on {os.cpu_count()} CPUs): "
              "other processes share the cores and the times will be long and noisy", file=sys.stderr)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="time_to_accuracy-"))
    # A fresh cache by default, so that the decode measured below is a real first decode.
    cache_dir = work / "decoded-cache"
    try:
        try:
            cfg = data_config(args, args.seed_list[0], cache_dir)
            cache_dir = Path(cfg.cache_dir)
            # A cache filled before (--work-dir or --cache-dir reused) makes this a cache read, not a decode.
            cache_was_warm = cache_dir.is_dir() and any(cache_dir.iterdir())
            print(f"decoding {args.dataset} into {cache_dir}"
                  f"{' (already filled: this measures a cache read)' if cache_was_warm else ''} ...", flush=True)
            t0 = time.perf_counter()
            load_split(args, args.seed_list[0], cache_dir)
            decode_s = time.perf_counter() - t0
        except BadInput as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"  {decode_s:.1f} s (excluded from the times below)", flush=True)

        per_seed = []
        for seed in args.seed_list:
            run_dir = work / f"run-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"seed {seed}: recipe {args.recipe} ({args.nproc} process(es)) ...", flush=True)
            try:
                recipe = run_recipe(args, seed, run_dir, cache_dir)
            except RuntimeError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            if not args.target_from_baseline:
                print(f"  recipe: {fmt_side(recipe, args.target)}", flush=True)
            baseline = None
            if args.baseline == "on":
                try:
                    check_same_split(recipe, data_config(args, seed, cache_dir))
                    train, val = load_split(args, seed, cache_dir)
                except (RuntimeError, BadInput) as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 1
                cadence = baseline_cadence(args, recipe)
                print(f"seed {seed}: baseline (eval every {cadence or 'epoch'}{' steps' if cadence else ''}) ...",
                      flush=True)
                baseline = run_baseline(train, val, args.baseline_target, seed=seed,
                                        max_epochs=args.max_baseline_epochs, eval_every_steps=cadence,
                                        device=args.device, log=lambda msg: print(msg, flush=True),
                                        kind=args.baseline_kind)
                if args.target_from_baseline and baseline["curve"]:  # both sides: time to the baseline's final
                    final = baseline["curve"][-1]["accuracy"]
                    baseline.update(crossing_report(baseline["curve"], final), target=final)
                    recipe.update(crossing_report(recipe["curve"], final), target=final)
                    recipe["time_to_target_with_compile_s"] = (recipe["time_to_target_s"] + recipe["compile_s"]
                                                               if recipe["reached"] else None)
                    print(f"  target: the baseline's final accuracy {final:.4f}", flush=True)
                    print(f"  recipe: {fmt_side(recipe, final)}", flush=True)
                print(f"  baseline: {fmt_side(baseline, args.baseline_target, True)}", flush=True)
            ratio, lower = ratio_of(recipe, baseline)
            per_seed.append({"seed": seed, "recipe": recipe, "baseline": baseline, "ratio": ratio,
                             "ratio_is_lower_bound": lower})
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    ratios = [r["ratio"] for r in per_seed if r["ratio"] is not None]
    report = {
        "benchmark": "time_to_accuracy", "created": datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "settings": {"recipe": args.recipe, "dataset": args.dataset,
                     "target": "baseline" if args.target_from_baseline else args.target,
                     "baseline_target": "baseline" if args.target_from_baseline else args.baseline_target, "seeds": args.seed_list, "nproc": args.nproc,
                     "device": args.device, "threads": args.threads, "recipe_args": args.recipe_argv,
                     "accelerate_config": args.accelerate_config, "eval_every_steps": args.eval_every_steps,
                     "max_baseline_epochs": args.max_baseline_epochs, "baseline": args.baseline,
                     "goal_seconds": args.goal_seconds, "goal_ratio": args.goal_ratio,
                     "baseline_recipe": {"kind": args.baseline_kind, **BASELINES[args.baseline_kind]},
                     "timing": "time to target = end of the first evaluation at >= target minus the start of the "
                               "first training step; evaluations included, decode, compile and setup excluded"},
        "decode_s": decode_s, "decode_cache_was_warm": cache_was_warm,
        "seeds": per_seed,
        "summary": {"recipe_time_s": spread([r["recipe"]["time_to_target_s"] for r in per_seed
                                             if r["recipe"]["reached"]]),
                    "baseline_time_s": spread([r["baseline"]["time_to_target_s"] for r in per_seed
                                               if r["baseline"] and r["baseline"]["reached"]]),
                    "ratio": spread(ratios), "ratio_is_lower_bound": any(r["ratio_is_lower_bound"] for r in per_seed),
                    "recipe_reached": sum(r["recipe"]["reached"] for r in per_seed),
                    "baseline_reached": sum(bool(r["baseline"] and r["baseline"]["reached"]) for r in per_seed)},
        "machine": {**machine_info(args.device), "torch_num_threads": torch.get_num_threads(),
                    "load_average_start": load_start, "load_average_end": load_average()},
        "versions": versions(),
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    from common.launching import stop_children_on_term

    stop_children_on_term()  # a stopped benchmark leaves no recipe training
    sys.exit(main())
