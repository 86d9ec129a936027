"""What a run reports while it trains: the trackers chosen with ``--report-to`` through Accelerate's tracker API
(``log_with``, ``init_trackers``, ``log``; TensorBoard by default, wandb, MLflow, Comet, Aim, ...), ``metrics.jsonl``
(one of those trackers, the run's own record), TensorBoard's evaluation pictures and hyperparameters, throughput and
memory, and progress where the user reads it (tqdm's bar in a terminal, a line every ``--progress-every-s`` seconds
in a log file)."""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from pathlib import Path

import torch

from common import console
from common.errors import ConfigError
from common.files import write_atomic
from common.train import plots

TENSORBOARD_DIR = "tensorboard"  # <run dir>/tensorboard holds the event files, whatever else is reported to
METRICS_FILE = "metrics.jsonl"  # the tracker's name, and the file's
WANDB_ID_FILE = "wandb-run-id"  # in the run directory: one W&B run for the training run, across its resumes
WANDB_ID = re.compile(r"[a-z0-9]{8,64}")


def trackers_from(report_to: str) -> list[str]:
    """``--report-to`` as Accelerate tracker names: a comma list, ``all`` (every tracker whose package is installed)
    or ``none``. A name Accelerate does not know, or whose package is missing, is an error before anything runs
    (Accelerate itself would drop a missing one without a word, and the run would log nowhere)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    names = list(dict.fromkeys(n.strip() for n in report_to.split(",") if n.strip()))
    installed = [str(t) for t in get_available_trackers()]
    if names in ([], ["none"]):
        return []
    if "all" in names or "none" in names:
        if len(names) > 1:
            raise ConfigError(
                f"--report-to {report_to!r}: 'all' and 'none' stand alone; pass one of them, or a "
                "comma-separated list of trackers."
            )
        return sorted(installed, key=lambda n: n != "tensorboard")
    if unknown := [n for n in names if n not in LOGGER_TYPE_TO_CLASS]:
        raise ConfigError(
            f"--report-to {report_to!r}: {', '.join(unknown)} is not one of Accelerate's trackers "
            f"({', '.join(LOGGER_TYPE_TO_CLASS)}). Pass a comma-separated list of them, 'all' or "
            "'none'; metrics.jsonl in the run directory is written in every case."
        )
    if missing := [n for n in names if n not in installed]:
        many = len(missing) > 1
        raise ConfigError(
            f"--report-to {','.join(missing)}: the {' and '.join(missing)} package{'s are' if many else ' is'} not "
            f"installed in this Python environment, so nothing would reach {'them' if many else 'it'}. Install it "
            f"(pip install {' '.join(missing)}), or leave it out of --report-to (trackers installed here: "
            f"{', '.join(installed) or 'none'}; metrics.jsonl is written in every case)."
        )
    return names


def log_with(report_to: str) -> list:
    """What ``Accelerator(log_with=...)`` gets: metrics.jsonl (always) and TensorBoard as tracker objects of our own
    (their folder is the run directory, set once it is known), every other tracker by name. Made here so that
    importing this module does not import Accelerate."""
    from accelerate.tracking import GeneralTracker, TensorBoardTracker

    class MetricsFile(GeneralTracker):
        """Whatever reaches ``accelerator.log(values, step=...)`` is written here, and drawn in curves.png: one JSON
        line per step, values logged at a step already written merged into its line (whose ``time`` is then that of
        its last value). Numbers only (a 0-dim tensor is read, a string left out)."""

        name, requires_logging_directory = METRICS_FILE, False

        def __init__(self):
            super().__init__()
            self.path, self.last, self.last_offset = None, None, 0

        @property
        def tracker(self):
            return self.path

        def open(self, run_dir: Path, resume_step: int | None) -> None:
            """None starts the file afresh; a step keeps the lines up to it (a crashed run's later ones dropped)."""
            self.path, kept = Path(run_dir) / METRICS_FILE, []
            if resume_step is not None and self.path.exists():
                kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
                kept = [row for row in kept if row.get("step", 0) <= resume_step]
            lines = [json.dumps(row) + "\n" for row in kept]
            self.path.write_text("".join(lines))
            self.last = kept[-1] if kept else None
            self.last_offset = sum(len(line.encode()) for line in lines[:-1])  # where the last line starts

        def log(self, values: dict, step: int | None = None, extra: dict | None = None, **kwargs) -> None:
            """``extra``: values for this file only (when an evaluation finished, how long it took)."""
            if self.path is None:
                return
            values = {k: float(v) for k, v in values.items() if isinstance(v, (int, float, torch.Tensor))}
            values.update(extra or {})
            if step is None:  # other trackers count a step-less value at their own counter; here: the last step
                step = self.last["step"] if self.last is not None else 0
            now = round(time.time(), 3)
            merge = self.last is not None and self.last["step"] == step
            self.last = {**self.last, **values, "time": now} if merge else {"step": step, "time": now, **values}
            with self.path.open("r+" if merge else "a") as f:
                if merge:  # rewrite only the last line, in place
                    f.seek(self.last_offset)
                    f.truncate()
                self.last_offset = f.tell()
                f.write(json.dumps(self.last) + "\n")

    class RunTensorBoard(TensorBoardTracker):
        def __init__(self):
            super().__init__(TENSORBOARD_DIR, ".")

    return [MetricsFile(), *(RunTensorBoard() if n == "tensorboard" else n for n in trackers_from(report_to))]


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of this training run: a new one at a fresh start, written to the run directory; at a resume the
    one written there (``resume="allow"`` then continues that W&B run's curves instead of opening a new run at every
    restart). A file that does not hold an id (edited, damaged) is not used: a new id, said in a NOTE."""
    path = run_dir / WANDB_ID_FILE
    if resumed:
        try:
            kept = path.read_text().strip()
        except OSError:
            kept = ""
        if WANDB_ID.fullmatch(kept):
            return kept
        if path.exists():
            console.say(f"NOTE: {path} holds no W&B run id; this resume reports to a new W&B run.")
    new = secrets.token_hex(4)  # 8 characters from [0-9a-f], as W&B's own ids
    write_atomic(path, (new + "\n").encode())
    return new


class MetricsLog:
    """The trackers, metrics.jsonl among them, started with ``accelerator.init_trackers`` (main process only; other
    ranks no-op). ``project`` names every tracker's project or experiment, the run directory's name its run; the
    hyperparameters go to every tracker at the start, except TensorBoard, which gets them with the final metrics (its
    HParams tab). ``resume_step``: None starts afresh; a step keeps metrics.jsonl's lines up to it and hides
    TensorBoard's events past it (``purge_step``)."""

    def __init__(self, accelerator, run_dir: Path, resume_step: int | None, project: str = "", hparams=None):
        self.accelerator, self.path = accelerator, Path(run_dir) / METRICS_FILE
        self.config = hparams or {}  # TensorBoard's HParams session gets them with the final metrics (``hparams``)
        if not accelerator.is_main_process:
            return
        names = [getattr(t, "name", None) for t in accelerator.log_with]
        for tracker, name in zip(accelerator.log_with, names):
            if name == METRICS_FILE:
                tracker.open(run_dir, resume_step)
            if name == "tensorboard":
                tracker.logging_dir_param = str(run_dir)
                tracker.init_kwargs = {"purge_step": 0 if resume_step is None else resume_step + 1}
        wandb = {"name": Path(run_dir).name, "dir": str(run_dir)}
        if "wandb" in names:
            wandb.update(id=wandb_run_id(Path(run_dir), resume_step is not None), resume="allow")
        init_kwargs = {"mlflow": {"run_name": Path(run_dir).name}, "wandb": wandb}
        accelerator.init_trackers(project or TENSORBOARD_DIR, init_kwargs=init_kwargs)
        for tracker in accelerator.trackers:
            if tracker.name not in ("tensorboard", METRICS_FILE) and hparams:
                tracker.store_init_configuration(hparams)

    @property
    def writer(self):
        """TensorBoard's SummaryWriter, or None (another rank, or not reported to)."""
        if not self.accelerator.is_main_process:
            return None
        found = [t for t in self.accelerator.trackers if t.name == "tensorboard"]
        return found[0].tracker if found else None

    def log(self, values: dict, step: int, extra: dict | None = None) -> None:
        """``values`` to every tracker through ``accelerator.log``; ``extra`` (e.g. when an evaluation finished and
        how long it took) only to metrics.jsonl."""
        if self.accelerator.is_main_process:
            values = {k: float(v) for k, v in values.items()}
            self.accelerator.log(values, step=step, log_kwargs={METRICS_FILE: {"extra": extra}})

    def images(self, split: str, metrics: dict, data_split, class_names, step: int, final=False, pictures=False):
        """An evaluation's confusion matrix and grid of up to 36 misclassified images, into TensorBoard at ``step``
        (about a second on a 2-core CPU). Drawn for the final evaluation, which returns its confusion matrix as PNG
        bytes (drawn without TensorBoard too: the run's confusion_matrix.png), and for the evaluations the loop asks
        pictures of (``run.evaluate(..., pictures=True)``, only into TensorBoard); None otherwise."""
        writer = self.writer
        if (
            not (final or (pictures and writer is not None))
            or not metrics["count"]
            or not self.accelerator.is_main_process
        ):
            return None
        title = f"{plots.confusion_matrix_title(split, metrics['count'])}, step {step}"
        names, drawn = [str(n) for n in class_names], {}
        try:
            if metrics["confusion"] is not None:  # not drawn past common.train.metrics.CONFUSION_MAX_CLASSES classes
                drawn["confusion_matrix"] = plots.confusion_matrix_image(metrics["confusion"], names, title=title)
            if writer is not None:
                preds, labels = metrics["preds"], metrics["labels"]
                wrong = ((preds != labels) & (labels >= 0)).nonzero().flatten()[:36]  # a damaged photo: label < 0
                grid = plots.misclassified_grid(data_split.images_at(wrong), labels[wrong], preds[wrong], names)
                drawn["misclassified"] = grid
            png = plots.png_bytes(drawn["confusion_matrix"]) if final and "confusion_matrix" in drawn else None
        except Exception as err:  # noqa: BLE001 - a picture is a side product: the run it describes stands
            console.say(f"NOTE: the {split} pictures of step {step} could not be drawn ({type(err).__name__}: {err})")
            return None
        for name, image in drawn.items() if writer is not None else ():  # Pillow's PNG, as png: the same picture
            writer.add_image(f"{split}/{name}", image, step, dataformats="HWC")
        return png

    def curves(self) -> bytes | None:
        """curves.png of the run so far (after ``close``): loss, accuracy and the loop's own scalars by step."""
        if not self.accelerator.is_main_process:
            return None
        try:
            return plots.curves_png(self.path)
        except Exception as err:  # noqa: BLE001 - a picture is a side product: the run it describes stands
            console.say(f"NOTE: curves.png could not be drawn ({type(err).__name__}: {err})")
            return None

    def hparams(self, metrics: dict) -> None:
        """The hyperparameters given at the start with ``metrics`` as one HParams session in TensorBoard's own event
        file (SummaryWriter.add_hparams, which Accelerate's store_init_configuration calls, writes it into a new
        sub-run: a second run in TensorBoard's list)."""
        if (writer := self.writer) is not None:
            from torch.utils.tensorboard.summary import hparams as hparams_summary

            for summary in hparams_summary(self.config, metrics):
                writer._get_file_writer().add_summary(summary)

    def close(self) -> None:
        """Finish the trackers (main process). Not accelerator.end_training(): it also destroys the process group,
        on the main process only, and a worker still holding its own then aborts at exit ("terminate called without
        an active exception": exit 1 through the launcher for a completed run). A run that ends well destroys it
        on every rank at once, last (TrainingRun._close)."""
        if self.accelerator.is_main_process:
            for tracker in self.accelerator.trackers:
                tracker.finish()


class Throughput:
    """Per log window: global samples/s, the share of wall time spent waiting for data, peak memory; and ``lr``, the
    learning rate the last step used (before the scheduler moved it)."""

    def __init__(self, device):
        self.device, self.lr = device, None
        self.t0, self.samples, self.data_wait = time.perf_counter(), 0, 0.0

    def add(self, samples: int, wait: float) -> None:
        self.samples += samples
        self.data_wait += wait

    def read_and_reset(self) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        out = {
            "train/samples_per_sec": self.samples / elapsed,
            "train/data_wait_fraction": self.data_wait / elapsed,
            "train/peak_memory_mb": peak_memory_mb(self.device),
        }
        self.t0, self.samples, self.data_wait = now, 0, 0.0
        return out


def peak_memory_mb(device) -> float:
    """Peak CUDA memory allocated by this process; on a Mac's GPU (MPS, which keeps no peak) the memory its Metal
    driver holds for the process now; on a CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 2**20
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def on_terminal(accelerator) -> bool:
    """Progress bars on the local main process only, and only on a terminal (not in log files)."""
    return accelerator.is_local_main_process and sys.stderr.isatty()


def format_duration(seconds: float) -> str:
    h, rest = divmod(max(0, int(seconds)), 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """A tqdm bar per epoch in a terminal; in a log file a line every ``every_s`` seconds:
    ``step 120/1407 (epoch 1/3) loss 0.2345 1,234 samples/s ETA 3m12s``. While a bar is shown,
    ``common.console.say`` prints through it, so messages never land on top of it. Main process only."""

    def __init__(self, accelerator, cfg, total_steps: int):
        self.accelerator, self.cfg, self.total, self.every_s = accelerator, cfg, total_steps, cfg.progress_every_s
        self.tty, self.bar = on_terminal(accelerator), None
        self.t_start, self.step_start, self.last_line, self.epoch_t0 = time.time(), None, time.time(), time.time()
        self.eval_s, self.evals = 0.0, 0  # evaluation time and evaluations made since the start (or resume)

    def note_eval(self, seconds: float | None) -> None:
        """The loop made an evaluation of ``seconds``: the ETA counts evaluation time apart from training and expects
        the loop to go on evaluating as often as it has so far."""
        if seconds is not None:
            self.eval_s += seconds
            self.evals += 1

    def eta(self, step: int, epoch: int, now: float) -> str:
        """Training left at the training-only rate, plus evaluations: as many per step as the loop has made so far,
        then the final one, each as long as they have taken on average; before any evaluation, said to be left out."""
        trained = step - self.step_start
        rate = trained / max(now - self.t_start - self.eval_s, 1e-9)
        if rate <= 0:
            return "?"
        steps_left = self.total - step
        if not self.evals:
            return f"{format_duration(steps_left / rate)} + evaluations"
        evals_left = self.evals / trained * steps_left + 1
        return format_duration(steps_left / rate + evals_left * self.eval_s / self.evals)

    def wrap(self, iterable, epoch: int, initial: int, total: int):
        if not self.tty:
            return iterable
        from tqdm.auto import tqdm

        desc = f"epoch {epoch + 1}/{self.cfg.epochs}"
        self.bar = tqdm(iterable, desc=desc, initial=initial, total=total, leave=False)
        console.show_bar(self.bar)  # messages go through it meanwhile
        return self.bar

    def close_bar(self) -> None:
        if self.bar is not None:
            console.show_bar(None)
            self.bar.close()
            self.bar = None

    def begin(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: the ETA counts from here."""
        self.step_start, self.t_start, self.eval_s, self.evals = step, time.time(), 0.0, 0

    def begin_epoch(self) -> None:
        self.epoch_t0 = time.time()

    def epoch_seconds(self) -> float:
        return time.time() - self.epoch_t0

    def update(self, step: int, epoch: int, loss: float | None, samples_per_s: float | None) -> None:
        """At a log step: postfix the bar, or print a line when ``every_s`` has passed."""
        now = time.time()
        if self.step_start is None:
            self.begin(step - 1)
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        if not self.accelerator.is_main_process or now - self.last_line < self.every_s or loss is None:
            return
        self.last_line = now
        speed = f" {samples_per_s:,.0f} samples/s" if samples_per_s else ""
        eta = self.eta(step, epoch, now)
        console.say(f"step {step}/{self.total} (epoch {epoch + 1}/{self.cfg.epochs}) loss {loss:.4f}{speed} ETA {eta}")


def sanitize_for_hparams(cfg_dict: dict) -> dict:
    """TensorBoard hparams take only int/float/str/bool: None dropped, the rest as JSON."""
    return {
        k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in cfg_dict.items() if v is not None
    }
