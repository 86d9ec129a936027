"""The floor under a recipe's launch to exit on this machine: what any run of it pays that is not the recipe's own
work, each part timed in fresh processes the way a run pays it.

- interpreter: a Python process's start and exit (its wall time less what it timed inside);
- torch import: ``import torch``, timed inside that process;
- device init: the first tensor on the device and back (CUDA's context; next to nothing on a CPU), timed there too;
- first optimizer: building any ``torch.optim`` optimizer the first time imports ``torch._dynamo`` (a plain
  PyTorch loop pays it too), timed there too;
- data read: the recipe's own read of its dataset (``load_image_data`` with the recipe's Config: its decoded cache),
  timed inside its process;
- launcher: ``accelerate launch --config_file <config> noop.py`` less ``python noop.py``.

The floor is their sum. Beside it, not in it: the recipe's imports (accelerate and common.api after the parts above,
timed in the same process), and the recipe itself launched the same way for one optimizer step (``--max-steps 1``
and --recipe-args), launch to exit: the floor plus everything the recipe does once (its Accelerator, run folder,
model, evaluation, checkpoint, pictures and summary). The recipe runs once untimed first, so that what a first run
makes (the decoded cache, matplotlib's font list) is there, as every later run finds it. Medians of --repeats; the
machine in the JSON.

    python benchmarks/floor.py --recipe mnist_convnet --dataset ../shared/data/mnist --out /tmp/floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
PARTS = ("interpreter", "torch_import", "device_init", "first_optimizer", "data_read", "launcher")


def read_data(recipe: str, argv: list[str]) -> None:
    """(In a process of its own) the recipe's data read, timed; prints its seconds as JSON."""
    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]
    from launching import recipe_config

    from common.data.decoded import load_image_data

    cfg = recipe_config(recipe, argv)
    t0 = time.perf_counter()
    data = load_image_data(cfg, cfg.dataset, True)
    print(json.dumps({"data_read_s": time.perf_counter() - t0, "train_images": len(data.train)}))


PROBE = """import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.ones(1, device={device!r}).add_(1).cpu()
t2 = time.perf_counter()
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
t3 = time.perf_counter()
import accelerate, common.api
t4 = time.perf_counter()
print(json.dumps(dict(torch_import=t1 - t0, device_init=t2 - t1, first_optimizer=t3 - t2, recipe_imports=t4 - t3,
                      inside=t4 - t0)))
"""


def measure(args) -> dict:
    from launching import recipe_env

    py, env = sys.executable, recipe_env(threads=None)  # offline, precision from the launcher only
    env.setdefault("OMP_NUM_THREADS", "1")  # what the launcher gives each process unless it is set
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    device = "cuda" if args.device == "cuda" else "cpu"
    config = args.accelerate_config or CONFIGS / ("single_gpu.yaml" if device == "cuda" else "cpu.yaml")
    data_args = ["--dataset", args.dataset, *(["--cache-dir", str(args.cache_dir)] if args.cache_dir else [])]
    data_cmd = [py, __file__, "--read-data", "--recipe", args.recipe, "--", *data_args]

    def child(cmd) -> tuple[dict, float]:  # what the process printed last (JSON, else {}), and its wall seconds
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode:  # what the part said, less the launcher's traceback after it
            said = done.stderr.split("Traceback (most recent call last)")[0].strip() or done.stderr.strip()[-2000:]
            raise RuntimeError(f"{' '.join(map(str, cmd))} exited {done.returncode}: {said}")
        wall_s, last = time.perf_counter() - t0, (done.stdout.strip().splitlines() or ["-"])[-1]
        return (json.loads(last) if last.startswith("{") else {}), wall_s

    samples = {k: [] for k in (*PARTS, "recipe_imports", "one_step_run")}
    with tempfile.TemporaryDirectory() as tmp:
        noop = Path(tmp) / "noop.py"
        noop.write_text("pass\n")
        launch = [py, "-m", "accelerate.commands.launch", "--config_file", config, noop]
        run = [*launch[:-1], REPO / "recipes" / f"{args.recipe}.py", *data_args, "--max-steps", "1", "--epochs", "1"]
        run += shlex.split(args.recipe_args)
        # once, untimed: what a first run makes (the decoded cache, matplotlib's font list) is there, as any run
        # after the first finds it
        child([*run, "--output-dir", Path(tmp) / "run-first"])
        for _ in range(args.repeats):  # the parts interleaved, so a drifting machine touches each alike
            inside, probe_wall = child([py, "-c", PROBE.format(device=device)])
            samples["interpreter"].append(probe_wall - inside["inside"])  # start-up and exit, around the imports
            for k in ("torch_import", "device_init", "first_optimizer", "recipe_imports"):
                samples[k].append(inside[k])
            samples["data_read"].append(child(data_cmd)[0]["data_read_s"])
            samples["launcher"].append(child(launch)[1] - child([py, noop])[1])
            out_dir = Path(tmp) / f"run-{len(samples['one_step_run'])}"
            samples["one_step_run"].append(child([*run, "--output-dir", out_dir])[1])
    m = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "recipe": args.recipe,
        "device": device,
        "repeats": args.repeats,
        "parts_s": {k: round(m[k], 3) for k in PARTS},
        "floor_s": round(sum(m[k] for k in PARTS), 3),
        "recipe_imports_s": round(m["recipe_imports"], 3),
        "one_step_run_s": round(m["one_step_run"], 3),
        "one_step_run_args": args.recipe_args,
        "samples_s": {k: [round(x, 3) for x in v] for k, v in samples.items()},
    }


def line(r: dict) -> str:
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in r["parts_s"].items())
    return (
        f"floor {r['floor_s']:.2f} s ({parts}); beside it, the recipe's imports {r['recipe_imports_s']:.2f} s and "
        f"the recipe launched to exit for one step {r['one_step_run_s']:.2f} s "
        f"({r['one_step_run_s'] / r['floor_s']:.2f}x the floor)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="mnist_convnet", help="whose data read and imports (default mnist_convnet)")
    p.add_argument("--dataset", help="the recipe's --dataset (required)")
    p.add_argument("--cache-dir", type=Path, help="the recipe's --cache-dir (default: its own default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--accelerate-config", type=Path, help="default single_gpu.yaml on cuda, cpu.yaml on cpu")
    p.add_argument("--recipe-args", default="", help="flags of the one-step run, e.g. '--width 1 --hidden 2'")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--read-data", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("data_args", nargs="*", help=argparse.SUPPRESS)  # --read-data's, after --
    args = p.parse_args(argv)
    if args.read_data:
        read_data(args.recipe, args.data_args)
        return 0
    if args.repeats < 1 or not args.dataset:
        p.error(f"--dataset is required and --repeats must be at least 1 (got {args.dataset!r}, {args.repeats})")
    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]
    from machine import machine_info

    local = Path(args.dataset).expanduser()
    if local.exists():  # the parts run from the repository root: a folder is named absolutely (a Hub id as given)
        args.dataset = str(local.resolve())
    args.cache_dir = args.cache_dir.expanduser().resolve() if args.cache_dir else None
    try:
        result = {"benchmark": "floor", **measure(args), "machine": machine_info(args.device)}
    except RuntimeError as err:  # a part that failed: its command, exit code and the end of what it said
        sys.stderr.write(f"error: {err}\n")
        return 1
    print(line(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
