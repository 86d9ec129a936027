"""Where a run's wall time goes besides its training steps: start-up, evaluations during the run, checkpoints, the
final evaluation and the end, on two source trees of this repository side by side (`after`: this working tree;
`before`: --before-rev, default 97c2011, the last revision whose run wrote a checkpoint at every epoch end and
evaluated where its bookkeeping said, after each batch and epoch), per recipe.

Each row runs a recipe's ``main()`` in a process of its own on one tree, one process with --threads threads, on the
real data (``../shared/data``), with the recipe's defaults except those given by --epochs (the share of per-epoch
work does not depend on the number of epochs; start-up and the end weigh less in a longer run). Nothing of the
recipe is changed: the times are read around calls both trees make the same way, from outside:

- every optimizer step's end (``torch.optim.optimizer.register_optimizer_step_post_hook``): the first one ends
  start-up, the last one starts the end;
- each evaluation (the recipe module's ``evaluate``); the last one is the final evaluation;
- each checkpoint write (``common.train.checkpoint.save_checkpoint``).

``steps`` is the span from the first update's end to the last's, less the evaluations and checkpoints inside it
(what remains there is training: batches, forward, backward, updates, and the per-step bookkeeping). ``outside`` is
the share of the wall time (``main()``'s call, without the interpreter's start and exit) that is neither ``steps``
nor the final evaluation.

    python benchmarks/between_steps.py                                        # mnist_convnet, fashion_mnist_mlp
    python benchmarks/between_steps.py --recipes cifar_cnn --epochs 2 --out benchmarks/results/between_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trees import extract, import_recipe_of

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
DATASETS = {
    "mnist_convnet": "mnist",
    "fashion_mnist_mlp": "fashion_mnist",
    "cifar_cnn": "cifar10",
    "finetune_folder": "flowers",
}


def worker(args) -> dict:
    """One run of ``args.recipe`` on ``args.tree``'s library, timed from outside the recipe."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    module = import_recipe_of(args.tree, args.recipe)
    from common.train import checkpoint as ckpt

    torch.set_num_threads(args.threads)

    steps, evals, saves = [], [], []
    register_optimizer_step_post_hook(lambda *a: steps.append(time.perf_counter()))

    def timed(fn, into):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                into.append((t0, time.perf_counter()))

        return wrapper

    module.evaluate = timed(module.evaluate, evals)
    ckpt.save_checkpoint = timed(ckpt.save_checkpoint, saves)
    argv = ["--dataset", str(args.dataset), "--output-dir", str(args.run_dir), "--report-to", "none"]
    argv += ["--seed", str(args.seed)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    t0 = time.perf_counter()
    code = module.main(argv)
    t1 = time.perf_counter()
    if code != 0 or not steps:
        raise SystemExit(f"{args.recipe} on {args.tree}: exit {code}, {len(steps)} optimizer steps")
    first, last = steps[0], steps[-1]

    def inside(spans):
        return sum(b - a for a, b in spans if a >= first and b <= last)

    final = evals[-1][1] - evals[-1][0] if evals else 0.0
    mid_evals, mid_saves = inside(evals), inside(saves)
    train = last - first - mid_evals - mid_saves
    wall = t1 - t0
    summary = json.loads((Path(args.run_dir) / "summary.json").read_text())
    return {
        "wall_s": wall,
        "startup_s": first - t0,
        "steps_s": train,
        "evaluations_during_s": mid_evals,
        "evaluations_during": sum(1 for a, b in evals if a >= first and b <= last),
        "checkpoints_s": sum(b - a for a, b in saves),
        "checkpoints": len(saves),
        "final_evaluation_s": final,
        "end_s": t1 - last - final - sum(b - a for a, b in [*saves, *evals[:-1]] if a > last),
        "outside_share": 1 - (train + final) / wall,
        "updates": len(steps),
        "accuracy": summary.get("final", {}),
        "status": summary.get("status"),
    }


def row(tree: Path, recipe: str, work: Path, args, name: str) -> dict:
    out, run_dir = work / f"{name}-{recipe}.json", Path(tempfile.mkdtemp(dir=work, prefix=f"run-{name}-{recipe}-"))
    cmd = [sys.executable, __file__, "--worker", str(tree), "--recipe", recipe, "--run-dir", str(run_dir)]
    cmd += ["--dataset", str(args.data / DATASETS[recipe]), "--out", str(out), "--threads", str(args.threads)]
    cmd += ["--seed", str(args.seed)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    env["ACCELERATE_RECIPES_CACHE"] = str(work / "cache")  # the decoded data: one cache for both trees
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {recipe}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="mnist_convnet,fashion_mnist_mlp")
    p.add_argument("--before-rev", default="97c2011")
    p.add_argument("--epochs", type=int, help="instead of each recipe's default (said in the table)")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="the rows as JSON")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--dataset", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.tree = args.worker
        Path(args.out).write_text(json.dumps(worker(args)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        before = extract(args.before_rev, work / "before")
        for recipe in [r for r in args.recipes.split(",") if r]:
            warm = argparse.Namespace(**{**vars(args), "epochs": 1})
            for name, tree in (("before", before), ("after", REPO)):  # decode the data into each tree's cache first
                row(tree, recipe, work, warm, f"warm-{name}")
            for name, tree in (("before", before), ("after", REPO), ("before", before), ("after", REPO)):
                result = row(tree, recipe, work, args, name)  # A B A B: the machine's drift hits both alike
                rows.append({"recipe": recipe, "tree": name, **result})
                print(
                    f"{recipe:18s} {name:6s} wall {result['wall_s']:7.1f} s  steps {result['steps_s']:7.1f} s  "
                    f"outside {result['outside_share']:6.1%}  (start-up {result['startup_s']:.1f} s, evaluations "
                    f"{result['evaluations_during_s']:.1f} s x{result['evaluations_during']}, checkpoints "
                    f"{result['checkpoints_s']:.1f} s x{result['checkpoints']}, final evaluation "
                    f"{result['final_evaluation_s']:.1f} s, end {result['end_s']:.1f} s)",
                    flush=True,
                )
    from machine import machine_info  # imports this tree's common: the parent only, never a worker

    cpu = machine_info("cpu")
    meta = {"machine": cpu, "threads": args.threads, "epochs": args.epochs or "defaults", "before_rev": args.before_rev}
    flags = " ".join(cpu["cpu_flags"])
    print(f"machine: lscpu flags {flags}; {args.threads} threads, 1 process; epochs {meta['epochs']}")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
