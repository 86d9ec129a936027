"""Dataclass configs turned into a command line, validated, and saved with the run.

Every recipe declares one ``@dataclass`` whose fields carry a ``help`` in their metadata.
``parse_config`` builds an ``argparse`` parser from it, so ``--help`` lists every knob with its
default, and ``--some-field value`` overrides it. Launcher concerns (process count, precision,
machines) are deliberately absent: they come from ``accelerate launch`` / ``accelerate config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import EXIT_BAD_INPUT, ConfigError


def knob(default, help: str, choices=None):
    """A config field with its help text (and optional choices) stored for the CLI."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


MONITOR_MODES = {"eval/accuracy": "max", "eval/loss": "min"}  # what evaluation produces, and which way is better
# Technique flags some recipes have and others don't: naming one where it does not exist gets a clear
# message instead of argparse's bare "unrecognized arguments".
TECHNIQUE_FLAGS = {
    "--translate": "mnist_convnet, cifar_cnn", "--flip": "cifar_cnn", "--tta": "cifar_cnn",
    "--lookahead-every": "cifar_cnn", "--channels-last": "cifar_cnn", "--whiten-init": "cifar_cnn",
    "--bias-lr-scale": "cifar_cnn", "--whiten-bias-epochs": "cifar_cnn",
    "--sync-bn": "mnist_convnet, cifar_cnn", "--momentum": "cifar_cnn", "--widths": "cifar_cnn",
    "--width": "mnist_convnet", "--depth": "mnist_convnet", "--hidden": "fashion_mnist_mlp",
}

DATASET_HELP = ("Hub dataset id, or a local directory datasets.load_dataset reads (a clone of the Hub repo "
                "with parquet files, or an image folder with one sub-folder per class)")


@dataclass
class CommonConfig:
    """The knobs every recipe shares. A recipe subclasses this and changes defaults or adds fields."""

    # --- data ---
    dataset: str = knob("", DATASET_HELP)
    image_column: str = knob("", "image column name ('' = detect: image, img)")
    label_column: str = knob("", "label column name ('' = detect: label, labels)")
    val_fraction: float = knob(0.1, "fraction of train held out for validation when the dataset has no validation split")
    image_size: int = knob(0, "resize images to this square size (0 = keep; all images must then share one size)")
    channels: int = knob(0, "convert images to 1 (grayscale) or 3 (RGB) channels (0 = keep the data's)")
    cache_dir: str = knob("", "where decoded uint8 tensors are cached ('' = ~/.cache/accelerate-recipes)")
    data_on_device: bool = knob(False, "keep the whole decoded dataset on the accelerator (GPU) instead of host memory")
    # --- train ---
    epochs: int = knob(2, "number of passes over the training split")
    batch_size: int = knob(128, "GLOBAL batch size per optimizer step, split evenly over processes and accumulation steps")
    eval_batch_size: int = knob(1000, "global batch size for evaluation")
    lr: float = knob(1e-3, "peak learning rate")
    weight_decay: float = knob(0.0, "weight decay")
    warmup_fraction: float = knob(0.0, "fraction of optimizer steps spent warming the LR up linearly from 0")
    warmup_start: float = knob(0.0, "LR multiplier the warm-up starts from (it rises linearly to 1)")
    schedule: str = knob("cosine", "LR schedule after warm-up", choices=["cosine", "linear", "constant"])
    final_lr: float = knob(0.0, "LR multiplier the schedule ends at (cosine and linear)")
    grad_accum: int = knob(1, "gradient accumulation steps per optimizer step")
    max_grad_norm: float = knob(0.0, "clip the gradient norm to this value (0 = no clipping)")
    seed: int = knob(42, "seed for weights, data order, held-out split and augmentation")
    max_steps: int = knob(0, "stop after this many optimizer steps in total (0 = run all epochs); the LR schedule "
                         "is still planned for all epochs, so a stopped run can be resumed exactly")
    # --- eval ---
    eval_every: int = knob(1, "evaluate on the validation split every N epochs")
    eval_every_steps: int = knob(0, "also evaluate on the validation split every N optimizer steps (0 = off)")
    target_accuracy: float = knob(0.0, "exit non-zero if the final accuracy is below this (0 = no check), e.g. 0.99")
    eval_only: bool = knob(False, "only evaluate the weights in --checkpoint on the test split")
    checkpoint: str = knob("", "run, best/, final/ or checkpoint directory whose weights --eval-only evaluates")
    # --- checkpoint ---
    output_dir: str = knob("", "run directory ('' = runs/<recipe>-<timestamp>)")
    resume_from: str = knob("", "'latest' (newest complete checkpoint in --output-dir) or a checkpoint path")
    checkpoint_every: int = knob(0, "also checkpoint every N optimizer steps (0 = epoch ends only)")
    keep_checkpoints: int = knob(3, "complete checkpoints to keep (the newest one is never deleted)")
    monitor: str = knob("eval/accuracy", "metric that decides the best model kept in best/",
                        choices=list(MONITOR_MODES))
    mode: str = knob("auto", "whether a larger or smaller --monitor value is better (auto: accuracy max, loss min)",
                     choices=["auto", "max", "min"])
    # --- logging ---
    log_every: int = knob(10, "log train loss, LR and throughput every N optimizer steps")
    progress_every_s: float = knob(30.0, "when output is not a terminal (nohup, SLURM), print a progress line this "
                                   "often, in seconds (0 = at every --log-every step)")
    profile: int = knob(0, "record N optimizer steps with the PyTorch profiler into <run dir>/profile (0 = off)")
    timeout_s: int = knob(600, "seconds a collective may wait before the job fails instead of hanging")


_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in _BOOL_TRUE:
        return True
    if low in _BOOL_FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the recipe docstring's line breaks and show every default."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear paragraph, exit code 2, no traceback
        self.print_usage(sys.stderr)
        if message.startswith("unrecognized arguments"):
            others = [f"{flag} (a knob of {TECHNIQUE_FLAGS[flag]})" for flag in message.split(":", 1)[1].split()
                      if flag.split("=")[0] in TECHNIQUE_FLAGS]
            if others:
                message += (f"; {', '.join(others)}: this recipe does not use that technique. Copy its lines from "
                            "the recipe that has it, or use that recipe")
        self.exit(EXIT_BAD_INPUT, f"error: {message}. Run with --help to see every option and its default.\n")


def build_parser(cls, description: str = "") -> argparse.ArgumentParser:
    parser = _Parser(description=description, formatter_class=_HelpFormatter,
                     allow_abbrev=False)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"default": f.default, "help": f.metadata.get("help", ""), "dest": f.name}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if typ is bool:
            # --flag turns it on, --flag false / --no-flag turn it off.
            kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
            parser.add_argument(flag, **kwargs)
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                help=argparse.SUPPRESS)
        else:
            kwargs.update(type=typ, metavar=typ.__name__.upper())
            parser.add_argument(flag, **kwargs)
    return parser


def parse_config(cls, argv=None, description: str = ""):
    """Parse the command line into a validated ``cls`` instance; bad values exit with one paragraph."""
    parser = build_parser(cls, description)
    args = parser.parse_args(argv)
    # Which flags were given (not defaulted): --eval-only takes every other setting from the run it scores.
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv)))
    try:
        cfg = cls(**vars(args))
        validate(cfg)
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(EXIT_BAD_INPUT)
    cfg.explicit = given  # not a dataclass field: not saved, not logged
    return cfg


def validate(cfg) -> None:
    """Reject values that would crash later or train silently wrong."""
    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    need(cfg.epochs >= 1, f"--epochs must be at least 1 (got {cfg.epochs}); pass e.g. --epochs 2.")
    need(cfg.lr > 0, f"--lr must be positive (got {cfg.lr}); pass e.g. --lr 1e-3.")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay}).")
    need(cfg.batch_size >= 1, f"--batch-size must be at least 1 (got {cfg.batch_size}).")
    need(cfg.eval_batch_size >= 1, f"--eval-batch-size must be at least 1 (got {cfg.eval_batch_size}).")
    need(cfg.grad_accum >= 1, f"--grad-accum must be at least 1 (got {cfg.grad_accum}).")
    need(0 <= cfg.val_fraction < 1, f"--val-fraction must be in [0, 1) (got {cfg.val_fraction}).")
    need(0 <= cfg.warmup_fraction < 1, f"--warmup-fraction must be in [0, 1) (got {cfg.warmup_fraction}).")
    need(0 <= cfg.warmup_start <= 1 and 0 <= cfg.final_lr <= 1, f"--warmup-start and --final-lr are fractions of "
         f"--lr in [0, 1] (got {cfg.warmup_start} and {cfg.final_lr}).")
    need(0 <= getattr(cfg, "label_smoothing", 0) < 1,
         f"--label-smoothing must be in [0, 1) (got {getattr(cfg, 'label_smoothing', 0)}).")
    need(getattr(cfg, "lookahead_every", 0) >= 0,
         f"--lookahead-every must be >= 0 (got {getattr(cfg, 'lookahead_every', 0)}); 0 turns the average off.")
    need(cfg.eval_every_steps >= 0, f"--eval-every-steps must be >= 0 (got {cfg.eval_every_steps}); 0 turns it off.")
    need(cfg.progress_every_s >= 0, f"--progress-every-s must be >= 0 (got {cfg.progress_every_s}).")
    need(cfg.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {cfg.max_grad_norm}); 0 turns clipping off.")
    need(cfg.channels in (0, 1, 3), f"--channels must be 0 (keep), 1 or 3 (got {cfg.channels}).")
    need(cfg.image_size >= 0, f"--image-size must be >= 0 (got {cfg.image_size}); 0 keeps the data's size.")
    need(cfg.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1 (got {cfg.keep_checkpoints}).")
    need(cfg.log_every >= 1, f"--log-every must be at least 1 (got {cfg.log_every}).")
    need(cfg.eval_every >= 1, f"--eval-every must be at least 1 (got {cfg.eval_every}).")
    need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (got {cfg.checkpoint_every}).")
    need(cfg.max_steps >= 0, f"--max-steps must be >= 0 (got {cfg.max_steps}).")
    need(0 <= cfg.target_accuracy <= 1, f"--target-accuracy is a fraction in [0, 1] (got {cfg.target_accuracy}); "
         "pass e.g. 0.99 for 99%.")
    need(cfg.profile >= 0, f"--profile takes a number of optimizer steps to record, >= 0 (got {cfg.profile}).")
    need(cfg.timeout_s >= 10, f"--timeout-s must be at least 10 seconds (got {cfg.timeout_s}).")
    need(not (cfg.eval_only and not cfg.checkpoint), "--eval-only needs --checkpoint <run or checkpoint directory> "
         "naming the weights to evaluate.")
    if cfg.mode == "auto":  # loss: lower is better; accuracy: higher
        cfg.mode = MONITOR_MODES[cfg.monitor]
    need(not (cfg.resume_from and cfg.eval_only), "--resume-from and --eval-only can't be combined; "
         "use --checkpoint to pick the weights to evaluate.")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")


def sanitize_for_hparams(cfg_dict: dict) -> dict:
    """TensorBoard hparams take only int/float/str/bool: drop None, stringify the rest."""
    out = {}
    for key, value in cfg_dict.items():
        if value is None:
            continue
        out[key] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out
