"""Several seeds of a recipe in one process, launched once: what a GPU's seeds cost beyond the first launch.

`accelerate launch` starts the process once (imports, CUDA, the launcher: most of a short GPU run's wall time); the
recipe's ``main`` then runs once per seed, each into its own run directory, with Accelerate's state reset between
them, as the test suite runs recipes in its own process. The first seed pays the one-time costs of the process
(imports, the first CUDA kernels, cuDNN's searches for its shapes); the later ones show what a run costs warm.
time_to_accuracy.py --recipe-seeds-in-one-process uses it and reads each run directory as it reads a launched run's.

    accelerate launch --config_file accelerate_configs/single_gpu.yaml benchmarks/seeds_in_process.py \\
        --recipe cifar_cnn --seeds 1,2,3 --runs-dir /tmp/seeds -- --dataset ../shared/data/cifar10

Each seed's run directory is <runs-dir>/run-seed<N>; <runs-dir>/seeds.json records each seed's exit code and the
seconds its ``main`` took (its own wall: launch to exit of a one-seed launch, less the process's start).
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="a recipe name (recipes/<name>.py) or a recipe file")
    p.add_argument("--seeds", required=True, help="comma-separated")
    p.add_argument("--runs-dir", required=True, type=Path)
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: the recipe's own flags")
    args = p.parse_args(argv)
    from accelerate.state import AcceleratorState, GradientState

    from common.tools.recipe_files import import_recipe

    module = import_recipe(args.recipe)
    own = [a for a in args.recipe_args if a != "--"]
    done = []
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        run_dir = args.runs_dir / f"run-seed{seed}"
        t0 = time.perf_counter()
        try:
            code = module.main([*own, "--seed", str(seed), "--output-dir", str(run_dir)])
        except SystemExit as stop:  # bad input ends a recipe's launch with its exit code
            code = stop.code if isinstance(stop.code, int) else 1
        done.append({"seed": seed, "exit_code": code, "main_s": time.perf_counter() - t0, "run_dir": str(run_dir)})
        AcceleratorState._reset_state(True)  # the next seed's Accelerator is built afresh, in this process
        GradientState._reset_state()
        if code:
            break
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    (args.runs_dir / "seeds.json").write_text(json.dumps(done, indent=2) + "\n")
    return max((d["exit_code"] for d in done), default=0)


if __name__ == "__main__":
    sys.exit(main())
