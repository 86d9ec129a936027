"""What an evaluation holds the training loop for besides its forward passes, per evaluation: its bookkeeping on the
main process (scalars to metrics.jsonl and TensorBoard, the confusion matrix and the misclassified grid for
TensorBoard, best/), before and after the pictures moved to a child process (``common.train.render``) and best/ to a
thread. The other processes wait for the main one at their next collective, so this is time the whole run loses.

Each row runs in its own process on one source tree: `after` on this working tree, `before` on --before-rev (default
cdf4853, the last revision that drew on the main process), extracted with `git archive`. Both build the recipe's own
model and evaluation (``common.train.metrics.evaluate``, its eval batch, TTA and memory format) over synthetic images
the size of the recipe's validation split (10 classes; the untrained model gets most wrong, so the grid is full),
with a real Accelerator, TensorBoard writer, ``MetricsLog`` and ``Evaluator``, and time an evaluation with its
record --evals times after --warmup: `forward` is the evaluation's own time (its ``seconds``), `held` the rest of the
call, `held + best/ wait` adds the wait of a checkpoint that follows the evaluation (it records the best value, so it
waits for best/). Every evaluation improves on the best (best/ is written each time, as while accuracy climbs).
Between evaluations --gap-s seconds pass, standing in for the training between them (the child draws meanwhile).
At the end the `after` row times the wait for pictures still being drawn and counts the images in the event file
with TensorBoard's own reader.

Also measured: why a child process and not a thread. A loop of small torch ops (what a host thread launching GPU
kernels does: each op lets go of the GIL and takes it back) alone, beside a thread drawing the same pictures, and
beside the drawing child, for --contention-s each, in turns, 3 rounds (medians).

    python benchmarks/eval_overhead.py                                   # mnist_convnet and cifar_cnn
    python benchmarks/eval_overhead.py --recipes cifar_cnn --evals 5 --before-rev cdf4853
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trees import extract, import_recipe_of

REPO = Path(__file__).resolve().parents[1]
VAL_IMAGES = {"fashion_mnist_mlp": 6000, "mnist_convnet": 6000, "cifar_cnn": 5000}  # 10% of each training set
SHAPES = {"fashion_mnist_mlp": (1, 28, 28), "mnist_convnet": (1, 28, 28), "cifar_cnn": (3, 32, 32)}
ROUNDS = 3  # of the small-op loop's three cases, medians reported
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --- one row, in its own process, on one source tree --------------------------------------------------------------


def worker(args) -> dict:
    """Time an evaluation with its record on ``args.tree``'s library (imported from there, not from this
    repository)."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    module = import_recipe_of(args.tree, args.recipe)
    from common.config import parse_config
    from common.data.augment import BatchTransform, channel_stats
    from common.train.evaluator import Evaluator
    from common.train.metrics import evaluate
    from common.train.tracking import MetricsLog, log_with

    torch.set_num_threads(args.threads)
    cfg = parse_config(module.Config, [])
    images, labels = torch.load(args.data)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True)
    accelerator = Accelerator(cpu=True, mixed_precision="no", log_with=log_with("tensorboard"))
    log = MetricsLog(accelerator, run_dir, None, "eval_overhead", {})
    torch.manual_seed(0)
    model = module.build_model(cfg, tuple(images.shape[1:]), len(CLASSES))
    if getattr(cfg, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)
    transform = BatchTransform(*channel_stats(images), channels_last=getattr(cfg, "channels_last", False))
    batch = cfg.eval_batch_size
    loader = [(images[i : i + batch], labels[i : i + batch]) for i in range(0, len(labels), batch)]
    split = SimpleNamespace(images_at=lambda idx: images[idx])
    data = SimpleNamespace(val=split, test=None, class_names=CLASSES)
    tta = getattr(cfg, "tta", 0)

    def evaluate_now():
        return evaluate(accelerator, model, loader, transform, len(CLASSES), tta=tta)

    if hasattr(Evaluator, "record"):  # the loop evaluates and the evaluator records (run.evaluate)
        evaluator = Evaluator(cfg, accelerator, model, data, log, {"recipe": args.recipe}, run_dir, None)

        def evaluate_once(step, epoch):
            evaluator.record(evaluate_now(), step, epoch)

    else:  # an older tree (--before-rev): the evaluator called the evaluation itself
        evaluator = Evaluator(cfg, accelerator, evaluate_now, model, data, log, {"recipe": args.recipe}, run_dir, None)

        def evaluate_once(step, epoch):
            evaluator.run(step=step, epoch=epoch, mid_epoch=False)

    rows = []
    for i in range(args.warmup + args.evals):
        evaluator.best = None  # every evaluation writes best/
        time.sleep(args.gap_s)  # the training between two evaluations
        t0 = time.perf_counter()
        evaluate_once(10 * (i + 1), i)
        t1 = time.perf_counter()
        evaluator.best  # noqa: B018 - what the epoch-end checkpoint reads next (it waits for best/)
        t2 = time.perf_counter()
        if i >= args.warmup:
            rows.append({"forward_s": evaluator.seconds, "held_s": t1 - t0 - evaluator.seconds, "best_wait_s": t2 - t1})
    t0 = time.perf_counter()
    log.close()
    close_s = time.perf_counter() - t0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    images_found = {tag: len(acc.Images(tag)) for tag in acc.Tags()["images"]}
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "tree": str(args.tree),
        "recipe": args.recipe,
        "model": type(model).__name__,
        "val_images": len(labels),
        "eval_batch": batch,
        "tta": tta,
        "evaluations": rows,
        **{f"median_{k}": v for k, v in med.items()},
        "close_s": close_s,
        "images_in_tensorboard": images_found,
        "evaluations_total": args.warmup + args.evals,
    }


# --- why a child process: a small-op loop beside the drawing ------------------------------------------------------


def contention(seconds: float) -> dict:
    """Iterations per second of a loop of small torch ops: alone, beside a thread drawing, beside the drawing child."""
    import numpy as np
    import torch

    from common.train.render import Renderer, draw

    rng = np.random.default_rng(0)
    job = {"title": "confusion matrix, eval split (5000 images), step 1", "class_names": CLASSES}
    job["draw"] = ["confusion", "misclassified"]
    arrays = {
        "confusion": rng.integers(0, 100, (10, 10)),
        "images": rng.integers(0, 256, (36, 3, 32, 32), dtype=np.uint8),
        "labels": np.arange(36) % 10,
        "preds": (np.arange(36) + 1) % 10,
    }
    x = torch.randn(64)
    before = torch.get_num_threads()
    torch.set_num_threads(1)

    def rate() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            (x * 2 + 1).relu_()
            n += 1
        return n / (time.perf_counter() - t0)

    def beside_thread() -> float:
        stop = threading.Event()
        thread = threading.Thread(target=lambda: [draw(job, arrays) for _ in iter(stop.is_set, True)], daemon=True)
        thread.start()
        try:
            return rate()
        finally:
            stop.set()
            thread.join()

    def beside_child() -> float:
        for _ in range(max(2, int(seconds / 0.3) + 2)):  # enough pictures to keep it drawing the whole time
            renderer.submit(job, arrays)
        try:
            return rate()
        finally:
            renderer.finish(timeout=300)

    draw(job, arrays)  # matplotlib imported and warm in this process
    renderer = Renderer(max_pending=64)
    renderer.collect(until=renderer.submit(job, arrays), timeout=120)  # the child started and warm
    rounds = {"alone": [], "beside_thread": [], "beside_child": []}
    for _ in range(ROUNDS):  # in turns: the machine's drift hits all three alike
        for name, measure in (("alone", rate), ("beside_thread", beside_thread), ("beside_child", beside_child)):
            rounds[name].append(measure())
    renderer.stop()
    torch.set_num_threads(before)
    return {"seconds": seconds, **{f"{k}_per_s": statistics.median(v) for k, v in rounds.items()}, "rounds": rounds}


# --- the study ----------------------------------------------------------------------------------------------------


def row(tree: Path, recipe: str, data: Path, work: Path, args, name: str) -> dict:
    out = work / f"{name}-{recipe}.json"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(tree),
        "--recipe",
        recipe,
        "--data",
        str(data),
        "--run-dir",
        str(work / f"run-{name}-{recipe}"),
        "--out",
        str(out),
        "--evals",
        str(args.evals),
        "--warmup",
        str(args.warmup),
        "--gap-s",
        str(args.gap_s),
        "--threads",
        str(args.threads),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {recipe}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eval_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="mnist_convnet,cifar_cnn", help="comma-separated shipped recipes")
    p.add_argument("--before-rev", default="cdf4853", help="the revision timed as `before` ('none': leave it out)")
    p.add_argument("--evals", type=int, default=5, help="timed evaluations per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed evaluations first (matplotlib's first figure)")
    p.add_argument("--gap-s", type=float, default=3.0, help="seconds between evaluations (the training between)")
    p.add_argument("--val-images", type=int, help="images evaluated (default: the recipe's validation split)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each row (a rank of cpu_2proc.yaml: 1)")
    p.add_argument("--contention-s", type=float, default=3.0, help="seconds of each small-op loop (0: leave out)")
    p.add_argument("--out-json", type=Path, help="default benchmarks/results/eval_overhead-<hostname>.json")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        args.tree = args.worker
        Path(args.out).write_text(json.dumps(worker(args), indent=2))
        return 0

    import harness  # puts this repository first on sys.path (the worker above imports its own tree's)
    import torch

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in VAL_IMAGES]
    if unknown or args.evals < 1 or args.warmup < 0 or (args.val_images is not None and args.val_images < 1):
        harness.bad_input(
            f"--recipes {args.recipes} --evals {args.evals} --warmup {args.warmup} --val-images {args.val_images}: "
            f"the recipes are {', '.join(VAL_IMAGES)}; --evals and --val-images at least 1, --warmup at least 0."
        )
    load_start, t_start = harness.warn_if_busy(), time.perf_counter()
    report = {"rows": {}, "skipped": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"after": REPO}
        if args.before_rev != "none":
            try:
                trees = {"before": extract(args.before_rev, work / "before"), **trees}
            except (OSError, subprocess.CalledProcessError) as err:
                report["skipped"]["before"] = f"git archive {args.before_rev}: {harness.first_line(err)}"
        for recipe in recipes:
            data = work / f"{recipe}.pt"
            torch.save(harness.synthetic_images(SHAPES[recipe], args.val_images or VAL_IMAGES[recipe]), data)
            for name, tree in trees.items():
                print(f"  {name} {recipe} ...", end=" ", flush=True)
                t = time.perf_counter()
                try:
                    report["rows"][f"{name}/{recipe}"] = row(tree, recipe, data, work, args, name)
                    print(f"{time.perf_counter() - t:.1f} s", flush=True)
                except RuntimeError as err:
                    report["skipped"][f"{name}/{recipe}"] = str(err)
                    print(f"FAILED\n{err}", flush=True)
        if args.contention_s > 0:
            report["contention"] = contention(args.contention_s)
    rows, ratios = report["rows"], {}
    held = {key: r["median_held_s"] + r["median_best_wait_s"] for key, r in rows.items()}
    for recipe in recipes:
        for name, target in (("before", (None, None)), ("after", ("<=", 1.0))):  # the measure: <= 1
            key = f"{name}/{recipe}"
            if key in rows:
                label = f"{recipe} {name}: (held + best/ wait) / forward"
                ratios[f"{name}_{recipe}"] = (label, held[key] / rows[key]["median_forward_s"], *target)
        if f"before/{recipe}" in held and f"after/{recipe}" in held:
            gain = held[f"before/{recipe}"] / max(held[f"after/{recipe}"], 1e-9)
            ratios[f"gain_{recipe}"] = (f"{recipe}: held before / held after", gain, None, None)
    c = report.get("contention")
    if c:
        ratios["thread"] = (
            "small-op loop beside a drawing thread / alone",
            c["beside_thread_per_s"] / c["alone_per_s"],
            None,
            None,
        )
        ratios["child"] = (
            "small-op loop beside the drawing child / alone",
            c["beside_child_per_s"] / c["alone_per_s"],
            None,
            None,
        )
    report = {
        **harness.provenance("eval_overhead", argv, torch.device("cpu"), load_start),
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k in ("recipes", "before_rev", "evals", "warmup", "gap_s", "val_images", "threads", "contention_s")
        },
        **report,
        "ratios": harness.judge(ratios),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print("\n" + table(report) + "\n")
    harness.save(
        report, args.out_json or REPO / "benchmarks" / "results" / f"eval_overhead-{socket.gethostname()}.json"
    )
    return 0


def table(report: dict) -> str:
    import harness

    lines = [harness.machine_line(report["machine"]), ""]
    lines.append(
        f"{'row':<24}{'forward s':>10}{'held s':>9}{'best/ wait s':>13}{'end wait s':>11}  images in TensorBoard"
    )
    for key, r in report["rows"].items():
        found = ", ".join(f"{tag} {n}" for tag, n in sorted(r["images_in_tensorboard"].items()))
        lines.append(
            f"{key:<24}{r['median_forward_s']:>10.3f}{r['median_held_s']:>9.3f}{r['median_best_wait_s']:>13.3f}"
            f"{r['close_s']:>11.3f}  {found} (of {r['evaluations_total']} evaluations)"
        )
    c = report.get("contention")
    if c:
        lines.append(
            f"\nsmall-op loop, iterations/s: alone {c['alone_per_s']:,.0f}, beside a drawing thread "
            f"{c['beside_thread_per_s']:,.0f}, beside the drawing child {c['beside_child_per_s']:,.0f}"
        )
    lines += harness.ratio_lines(report["ratios"])
    return "\n".join(lines + [f"not measured {what}: {why.splitlines()[0]}" for what, why in report["skipped"].items()])


if __name__ == "__main__":
    sys.exit(main())
