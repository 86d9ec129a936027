"""Time to accuracy: wall time until a recipe first reaches a validation accuracy, beside the script a user would
otherwise run (the baseline), on the same split, threads and machine, over several seeds (median, mean, spread).
The recipe is launched as users launch it and timed to the eval_time of its first metrics.jsonl row with
eval/accuracy >= --target, from summary.json's timing.train_start. The baseline trains in this process on the
recipe's own split (BASELINES: pytorch/examples mnist/main.py, or airbench94 for cifar_cnn) and is timed to the end
of its first evaluation at >= --baseline-target, from the start of its first step; with --target baseline both sides
are timed to the accuracy it ends with. Both times include every evaluation up to the crossing; the one-time decode
is excluded; all are reported (the whole rule: benchmarks/README.md). Ratio = baseline / recipe time, a lower bound
(">=") when the baseline misses its target.

Beside the crossing, each seed reports the recipe's whole command as a user waits for it: launch to exit (imports,
data, training, every evaluation, the saves), its final validation accuracy, and E, the baseline's first epoch with
its evaluation measured in the same run on the same split (pytorch/examples' MNIST script: the unit the MNIST and
Fashion-MNIST goals are set in); --goal-e N checks every seed: final accuracy >= --target and wall <= N x E.

    python benchmarks/time_to_accuracy.py --recipe mnist_convnet --dataset ../shared/data/mnist --nproc 2 \\
        --target 0.993 --max-baseline-epochs 1 --seeds 1,2,3,4,5 --goal-e 0.5
    python benchmarks/time_to_accuracy.py --recipe mnist_convnet --dataset ../shared/data/mnist \\
        --target 0.993 --baseline-target 0.99 --seeds 1,2,3
    python benchmarks/time_to_accuracy.py --recipe cifar_cnn --dataset ../shared/data/cifar10 --target baseline
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import airbench94
import torch
import torch.nn.functional as F
from harness import (  # first: the repo on sys.path
    REPO,
    PerSampleImages,
    bad_input,
    machine_line,
    provenance,
    save,
    split_recipe_args,
    warn_if_busy,
)
from launching import (
    launch_command,
    read_run,
    recipe_config,
    recipe_env,
    run_logged,
    shipped_recipes,
    stop_children_on_term,
)
from torch import nn
from torchvision import transforms

from common.data.decoded import load_image_data
from common.errors import RecipeError

# The report's settings as given on the command line (with recipe, dataset, targets, seeds, nproc, device, threads)
SETTINGS = ("recipe_seeds_in_one_process", "accelerate_config", "eval_every_steps", "max_baseline_epochs", "baseline")
SETTINGS += ("goal_seconds", "goal_ratio", "goal_e")
# Flags the benchmark sets itself on the recipe command line (per seed, per run directory).
OWN_FLAGS = ("--dataset", "--output-dir", "--seed", "--eval-every-steps", "--resume-from")
BASELINES = {
    "mnist_example": dict(
        batch_size=64,
        test_batch_size=1000,
        lr=1.0,
        gamma=0.7,
        mean=0.1307,
        std=0.3081,
        log_interval=10,
        epochs=14,
        optimizer="Adadelta lr 1.0",
        model="pytorch/examples mnist Net: conv32 conv64 maxpool dropout 0.25, fc 128 dropout 0.5, log_softmax + NLL",
        schedule="StepLR(step_size=1, gamma=0.7) per epoch",
        pipeline="per-sample PIL + ToTensor + Normalize in a torch DataLoader",
    ),
    "airbench94": dict(
        batch_size=1024,
        epochs=10,
        model="airbench94 (benchmarks/airbench94.py), the paper's method in plain PyTorch",
        optimizer="SGD Nesterov, BatchNorm biases at 64x the LR, Lookahead",
        schedule="warm-up from 0.2 over 23%, linear to 0.07, 9.9 epochs; one evaluation, at the end",
        pipeline="the whole set on the device, augmented per batch",
    ),
}


def crossing_report(points: list[dict], target: float) -> dict:
    """The first crossing: the first point (evaluation order) with "accuracy" >= target. Missing or NaN accuracies
    never count; a later dip does not matter: the first crossing is when a user could have stopped. Returns
    reached, time_to_target_s, step, accuracy, evals up to the crossing, best accuracy, and eval_s_included: every
    point's eval_s up to the crossing plus the post_eval_s of the points before it (None if unknown)."""
    accs = {
        k: p["accuracy"]
        for k, p in enumerate(points)
        if p.get("accuracy") is not None and not math.isnan(p["accuracy"])
    }
    i = next((k for k, acc in accs.items() if acc >= target), None)
    upto = points[: i + 1] if i is not None else points
    parts = [p.get("eval_s") for p in upto] + [p.get("post_eval_s", 0.0) for p in upto[:-1]]
    if i is None and upto:
        parts.append(upto[-1].get("post_eval_s", 0.0))
    at = points[i] if i is not None else {}
    report = {
        "reached": i is not None,
        "time_to_target_s": at.get("time_s"),
        "step": at.get("step"),
        "accuracy": at.get("accuracy"),
        "evals": len(upto),
        "best_accuracy": max(accs.values(), default=None),
        "eval_s_included": sum(parts) if upto and None not in parts else None,
    }
    return report


def recipe_eval_points(rows: list[dict], train_start: float) -> list[dict]:
    """The eval rows of a recipe's metrics.jsonl as points: time_s from train_start to when the evaluation
    finished (eval_time, else the row's time); step, accuracy, loss, eval_s (eval_seconds) and
    post_eval_s (what the recipe does after logging an evaluation: TensorBoard images, best/ weights, checkpoint).
    Estimated where not recorded: the seconds beyond training in the row's own gap (eval_s) and the next row's
    (post_eval_s), at the median seconds per step of the gaps with no evaluation on either side (else None)."""
    gaps, prev_t, prev_step = [], train_start, 0
    for row in rows:
        step = row.get("step", prev_step)
        gaps.append((row["time"] - prev_t, step - prev_step))
        prev_t, prev_step = row["time"], step
    is_eval = ["eval/accuracy" in row for row in rows]
    rates = [  # gap 0 holds the warm-up
        dt / ds for k, (dt, ds) in enumerate(gaps) if k > 0 and ds > 0 and not is_eval[k] and not is_eval[k - 1]
    ]
    rate = statistics.median(rates) if rates else None

    def excess(k):
        if rate is None:
            return None
        return max(0.0, gaps[k][0] - rate * max(gaps[k][1], 0)) if k < len(rows) else 0.0

    return [
        {
            "time_s": row.get("eval_time", row["time"]) - train_start,
            "step": row.get("step"),
            "accuracy": float(row["eval/accuracy"]),
            "loss": row.get("eval/loss"),
            "eval_s": row.get("eval_seconds", excess(k)),
            "post_eval_s": excess(k + 1),
        }
        for k, row in enumerate(rows)
        if is_eval[k]
    ]


def read_recipe_run(run_dir: Path) -> dict:
    """What a finished recipe run wrote (launching.read_run), checked: it trained to its end and says
    when its first training step began (timing.train_start). RuntimeError otherwise."""
    run = read_run(run_dir)
    summary, timing = run["summary"], run["summary"].get("timing") or {}
    if not summary:
        raise RuntimeError(f"the recipe run {run_dir} wrote no summary.json, so it did not finish.")
    if summary.get("status", "completed") not in ("completed", "target_missed"):  # target_missed: trained to its end
        raise RuntimeError(
            f"the recipe run {run_dir} ended with status {summary.get('status')!r}, so it did not train to the end."
        )
    if "train_start" not in timing:
        raise RuntimeError(
            f"{run_dir}/summary.json has no timing.train_start, which the time to target is measured from."
        )
    return {**run, "train_start": float(timing["train_start"])}


def spread(values: list[float]) -> dict | None:
    """median, mean, min, max and n of ``values``; None when there are none."""
    if not values:
        return None
    return dict(median=statistics.median(values), mean=statistics.fmean(values), min=min(values), max=max(values),
                n=len(values))  # fmt: skip


def seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        bad_input(f"--seeds {text!r} is not a list of distinct integers. Pass e.g. --seeds 1,2,3.")
    return seeds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, choices=shipped_recipes())
    p.add_argument("--dataset", required=True, help="dataset folder (or Hub id), e.g. ../shared/data/mnist")
    p.add_argument(
        "--target",
        required=True,
        help="validation accuracy for the recipe, e.g. 0.993, or 'baseline': "
        "both sides timed to the accuracy the baseline ends its epochs with",
    )
    p.add_argument("--baseline-target", type=float, help="validation accuracy for the baseline (default: --target)")
    p.add_argument("--seeds", type=seed_list, default="1,2,3", help="comma-separated (>= 3 for a median worth quoting)")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        choices=[1, 2],
        help="recipe processes (2: accelerate launch with "
        "accelerate_configs/cpu_2proc.yaml; 2 GPUs with --device cuda)",
    )
    p.add_argument("--accelerate-config", help="launch the recipe with this config instead; --nproc must match it")
    p.add_argument("--recipe-args", default="", help='extra recipe flags, one string, e.g. "--channels 3"')
    p.add_argument(
        "--eval-every-steps",
        type=int,
        default=0,
        help="also evaluate every N recipe steps (0: at epoch "
        "ends only), and the baseline after as many training images",
    )
    p.add_argument("--max-baseline-epochs", type=int, help="default: the baseline's own (MNIST 14)")
    p.add_argument("--baseline", default="on", choices=["on", "off"])
    p.add_argument(
        "--baseline-kind",
        choices=list(BASELINES),
        help="default: airbench94 (evaluated once, at its end) for cifar_cnn, mnist_example for the others",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads in all: the baseline's, split evenly over the recipe's processes (default: every CPU)",
    )
    p.add_argument("--goal-seconds", type=float, help="print PASS/MISS for the mean recipe time against this")
    p.add_argument("--goal-ratio", type=float, help="print PASS/MISS for the mean ratio against this")
    p.add_argument(
        "--goal-e",
        type=float,
        help="print PASS/MISS for every seed: final accuracy >= --target and "
        "launch to exit <= this many E (the baseline's first epoch, same run)",
    )
    p.add_argument("--timeout", type=int, default=3600, help="seconds one recipe run may take")
    p.add_argument(
        "--recipe-seeds-in-one-process",
        action="store_true",
        help="launch the recipe once for every seed (benchmarks/seeds_in_process.py: its main once per seed, in "
        "one process): the first seed pays the process's one-time costs (cold), the others show a warm run; each "
        "seed's process_wall_s is then its main's seconds",
    )
    p.add_argument("--work-dir", type=Path, help="keep the decoded cache, runs and logs here (default: temporary)")
    p.add_argument("--out", type=Path, help="JSON report (default benchmarks/results/time_to_accuracy-<recipe>.json)")
    args = p.parse_args(argv)
    args.baseline_kind = args.baseline_kind or ("airbench94" if args.recipe == "cifar_cnn" else "mnist_example")
    if args.max_baseline_epochs is None:
        args.max_baseline_epochs = BASELINES[args.baseline_kind]["epochs"]
    args.target_from_baseline = args.target == "baseline"
    if args.target_from_baseline:
        if args.baseline != "on" or args.baseline_target is not None:
            bad_input(
                "--target baseline takes the target from the baseline's final accuracy: it needs --baseline on "
                "and no --baseline-target."
            )
        args.target = args.baseline_target = math.inf  # set per seed, once the baseline has run
    else:
        try:
            args.target = float(args.target)
        except ValueError:
            bad_input(f"--target {args.target!r} is neither an accuracy (e.g. 0.99) nor 'baseline'.")
        args.baseline_target = args.target if args.baseline_target is None else args.baseline_target
        for flag, value in (("--target", args.target), ("--baseline-target", args.baseline_target)):
            if 1 < value <= 100:
                bad_input(
                    f"{flag} {value:g} looks like a percentage; accuracies here are fractions. Pass {flag} "
                    f"{value / 100:g}."
                )
            if not 0 < value <= 1:
                bad_input(f"{flag} {value:g} is not an accuracy: pass a fraction in (0, 1], e.g. 0.99.")
    if args.eval_every_steps < 0 or min(args.max_baseline_epochs, args.threads, args.timeout) < 1:
        bad_input(
            "--eval-every-steps must be >= 0 (0 = at epoch ends only), --max-baseline-epochs, --threads and "
            "--timeout >= 1."
        )
    if args.goal_e is not None and (
        args.baseline != "on" or args.baseline_kind != "mnist_example" or args.target_from_baseline or args.goal_e <= 0
    ):
        bad_input(
            "--goal-e needs the MNIST script's baseline (--baseline on, --baseline-kind mnist_example: E is its "
            "first epoch), a fixed --target and a positive number of E."
        )
    if args.threads < args.nproc:
        bad_input(f"--threads {args.threads} < --nproc {args.nproc}: every recipe process needs a thread.")
    args.recipe_argv = split_recipe_args(args.recipe_args)
    own = [a for a in args.recipe_argv if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        bad_input(
            f"--recipe-args sets {', '.join(own)}, which the benchmark sets itself for every seed. Use the "
            "benchmark's --dataset, --seeds and --eval-every-steps instead."
        )
    if args.accelerate_config and not Path(args.accelerate_config).is_file():
        bad_input(f"--accelerate-config {args.accelerate_config} is not a file (e.g. accelerate_configs/cpu.yaml).")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        bad_input(f"--device cuda --nproc {args.nproc}: torch sees {torch.cuda.device_count()} GPU(s).")
    # The recipe's Config from its own parser (a bad flag exits 2 with its message): the baseline decodes and
    # holds out exactly what the recipe will (--val-fraction, --image-size, --channels, columns, cache).
    args.recipe_cfg = recipe_config(args.recipe, args.recipe_argv)
    args.out = args.out or REPO / "benchmarks" / "results" / f"time_to_accuracy-{args.recipe}.json"
    return args


def data_config(args, seed: int, cache_dir: Path):
    """The settings load_image_data reads, as the recipe will have them for this dataset and seed."""
    cfg = args.recipe_cfg
    return types.SimpleNamespace(
        **{**vars(cfg), "dataset": args.dataset, "seed": seed, "cache_dir": cfg.cache_dir or str(cache_dir)}
    )


def load_split(args, seed: int, cache_dir: Path):
    """The recipe's data for this seed: its loader, its cache, its hold-out. Returns (train, val)."""
    try:
        data = load_image_data(data_config(args, seed, cache_dir), args.dataset, True)
    except RecipeError as err:
        bad_input(str(err))
    if data.val is None:
        bad_input(
            f"{args.dataset} has no validation split and --val-fraction is 0, so there is nothing to measure "
            "accuracy on. Drop --val-fraction 0 from --recipe-args."
        )
    return data.train, data.val


def baseline_model(kind: str, channels: int, height: int, width: int, num_classes: int):
    """pytorch/examples mnist/main.py's (model, optimizer, scheduler, loss), written from its description."""
    spec = BASELINES[kind]
    # mnist/main.py's Net, layer for layer: log-probabilities out, nll_loss
    model = nn.Sequential(
        nn.Conv2d(channels, 32, 3, 1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, 1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128),
        nn.ReLU(),  # 9216 at 28
        nn.Dropout(0.5),
        nn.Linear(128, num_classes),
        nn.LogSoftmax(dim=1),
    )
    optimizer = torch.optim.Adadelta(model.parameters(), lr=spec["lr"])
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, spec["gamma"]), F.nll_loss


def run_baseline(
    train,
    val,
    target: float,
    *,
    seed: int,
    max_epochs: int,
    eval_every_steps: int = 0,
    device: str = "cpu",
    log=lambda msg: None,
    kind: str = "mnist_example",
) -> dict:
    """Train the baseline ``kind`` on ``train`` (an ImageSplit), evaluating on ``val`` at every epoch end and every
    ``eval_every_steps`` steps, until the first evaluation at >= target or ``max_epochs``. Returns the crossing
    report plus the curve, epochs run and training seconds."""
    spec, dev = BASELINES[kind], torch.device(device)
    channels, height, width = train.image_shape if hasattr(train, "image_shape") else train.images.shape[1:]
    normalize = transforms.Normalize((spec["mean"],) * channels, (spec["std"],) * channels)
    transform = eval_transform = transforms.Compose([transforms.ToTensor(), normalize])
    # The script's loader settings: on CUDA 1 worker and pinned memory. It shuffles the training set only on CUDA
    # (a quirk of its kwargs); this baseline shuffles on every device, as any user would.
    extra = {"num_workers": 1, "pin_memory": True} if dev.type == "cuda" else {}
    # One private in-memory copy of each split's rows, as torchvision's MNIST holds its tensor.
    train_set, val_set = (
        PerSampleImages(split.images.contiguous(), split.labels.contiguous(), tf)
        for split, tf in ((train, transform), (val, eval_transform))
    )
    num_classes = int(max(train_set.labels.max(), val_set.labels.max())) + 1
    torch.manual_seed(seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=spec["batch_size"], shuffle=True, **extra)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=spec["test_batch_size"], **extra)
    model, optimizer, scheduler, loss_fn = baseline_model(kind, channels, height, width, num_classes)
    model.to(dev)
    curve, step = [], 0
    t0 = time.perf_counter()  # just before the first training step, as the recipe's train_start

    def eval_point(epochs_done: float) -> bool:
        e0, loss, correct = time.perf_counter(), 0.0, 0
        model.eval()
        with torch.no_grad():
            for data, labels in val_loader:
                data, labels = data.to(dev), labels.to(dev)
                output = model(data)
                loss += loss_fn(output, labels, reduction="sum").item()
                correct += output.argmax(dim=1).eq(labels).sum().item()
        model.train()
        now, acc = time.perf_counter(), correct / len(val)
        curve.append(
            {
                "time_s": now - t0,
                "step": step,
                "epoch": round(epochs_done, 3),
                "accuracy": acc,
                "loss": loss / len(val),
                "eval_s": now - e0,
            }
        )
        log(f"  baseline step {step} (epoch {epochs_done:.2f}): accuracy {acc:.4f} at {now - t0:.1f} s")
        return acc >= target

    model.train()
    reached = False
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
                if reached := eval_point(epoch + (batch_idx + 1) / len(train_loader)):
                    break
        if reached:
            break
        scheduler.step()
        if eval_point(epoch + 1):
            break
    return {
        **crossing_report(curve, target),
        "eval_s_total": sum(p["eval_s"] for p in curve),
        "epochs_run": round(step / len(train_loader), 3),
        "steps": step,
        "train_wall_s": time.perf_counter() - t0,
        "eval_every_steps": eval_every_steps,
        "curve": curve,
        "max_epochs": max_epochs,
    }


def run_airbench(train, val, target: float, *, seed: int, device: str = "cpu", **_) -> dict:
    """airbench94 on the same split (benchmarks/airbench94.py), timed as the paper times it: training, then one
    evaluation at the end (its time included, as in run_baseline)."""
    r = airbench94.train_on(train, val, seed, torch.device(device))
    point = {
        "time_s": r["train_s"] + r["eval_s"],
        "step": r["steps"],
        "epoch": airbench94.HYP["epochs"],
        "accuracy": r["accuracy_tta"],
        "accuracy_without_tta": r["accuracy"],
        "eval_s": r["eval_s"],
    }
    return {
        **crossing_report([point], target),
        "eval_s_total": r["eval_s"],
        "epochs_run": airbench94.HYP["epochs"],
        "steps": r["steps"],
        "train_wall_s": point["time_s"],
        "eval_every_steps": 0,
        "curve": [point],
        "max_epochs": math.ceil(airbench94.HYP["epochs"]),
    }


def recipe_launch(args, own: list, cache_dir: Path, script=None) -> tuple[list, dict]:
    """The command that launches the recipe (or ``script``, given ``own`` as its arguments) as a user launches it,
    and its environment: the benchmark's decoded cache; the recipe's Accelerator sees no GPU on --device cpu."""
    config, threads = (
        args.accelerate_config or ("cpu_2proc.yaml" if args.nproc == 2 else None),
        args.threads // args.nproc,
    )
    cmd = launch_command(
        script or args.recipe,
        own if script else [*own, *args.recipe_argv],
        nproc=args.nproc if config else 0,
        config=config,
        precision=None,  # the config's precision
        threads=threads,
    )
    return cmd, recipe_env(threads=threads, cache_dir=cache_dir, cpu_only=args.device == "cpu", offline=False)


def recipe_own_flags(args, seed: int | None, run_dir: Path | None) -> list:
    own = ["--dataset", args.dataset]
    if run_dir is not None:
        own += ["--output-dir", run_dir, "--seed", seed]
    if args.eval_every_steps:  # only when asked: 0 is the recipes' epoch-end default anyway
        own += ["--eval-every-steps", args.eval_every_steps]
    return own


def run_recipe_seeds(args, work: Path, cache_dir: Path) -> dict:
    """--recipe-seeds-in-one-process: one launch of benchmarks/seeds_in_process.py for every seed; returns
    {seed: (exit code, its main's seconds, the launch's command and log)}."""
    runs = work / "recipe-seeds"
    shutil.rmtree(runs, ignore_errors=True)
    driver = Path(__file__).resolve().with_name("seeds_in_process.py")
    own = ["--recipe", args.recipe, "--seeds", ",".join(map(str, args.seeds)), "--runs-dir", runs, "--"]
    cmd, env = recipe_launch(args, [*own, *recipe_own_flags(args, None, None), *args.recipe_argv], cache_dir, driver)
    log = runs.with_name("recipe-seeds.log")
    print(f"recipe {args.recipe}: seeds {args.seeds} in one process ...", flush=True)
    code, wall = run_logged(cmd, env, log, args.timeout * len(args.seeds))
    done = json.loads((runs / "seeds.json").read_text()) if (runs / "seeds.json").exists() else []
    found = {d["seed"]: (d["exit_code"], d["main_s"], shlex.join(cmd), log) for d in done}
    missing = [s for s in args.seeds if s not in found]
    if missing:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"seeds {missing} did not run (launch exit {code}, {wall:.0f} s); the end of {log}:\n{tail}")
    return found


def run_recipe(args, seed: int, run_dir: Path, cache_dir: Path, ran=None) -> dict:
    """One seed's recipe run: launched now, or (``ran``: its exit code, seconds, command and log) already run in one
    process with the others, into ``run_dir``."""
    if ran is None:
        cmd, env = recipe_launch(args, recipe_own_flags(args, seed, run_dir), cache_dir)
        log = run_dir.with_name(run_dir.name + ".log")
        code, wall = run_logged(cmd, env, log, args.timeout)
        cmd = shlex.join(cmd)
    else:
        code, wall, cmd, log = ran
    if code == "timeout":
        raise RuntimeError(
            f"the recipe run for seed {seed} took over --timeout {args.timeout} s and was stopped (its output: {log})."
        )
    try:
        run = read_recipe_run(run_dir)
    except (RuntimeError, json.JSONDecodeError) as err:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"{err}\ncommand: {cmd}\nexit {code}; the end of {log}:\n{tail}") from None
    points = recipe_eval_points(run["rows"], run["train_start"])
    final = (run["summary"].get("final") or {}).get("val/accuracy")
    return {
        **crossing_report(points, args.target),
        "eval_s_included_is_estimate": True,
        "process_wall_s": wall,
        "final_accuracy": final,
        "exit_code": code,
        "status": run["summary"].get("status", "completed"),
        "global_batch": run["config"].get("batch_size"),
        "command": cmd,
        "log": str(log),
        "config": {
            k: run["config"][k]
            for k in ("val_fraction", "channels", "image_size", "seed", "epochs", "batch_size")
            if k in run["config"]
        },
        "phases": phases(run),
        "curve": points,
    }


def phases(run: dict) -> dict:
    """Where a recipe run's first steps went, from its summary.json and metrics.jsonl: set-up (from the run's
    start, TrainingRun's constructor, to just before the first training step: the accelerator, the data, the
    model, ``run.start``), the first update (from there to the end of the first optimizer step on the host), the
    first log window (steps and seconds, from that first update to its row) and the later windows' median ms a step
    (their rows' times; an evaluation or checkpoint inside a window counts in it). Seconds on the host clock (the
    device runs ahead between the log rows' syncs)."""
    summary, timing = run["summary"], run["summary"].get("timing") or {}
    train_start, first = timing.get("train_start"), timing.get("first_step_at")
    out = {"setup_s": None, "first_update_s": None, "first_window": None, "later_ms_per_step": None}
    if train_start is not None and summary.get("wall_time_s") is not None and timing.get("train_s") is not None:
        out["setup_s"] = round(summary["wall_time_s"] - timing["train_s"], 3)
    if train_start is None or first is None:
        return out
    out["first_update_s"] = round(first - train_start, 3)
    marks = [(1, first)] + [(r["step"], r["time"]) for r in run["rows"] if "train/samples_per_sec" in r]
    if len(marks) > 1:
        (s0, t0), (s1, t1) = marks[0], marks[1]
        out["first_window"] = {"steps": s1 - s0, "s": round(t1 - t0, 3)}
    later = [(t1 - t0) / (s1 - s0) * 1000 for (s0, t0), (s1, t1) in zip(marks[1:], marks[2:]) if s1 > s0]
    if later:
        out["later_ms_per_step"] = round(statistics.median(later), 3)
    return out


def fmt_side(side: dict | None, epochs: bool = False) -> str:
    if side is None:
        return "-"
    if side["reached"]:
        return f"{side['time_to_target_s']:.1f} s (step {side['step']}, {side['accuracy']:.4f})"
    where = f"in {side['max_epochs']} epochs" if epochs else "in the run"
    best = side["best_accuracy"]
    return f"not reached {where} ({'no eval' if best is None else f'best {best:.4f}'})"


def ratio_of(recipe: dict, baseline: dict | None) -> tuple[float | None, bool]:
    """baseline time / recipe time, and whether it is only a lower bound (baseline never reached)."""
    if baseline is None or not recipe["reached"] or recipe["time_to_target_s"] <= 0:
        return None, False
    if baseline["reached"]:
        return baseline["time_to_target_s"] / recipe["time_to_target_s"], False
    return baseline["train_wall_s"] / recipe["time_to_target_s"], True


def print_report(report: dict) -> None:
    s, sm, seeds = report["settings"], report["summary"], report["seeds"]
    goal = (
        "each seed's baseline final accuracy (both sides)"
        if s["target"] == "baseline"
        else f"{s['target']:.2%} vs the baseline to {s['baseline_target']:.2%}"
    )
    print(
        f"\ntime to accuracy: {s['recipe']} to {goal}; baseline {s['baseline_recipe']['model']}; validation "
        f"split of {s['dataset']}"
    )
    rows = [("seed", "recipe", "baseline", "ratio")]
    for r in seeds:
        ratio = "-" if r["ratio"] is None else f"{'>=' if r['ratio_is_lower_bound'] else ''}{r['ratio']:.1f}x"
        rows.append((str(r["seed"]), fmt_side(r["recipe"]), fmt_side(r["baseline"], True), ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for name, key, unit in (
        ("recipe time", "recipe_time_s", " s"),
        ("baseline time", "baseline_time_s", " s"),
        ("ratio", "ratio", "x"),
    ):
        v = sm[key]
        bound = " (lower bound: a baseline missed its target)" if key == "ratio" and sm["ratio_is_lower_bound"] else ""
        print(
            f"  {name}: no seed reached the target"
            if v is None
            else f"  {name}: median {v['median']:.2f}{unit}, mean {v['mean']:.2f}{unit}, spread {v['min']:.2f}-"
            f"{v['max']:.2f}{unit} over {v['n']} of {len(seeds)} seeds{bound}"
        )

    def seconds(values):
        return ", ".join("-" if v is None else f"{v:.1f}" for v in values) + " s"

    print(f"  excluded: decode {report['decode_s']:.1f} s (once)")
    print(
        f"  evaluation included: recipe {seconds(r['recipe']['eval_s_included'] for r in seeds)} (partly estimated), "
        f"baseline {seconds(r['baseline']['eval_s_included'] if r['baseline'] else None for r in seeds)}"
    )
    print(
        f"  {machine_line(report['machine'])}; the recipe: {s['nproc']} process(es) x {s['threads'] // s['nproc']}"
        " thread(s)"
    )
    if any(r["e_s"] for r in seeds):
        print(
            "  launch to exit (the whole command: imports, data, training, evaluations, saves) against E (the "
            "baseline's first epoch with its evaluation, same run):"
        )
        for r in seeds:
            acc, e, in_e = r["recipe"]["final_accuracy"], r["e_s"], r["wall_in_e"]
            print(
                f"    seed {r['seed']}: final {'-' if acc is None else f'{acc:.2%}'} in "
                f"{r['recipe']['process_wall_s']:.1f} s = {'-' if not e else f'{in_e:.2f} E (E = {e:.1f} s)'}"
            )
    if s.get("goal_e") is not None:
        ok = [
            r["wall_in_e"] is not None
            and r["wall_in_e"] <= s["goal_e"]
            and (r["recipe"]["final_accuracy"] or 0) >= s["target"]
            for r in seeds
        ]
        print(
            f"  goal every seed >= {s['target']:.2%} within {s['goal_e']:g} E: {'PASS' if all(ok) else 'MISS'} "
            f"({sum(ok)} of {len(ok)} seeds)"
        )
    for name, goal, key, op in (
        ("recipe time", s["goal_seconds"], "recipe_time_s", "<="),
        ("ratio", s["goal_ratio"], "ratio", ">="),
    ):
        if goal is not None:
            mean = sm[key]["mean"] if sm[key] and sm[key]["n"] == len(seeds) else None
            ok = mean is not None and (mean <= goal if op == "<=" else mean >= goal)
            print(
                f"  goal {name} {op} {goal:g}: {'PASS' if ok else 'MISS'} (mean "
                f"{'-' if mean is None else f'{mean:.2f}'})"
            )


def run_seed(args, seed: int, work: Path, cache_dir: Path, ran=None) -> dict:
    if ran is None:
        run_dir = work / f"run-seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"seed {seed}: recipe {args.recipe} ({args.nproc} process(es)) ...", flush=True)
    else:  # run already, in one process with the other seeds
        run_dir = work / "recipe-seeds" / f"run-seed{seed}"
    recipe = run_recipe(args, seed, run_dir, cache_dir, ran)
    if not args.target_from_baseline:
        print(f"  recipe: {fmt_side(recipe)}", flush=True)
    baseline = None
    if args.baseline == "on":
        train, val = load_split(args, seed, cache_dir)  # the recipe's Config and seed: the split it trained on
        # baseline steps between mid-epoch evaluations: as many training images as the recipe's cadence
        cadence = args.eval_every_steps and max(
            1, round(args.eval_every_steps * args.recipe_cfg.batch_size / BASELINES[args.baseline_kind]["batch_size"])
        )
        print(f"seed {seed}: baseline (eval every {f'{cadence} steps' if cadence else 'epoch'}) ...", flush=True)
        run = run_airbench if args.baseline_kind == "airbench94" else run_baseline
        baseline = run(
            train,
            val,
            args.baseline_target,
            seed=seed,
            max_epochs=args.max_baseline_epochs,
            eval_every_steps=cadence,
            device=args.device,
            log=lambda msg: print(msg, flush=True),
            kind=args.baseline_kind,
        )
        if args.target_from_baseline and baseline["curve"]:  # both sides: time to the baseline's final accuracy
            final = baseline["curve"][-1]["accuracy"]
            baseline.update(crossing_report(baseline["curve"], final), target=final)
            recipe.update(crossing_report(recipe["curve"], final), target=final)
            print(f"  target: the baseline's final accuracy {final:.4f}\n  recipe: {fmt_side(recipe)}", flush=True)
        print(f"  baseline: {fmt_side(baseline, True)}", flush=True)
    ratio, lower = ratio_of(recipe, baseline)
    # E: the MNIST script's first epoch with its evaluation (not a mid-epoch point of --eval-every-steps)
    e = (
        next((p["time_s"] for p in baseline["curve"] if p["epoch"] >= 1), None)
        if baseline and args.baseline_kind == "mnist_example"
        else None
    )
    wall_e = recipe["process_wall_s"] / e if e else None
    return {
        "seed": seed,
        "recipe": recipe,
        "baseline": baseline,
        "ratio": ratio,
        "ratio_is_lower_bound": lower,
        "e_s": e,
        "wall_in_e": wall_e,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = warn_if_busy()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(args.threads)
    with (
        contextlib.nullcontext(args.work_dir)
        if args.work_dir
        else tempfile.TemporaryDirectory(prefix="time_to_accuracy-", ignore_cleanup_errors=True)
    ) as work:
        work = Path(work)
        # A fresh cache by default, so that the decode measured here is a real first decode; one filled before
        # (--work-dir or --cache-dir reused) makes it a cache read, and the report says so.
        cache_dir = Path(data_config(args, args.seeds[0], work / "decoded-cache").cache_dir)
        cache_was_warm = cache_dir.is_dir() and any(cache_dir.iterdir())
        print(
            f"decoding {args.dataset} into {cache_dir}"
            f"{' (already filled: this measures a cache read)' if cache_was_warm else ''} ...",
            flush=True,
        )
        t0 = time.perf_counter()
        load_split(args, args.seeds[0], cache_dir)  # a dataset it cannot read: bad input, exit 2
        decode_s = time.perf_counter() - t0
        print(f"  {decode_s:.1f} s (excluded from the times below)", flush=True)
        try:
            ran = run_recipe_seeds(args, work, cache_dir) if args.recipe_seeds_in_one_process else {}
            per_seed = [run_seed(args, seed, work, cache_dir, ran.get(seed)) for seed in args.seeds]
        except RuntimeError as err:  # a recipe run that failed or split the data differently: its story, exit 1
            print(f"error: {err}", file=sys.stderr)
            return 1

    def reached(side):
        return [r[side]["time_to_target_s"] for r in per_seed if r[side] and r[side]["reached"]]

    from_baseline = "baseline" if args.target_from_baseline else None
    report = {
        **provenance("time_to_accuracy", argv, args.device, load_start),
        "settings": {
            **{k: getattr(args, k) for k in ("recipe", "dataset", "seeds", "nproc", "device", "threads")},
            "target": from_baseline or args.target,
            "baseline_target": from_baseline or args.baseline_target,
            "recipe_args": args.recipe_argv,
            **{k: getattr(args, k) for k in SETTINGS},
            "baseline_recipe": {"kind": args.baseline_kind, **BASELINES[args.baseline_kind]},
            "timing": "time to target = end of the first evaluation at >= target minus the start of the "
            "first training step; evaluations included, decode and setup excluded",
        },
        "decode_s": decode_s,
        "decode_cache_was_warm": cache_was_warm,
        "seeds": per_seed,
        "summary": {
            "recipe_time_s": spread(reached("recipe")),
            "baseline_time_s": spread(reached("baseline")),
            "wall_in_e": spread([r["wall_in_e"] for r in per_seed if r["wall_in_e"] is not None]),
            "final_accuracy": spread(
                [r["recipe"]["final_accuracy"] for r in per_seed if r["recipe"]["final_accuracy"] is not None]
            ),
            "ratio": spread([r["ratio"] for r in per_seed if r["ratio"] is not None]),
            "ratio_is_lower_bound": any(r["ratio_is_lower_bound"] for r in per_seed),
            "recipe_reached": len(reached("recipe")),
            "baseline_reached": len(reached("baseline")),
        },
    }
    print_report(report)
    save(report, args.out)
    return 0


if __name__ == "__main__":
    stop_children_on_term()  # a stopped benchmark leaves no recipe training
    sys.exit(main())
