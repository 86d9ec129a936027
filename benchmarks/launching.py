"""Running a recipe the way its users do, for the benchmarks and the tests: a recipe file imported as a module and
its Config as its own parser makes it, its ``accelerate launch`` (or plain ``python``) command and a quiet, offline
environment, the run with its output kept in a log, and what a finished run wrote (``metrics.jsonl``,
``summary.json``, ``config.json``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from machine import free_port

from common.config import parse_config
from common.tools.recipe_files import RECIPES_DIR, import_recipe, recipe_path  # noqa: F401  (read from here too)

REPO = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO / "accelerate_configs"


def shipped_recipes() -> list[str]:
    """The names of the recipes in recipes/, for choices and messages."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.py"))


def recipe_config(recipe, argv=()):
    """The recipe's Config as its own command line makes it from ``argv``: its defaults, then the flags. A bad
    flag exits 2 with the recipe's one-paragraph message, as the recipe itself would."""
    return parse_config(import_recipe(recipe).Config, [str(a) for a in argv])


def launch_command(
    recipe,
    args=(),
    *,
    nproc: int = 1,
    config: str | None = None,
    port: int | None = None,
    precision: str | None = "no",
    threads: int | None = None,
    extra_launch=(),
) -> list[str]:
    """``accelerate launch --config_file <config> ... recipe ARGS`` with a free port: ``config`` is a file in
    accelerate_configs/ or a path (default: cpu.yaml for 1 process, cpu_2proc.yaml for 2); ``precision`` is passed
    to the launcher (default "no": fp32 whatever the CPU, as the golden losses are; None keeps the config's);
    ``nproc=0`` gives the plain ``python recipe ARGS`` a user runs without the launcher."""
    script = [str(recipe_path(recipe)), *map(str, args)]
    if nproc == 0:
        return [sys.executable, *script]
    config = config or ("cpu.yaml" if nproc == 1 else "cpu_2proc.yaml")
    config_path = config if os.path.isabs(config) else str(CONFIGS_DIR / config)
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    cmd = [accelerate, "launch", "--config_file", config_path, "--main_process_port", str(port or free_port())]
    if precision is not None and "--mixed_precision" not in extra_launch:
        cmd += ["--mixed_precision", precision]
    if threads is not None:
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    return [*cmd, *map(str, extra_launch), *script]


def recipe_env(
    root: Path | None = None,
    *,
    threads: int | None = 1,
    cache_dir: Path | None = None,
    cpu_only: bool = False,
    offline: bool = True,
    base: dict | None = None,
) -> dict:
    """The environment for a recipe process: no network (Hub and datasets offline), unbuffered output, ``threads``
    per process, the decoded cache in ``cache_dir`` (or ``root``/decoded-cache) and the Hub's cache in
    ``root``/hf-home; precision from the launcher only; ``cpu_only`` hides GPUs from the Accelerator."""
    env = dict(os.environ if base is None else base)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if offline:
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if root is not None:
        env.update(ACCELERATE_RECIPES_CACHE=str(Path(root) / "decoded-cache"), HF_HOME=str(Path(root) / "hf-home"))
    if cache_dir is not None:
        env["ACCELERATE_RECIPES_CACHE"] = str(cache_dir)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    return env


def run_logged(cmd, env: dict, log: Path, timeout: float | None = None, cwd: Path = REPO) -> tuple[int | str, float]:
    """Run a command from ``cwd`` (default the repository root) in a session of its own, its stdout and stderr into
    ``log`` (kept beside the run for whoever reads the numbers later): its exit code, "timeout" when stopped after
    ``timeout`` seconds, and its wall seconds. On a timeout, or when this process is stopped, the whole group is
    stopped: nothing a launcher started (its workers, compile workers) outlives the command."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=None if timeout is None else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    return code, time.perf_counter() - t0


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file such as a run's metrics.jsonl ([] when it does not exist); a last line cut
    short (a killed writer) is left out."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise
    return rows


def read_run(run_dir: Path) -> dict:
    """What a finished run wrote: ``rows`` (metrics.jsonl), ``summary`` and ``config`` ({} when missing)."""
    run_dir = Path(run_dir)

    def json_file(name):
        path = run_dir / name
        return json.loads(path.read_text()) if path.exists() else {}

    return {
        "rows": read_jsonl(run_dir / "metrics.jsonl"),
        "summary": json_file("summary.json"),
        "config": json_file("config.json"),
    }


def stop_children_on_term() -> None:
    """For a script that runs recipes with ``run_logged``: TERM and HUP end it as Ctrl-C does (an exception), so
    ``run_logged`` stops the command's whole group (the launcher and its workers, which checkpoint and exit) instead
    of leaving it training with nobody waiting for it."""

    def stop(signum, frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's HUP stays ignored
            signal.signal(sig, stop)
