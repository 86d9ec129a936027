"""What the tests share besides fixtures: tiny datasets written to disk in the layouts users have, a launcher that
runs the recipes the way users do (`accelerate launch` with a shipped config, a free port), an in-process runner for
one-process behaviour that is not about the launcher, readers of what a run wrote, and the reference runs' settings
(the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import launching  # benchmarks/ (pytest.ini's pythonpath): the launch harness the benchmarks use too
import numpy as np
import pytest
from launching import recipe_path  # noqa: F401  (the tests import it from here)
from machine import free_port  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]


CONFIGS = REPO / "accelerate_configs"


ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def learnable_images(n: int, num_classes: int, shape, seed: int = 0):
    """uint8 images whose class is a bright block at a class-specific place, plus noise."""
    c, h, w = shape
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % num_classes
    rng.shuffle(labels)
    images = rng.integers(0, 60, size=(n, h, w, c), dtype=np.uint8)
    cells = int(np.ceil(np.sqrt(num_classes)))
    bh, bw = h // cells, w // cells
    for i, k in enumerate(labels):
        r, q = divmod(int(k), cells)
        images[i, r * bh : (r + 1) * bh, q * bw : (q + 1) * bw, :] = 200 + rng.integers(0, 55)
    return images, labels


def _pil(arr):
    from PIL import Image

    return Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)


def write_parquet_dataset(
    root: Path,
    splits: dict,
    num_classes: int = 4,
    shape=(1, 28, 28),
    image_col: str = "image",
    label_col: str = "label",
    seed: int = 0,
) -> Path:
    """A folder laid out like a Hub dataset repo: data/<split>-00000-of-00001.parquet."""
    from datasets import ClassLabel, Dataset, Features, Image

    (root / "data").mkdir(parents=True, exist_ok=True)
    names = [f"class_{k}" for k in range(num_classes)]
    for i, (split, n) in enumerate(splits.items()):
        images, labels = learnable_images(n, num_classes, shape, seed + i)
        ds = Dataset.from_dict(
            {image_col: [_pil(a) for a in images], label_col: labels.tolist()},
            features=Features({image_col: Image(), label_col: ClassLabel(names=names)}),
        )
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def write_image_folder(
    root: Path, n_per_class: int = 20, classes=("cat", "dog", "frog"), shape=(3, 32, 32), seed: int = 0
) -> Path:
    """<root>/<class>/<i>.png, the layout of a user's own data."""
    images, labels = learnable_images(n_per_class * len(classes), len(classes), shape, seed)
    for i, (arr, k) in enumerate(zip(images, labels)):
        d = root / classes[k]
        d.mkdir(parents=True, exist_ok=True)
        _pil(arr).save(d / f"{i}.png")
    return root


def recipe_env(root: Path) -> dict:
    """Environment for recipe subprocesses: private caches under ``root``, no network, 1 thread per process."""
    return launching.recipe_env(root, threads=1)


def launch(
    recipe: str,
    args,
    env,
    nproc: int = 1,
    config: str | None = None,
    timeout: int = 240,
    extra_launch=(),
    port: int | None = None,
) -> subprocess.CompletedProcess:
    """`accelerate launch` a recipe with a shipped config on a free port (or ``port``), fp32 whatever the CPU
    (the golden losses and equivalence tolerances are fp32 figures); returns the finished process."""
    cmd = launching.launch_command(recipe, args, nproc=nproc, config=config, port=port, extra_launch=extra_launch)
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


@dataclass
class InProcessResult:
    """What the tests read from a finished subprocess.CompletedProcess."""

    args: list
    returncode: int
    stdout: str
    stderr: str


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def copy_recipe(recipe: str, dest: Path) -> Path:
    """``cp recipes/<recipe>.py dest``: how a user starts a recipe of their own (nothing is rewritten)."""
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(REPO / "recipes" / f"{recipe}.py", dest))


def import_recipe(recipe):
    """The recipe file imported as a module (once per file); recipes run nothing at import."""
    return launching.import_recipe(recipe, prefix="_test_recipe")


def run_in_process(recipe, args, env, cwd=None) -> InProcessResult:
    """``main(argv)`` of a recipe in this process, as ``python recipe.py ARGS`` with ``env`` would run it
    on one process: the environment applied to os.environ, sys.argv[0] the recipe file, torch threads
    from OMP_NUM_THREADS, stdout and stderr captured, and Accelerate's singletons reset before and after.
    An exception that escapes main() is printed with its traceback to the captured stderr (exit 1), as
    Python would; SystemExit gives its code."""
    import datasets.config
    import huggingface_hub.constants
    import torch
    from accelerate.state import AcceleratorState, GradientState

    path = recipe_path(recipe)
    module = import_recipe(path)
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k not in env]:
            mp.delenv(key)
        for key, value in env.items():
            if os.environ.get(key) != value:
                mp.setenv(key, value)
        # datasets and huggingface_hub read these from the environment once, at import
        if "HF_HOME" in env:
            mp.setattr(datasets.config, "HF_DATASETS_CACHE", Path(env["HF_HOME"]) / "datasets")
        offline = env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
        mp.setattr(sys, "argv", [str(path), *argv])
        if cwd is not None:
            mp.chdir(cwd)
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", threads)))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                try:
                    code = module.main(argv)
                except SystemExit as exit_:
                    code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            torch.set_num_threads(threads)
            for sig, handler in handlers.items():  # a run that failed before its stop handlers were
                signal.signal(sig, handler)  # restored must not leave them in this process
    return InProcessResult([str(path), *argv], code or 0, out.getvalue(), err.getvalue())


def run_in_process_signalled(recipe, args, env, run_dir: Path, key: str, rows: int, sig=signal.SIGTERM):
    """``run_in_process``, with ``sig`` sent to this process once ``run_dir``/metrics.jsonl holds ``rows`` rows
    carrying ``key`` (a stop mid-run, at a point the run reached); never after main() returned, nor later than
    120 s."""
    import threading
    import time

    returned = threading.Event()

    def signal_when_logged():
        deadline = time.time() + 120
        while time.time() < deadline and not returned.is_set():
            metrics = Path(run_dir) / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count(f'"{key}"') >= rows:
                if not returned.is_set():
                    os.kill(os.getpid(), sig)  # handled by the recipe's stop flag
                return
            time.sleep(0.02)

    sender = threading.Thread(target=signal_when_logged, daemon=True)
    sender.start()
    try:
        return run_in_process(recipe, args, env)
    finally:
        returned.set()
        sender.join(timeout=10)


def check_ok(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    )
    # a worker that exits holding its process group can abort at interpreter shutdown (gloo's threads), which the
    # launcher turns into exit 1 for a completed run: every rank destroys it at the end
    assert "terminate called" not in proc.stderr and "has NOT been destroyed" not in proc.stderr, proc.stderr[-6000:]
    return proc


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSON-lines file, strictly: a missing file or a line cut short fails the test (the benchmarks'
    benchmarks/launching.py's read_jsonl forgives both, for runs that were killed)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from the run's TensorBoard event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events_dir in sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def write_photo_folder(root: Path, n_per_class: int, classes=("ant", "bee", "wasp"), seed: int = 0) -> Path:
    """<root>/<class>/<i>.<ext>: photos of mixed sizes (wide, tall, square), formats and modes (RGB JPEG with and
    without an EXIF rotation, grey PNG, palette PNG with transparency, RGBA PNG), as a user's own folder holds."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(48, 36), (36, 48), (40, 40), (64, 44), (30, 50)]
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            w, h = sizes[(i + k) % len(sizes)]
            arr = rng.integers(0, 80, size=(h, w, 3), dtype=np.uint8)
            arr[:, k * w // len(classes) : (k + 1) * w // len(classes), k % 3] = 230  # a class-coloured stripe
            img, kind = Image.fromarray(arr), i % 5
            if kind == 0:
                img.save(root / cls / f"{i}.jpg", quality=90)
            elif kind == 1:
                img.convert("L").save(root / cls / f"{i}.png")
            elif kind == 2:
                img.quantize(16).save(root / cls / f"{i}.png", transparency=0)
            elif kind == 3:
                img.convert("RGBA").save(root / cls / f"{i}.png")
            else:
                exif = Image.Exif()
                exif[0x0112] = 6  # stored sideways: viewers (and the recipe) turn it upright
                img.save(root / cls / f"{i}.jpg", quality=90, exif=exif)
    return root


SMALL = {  # each recipe's default --lr given: at --batch-size 32 the LR rule would scale it (golden losses)
    "fashion_mnist_mlp": ["--hidden", "32", "--lr", "4e-3"],
    "mnist_convnet": ["--width", "8", "--lr", "1e-2"],
    "cifar_cnn": ["--widths", "8,16,16", "--lr", "1.5", "--eval-every", 1],  # evaluated every epoch, as the others
    # lr by its rule: 0.05 at batch 32; every epoch at 32 px (progressive resizing: its own test) and evaluated
    "finetune_folder": ["--image-size", 32, "--start-image-size", 0, "--eval-every", 1, "--workers", 0],
}


TRAIN = ["--epochs", 2, "--batch-size", 32, "--log-every", 1]


REFERENCE_TRAIN = {  # (dataset fixture, training flags): what a run that resumes must repeat
    ("fashion_mnist_mlp", 1): ("mnist_like", [*TRAIN, *SMALL["fashion_mnist_mlp"]]),
    # 2 processes: given validation split of 99 images, eval batch 10 per process; no dropout, so that
    # 1 process x batch 32 must give the same weights (also when it resumes from the step-5 checkpoint)
    ("fashion_mnist_mlp", 2): (
        "awkward",
        [
            *TRAIN,
            *SMALL["fashion_mnist_mlp"],
            "--dropout",
            0,
            "--eval-batch-size",
            20,
            "--checkpoint-every",
            5,
            "--keep-checkpoints",
            10,
        ],
    ),
    # every checkpoint kept: a 2-process resume test starts from a copy of one of them
    # an evaluation and a checkpoint on the same steps: the checkpoint must hold that evaluation's result
    ("mnist_convnet", 1): (
        "mnist_like",
        [*TRAIN, *SMALL["mnist_convnet"], "--checkpoint-every", 5, "--eval-every-steps", 5, "--keep-checkpoints", 10],
    ),
    ("mnist_convnet", 2): (
        "mnist_like",
        [*TRAIN, *SMALL["mnist_convnet"], "--checkpoint-every", 5, "--eval-every-steps", 5, "--keep-checkpoints", 10],
    ),
    ("cifar_cnn", 1): ("cifar_like", [*TRAIN, *SMALL["cifar_cnn"], "--checkpoint-every", 3, "--keep-checkpoints", 10]),
    ("cifar_cnn", 2): ("cifar_like", [*TRAIN, *SMALL["cifar_cnn"], "--checkpoint-every", 3, "--keep-checkpoints", 10]),
    ("finetune_folder", 1): (
        "photos_like",
        [*TRAIN, *SMALL["finetune_folder"], "--checkpoint-every", 3, "--keep-checkpoints", 10],
    ),
    ("finetune_folder", 2): ("photos_like", [*TRAIN, *SMALL["finetune_folder"]]),
}


REFERENCE_EXTRA = {  # read-only checks riding on the reference run
    ("fashion_mnist_mlp", 1): ["--progress-every-s", 0],
    ("mnist_convnet", 1): ["--target-accuracy", 0.9],
    ("fashion_mnist_mlp", 2): ["--profile", 2],
}


def stopped_at(ref_run: Path, step: int, dest: Path) -> Path:
    """``dest`` as a run of the reference's command stopped at ``step`` leaves it: its config.json, its
    complete checkpoint of that step (written at the same point of the loop as a stopped run writes
    it), and a metrics.jsonl that goes on past the checkpoint, as after a crash (a resume must drop
    those lines and write them again)."""
    import shutil

    name = f"step-{step:08d}"
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref_run / "checkpoints" / name, dest / "checkpoints" / name)
    for f in ("config.json", "metrics.jsonl"):
        shutil.copy(ref_run / f, dest / f)
    best = ref_run / "best"
    if best.is_dir() and json.loads((best / "model.json").read_text())["step"] <= step:  # the stopped run had it
        shutil.copytree(best, dest / "best")
    return dest


@dataclass
class ReferenceRun:
    run: Path  # its run directory
    proc: object  # the finished process (stdout, stderr, returncode)
    dataset: Path
    train_args: list  # dataset and training flags, without --output-dir

    def ok(self) -> ReferenceRun:
        check_ok(self.proc)
        return self


def shared_once(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` once for the whole session, by whichever pytest-xdist worker asks first (the other waits for
    it, under a file lock) and ``folder`` for both: one copy of each dataset and each reference run, not one per
    worker. The folder is in the session's temporary folder, above each worker's own."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            make(folder)
            done.write_text("")
    return folder


def kept_result(path: Path, result=None) -> InProcessResult:
    """A finished run's returncode and output, written to ``path`` (``result`` given) or read back from it."""
    if result is not None:
        fields = {"args": [str(a) for a in result.args], "returncode": result.returncode}
        path.write_text(json.dumps({**fields, "stdout": result.stdout, "stderr": result.stderr}))
    return InProcessResult(**json.loads(path.read_text()))
