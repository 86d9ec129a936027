"""Dataclass configs turned into a command line, validated, and saved with the run.

Every recipe declares one ``@dataclass`` whose fields carry a ``help`` in their metadata (``knob``); a field a
recipe only gives a new default (``epochs: int = 12``) keeps the help of ``CommonConfig``'s.
``parse_config`` builds an ``argparse`` parser from it, so ``--help`` lists every knob with its
default, and ``--some-field value`` overrides it. Launcher concerns (process count, precision,
machines) are deliberately absent: they come from ``accelerate launch`` / ``accelerate config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from common.config_checks import MONITOR_MODES, check
from common.errors import ConfigError, report
from common.files import write_atomic
from common.flag_hints import hint


def knob(default, help: str, choices=None):
    """A config field with its help text (and optional choices) for the command line. What a resume and
    --eval-only do with it is in the tables below (``RESUME``, ``EVAL_OWN``), by name."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


# --- what a resume and --eval-only do with each setting: the one place that says it ----------------------
# A resume continues the run with the run's own settings (read from its checkpoint before anything is built from
# them: the Accelerator, the data, the model), except this launch's own (RESUME_LAUNCH_OWN) and the flags this command
# gives. A given value other than the run's: refused (RESUME_MUST_MATCH), put over the restored optimizer state
# (RESUME_APPLIED), accepted without a word (RESUME_FREE), or, for a field named in no set (a recipe's model or
# augmentation settings, for instance), accepted with a note that the result will differ from the original run.
RESUME_LAUNCH_OWN = {  # where and how this launch runs, never taken from the checkpoint
    "output_dir",
    "resume_from",
    "max_steps",  # where this launch stops (a stopped run resumes past it)
    "eval_only",
    "checkpoint",
    "cache_dir",
    "data_on_device",
    "workers",
    "eval_batch_size",
    "report_to",
    "progress_every_s",
    "profile",
    "timeout_s",
}
RESUME_MUST_MATCH = {  # another value is refused, for this reason
    "dataset": "the checkpoint was trained on that data",
    "val_fraction": "it chose the images held out for validation",
    "seed": "it chose the images held out for validation and the order of the data",
    "grad_accum": "the saved data position counts its micro-batches",
    "weights": "the run was started from them: they decide its normalisation and crop",
    "image_size": "it sets the pixels the model was trained on",
    "start_image_size": "it sets the crops of every epoch (progressive resizing)",
    "layer_decay": "it sets the optimizer's parameter groups, whose state the checkpoint holds",
}
RESUME_APPLIED = {"lr", "weight_decay", "momentum", "betas"}  # put over the restored optimizer state, and printed
RESUME_FREE = {  # how the run is watched, stored or fed, not what it computes: accepted without a word
    "epochs",  # the resume notes the new LR curve itself
    "max_damaged",  # when damaged photos stop the run (they are skipped alike)
    "cache_dir",
    "data_on_device",
    "workers",
    "eval_batch_size",
    "max_steps",
    "eval_every",
    "eval_every_steps",
    "target_accuracy",
    "patience",  # when the run gives up, not what it computes; the count so far is the checkpoint's
    "output_dir",
    "resume_from",
    "checkpoint_every",
    "checkpoint_every_s",
    "keep_checkpoints",
    "log_every",
    "progress_every_s",
    "report_to",
    "profile",
    "timeout_s",
    "cudnn_benchmark",  # which kernels compute the same convolutions
    "monitor",  # a changed --monitor or --mode starts the best over, and says so (Checkpointer._best_starts_over)
    "mode",
}
# --eval-only takes every setting from the run's config.json except these, which are this command line's own;
# of those it takes, a given value that differs is refused when it decides the held-out split.
EVAL_OWN = {
    "cache_dir",
    "max_damaged",
    "data_on_device",
    "workers",
    "eval_batch_size",
    "target_accuracy",
    "eval_only",
    "checkpoint",
    "output_dir",
    "resume_from",
    "report_to",
    "profile",
    "timeout_s",
}
DECIDES_SPLIT = {"val_fraction", "seed"}


DATASET_HELP = (
    "Hub dataset id, a local clone of a Hub repo (parquet files), or an image folder read by "
    "torchvision's ImageFolder rules: the class is the first folder under the split root and every "
    "image below it belongs to it (any depth, any folder name); train/, val/|valid/|validation/ and "
    "test/ are splits only at the top level beside train/, else the whole folder is train; hidden "
    "files and non-images are skipped and counted"
)


@dataclass
class CommonConfig:
    """The knobs every recipe shares. A recipe subclasses this and changes defaults or adds fields."""

    # --- data ---
    dataset: str = knob("", DATASET_HELP)
    image_column: str = knob("", "image column name ('' = detect: image, img)")
    label_column: str = knob("", "label column name ('' = detect: label, labels)")
    val_fraction: float = knob(
        0.1, "fraction of train held out for validation when the dataset has no validation split"
    )
    image_size: int = knob(0, "resize images to this square size (0 = keep; all images must then share one size)")
    channels: int = knob(
        0, "convert images to 1 (grayscale) or 3 (RGB) channels (0 = RGB if any image is in colour, else grayscale)"
    )
    cache_dir: str = knob("", "where decoded uint8 tensors are cached ('' = ~/.cache/accelerate-recipes)")
    data_on_device: bool = knob(
        False,
        "keep the whole decoded dataset on the accelerator (GPU) instead of host memory "
        "(unless given: on a GPU when it takes under a quarter of the free memory)",
    )
    # --- train ---
    epochs: int = knob(2, "number of passes over the training split")  # resume notes the new LR curve
    batch_size: int = knob(
        128, "GLOBAL batch size per optimizer step, split evenly over processes and accumulation steps"
    )
    eval_batch_size: int = knob(1000, "global batch size for evaluation")
    lr: float = knob(1e-3, "peak learning rate")
    lr_rule = None  # how the default --lr follows --batch-size: a recipe's LRRule; None keeps it at every batch
    # settings of this class a recipe does not read, and why ({"channels": "..."}): left out of its --help, and
    # refused on its command line (a plain class attribute, not a field)
    not_read: typing.ClassVar[dict[str, str]] = {}
    weight_decay: float = knob(0.0, "weight decay")
    warmup_fraction: float = knob(0.0, "fraction of optimizer steps spent warming the LR up linearly from 0")
    warmup_start: float = knob(0.0, "LR multiplier the warm-up starts from (it rises linearly to 1)")
    schedule: str = knob("cosine", "LR schedule after warm-up", choices=["cosine", "linear", "constant"])
    final_lr: float = knob(0.0, "LR multiplier the schedule ends at (cosine and linear)")
    grad_accum: int = knob(1, "gradient accumulation steps per optimizer step")
    max_grad_norm: float = knob(0.0, "clip the gradient norm to this value (0 = no clipping)")
    cudnn_benchmark: bool = knob(
        True,
        "on a GPU, cuDNN times its convolution kernels for each new shape and keeps the fastest (the first steps "
        "pay the search; the recipes' shapes are fixed); false: cuDNN's default kernels, no search",
    )
    label_smoothing: float = knob(0.0, "label smoothing for the cross-entropy loss")
    seed: int = knob(42, "seed for weights, data order, held-out split and augmentation")
    max_steps: int = knob(
        0,
        "stop after this many optimizer steps in total (0 = run all epochs); the LR schedule "
        "is still planned for all epochs, so a stopped run can be resumed exactly",
    )
    # --- eval ---
    eval_every: int = knob(1, "evaluate on the validation split every N epochs")
    eval_every_steps: int = knob(0, "also evaluate on the validation split every N optimizer steps (0 = off)")
    target_accuracy: float = knob(0.0, "exit non-zero if the final accuracy is below this (0 = no check), e.g. 0.99")
    patience: int = knob(
        0,
        "end the run after N evaluations in a row without a --monitor improvement (0 = off): the loop's break "
        "lines ask run.no_improvement(); the count is kept in checkpoints",
    )
    eval_only: bool = knob(False, "only evaluate the weights in --checkpoint on the test split")
    checkpoint: str = knob("", "run, best/, final/ or checkpoint directory whose weights --eval-only evaluates")
    # --- checkpoint ---
    output_dir: str = knob("", "run directory ('' = runs/<recipe>-<timestamp>)")
    resume_from: str = knob("", "'latest' (newest complete checkpoint in --output-dir) or a checkpoint path")
    checkpoint_every_s: float = knob(
        300.0,
        "checkpoint once this many seconds have passed since the last checkpoint (0 = off); a run also checkpoints "
        "at a stop request and at its end",
    )
    checkpoint_every: int = knob(0, "also checkpoint every N optimizer steps (0 = off)")
    keep_checkpoints: int = knob(3, "complete checkpoints to keep (the newest one is never deleted)")
    monitor: str = knob(
        "eval/accuracy", "metric that decides the best model kept in best/", choices=list(MONITOR_MODES)
    )
    mode: str = knob(
        "auto",
        "whether a larger or smaller --monitor value is better (auto: accuracy max, loss min)",
        choices=["auto", "max", "min"],
    )
    # --- logging ---
    log_every: int = knob(10, "log train loss, LR and throughput every N optimizer steps")
    progress_every_s: float = knob(
        30.0,
        "when output is not a terminal (nohup, SLURM), print a progress line this "
        "often, in seconds (0 = at every --log-every step)",
    )
    report_to: str = knob(
        "tensorboard",
        "where the metrics go besides <run dir>/metrics.jsonl: Accelerate trackers, "
        "comma-separated (tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, "
        "trackio), 'all' (every one installed) or 'none'",
    )
    profile: int = knob(0, "record N optimizer steps with the PyTorch profiler into <run dir>/profile (0 = off)")
    timeout_s: int = knob(600, "seconds a collective may wait before the job fails instead of hanging")

    def settle(self) -> None:
        """Settings that follow from others, decided once when the command line is parsed (a recipe overrides this;
        ``self.explicit`` names the flags given). After it, and a resume's adoption of the run's own settings,
        nothing writes the config."""


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
        if not message.startswith("unrecognized arguments"):  # (an unknown flag: the paragraph names the fix)
            self.print_usage(sys.stderr)
        if message.startswith("unrecognized arguments"):  # another recipe's knob, another script's flag
            shared = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(CommonConfig)}
            message += hint(message, set(self._option_string_actions), shared)
        self.exit(report(ConfigError(f"{message}. Run with --help to see every option and its default.")))


class _NotRead(argparse.Action):
    """A setting the recipe does not read (``CommonConfig.not_read``): given, it is refused, never ignored."""

    def __init__(self, *args, why: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{parser.prog} does not read {option_string}: {self.why}. Drop it")


def described(cls, name: str) -> dict:
    """A field's help and choices: its own knob's, or, when a recipe only gives it a new default (``epochs: int =
    12``), those of the nearest base class that describes it."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and "help" in f.metadata:
            return f.metadata
    return {}


# --help's sections: a recipe's own settings first, then CommonConfig's, each section from its first field on
SECTIONS = {
    "dataset": "data",
    "epochs": "training",
    "eval_every": "evaluation",
    "output_dir": "checkpoints and resuming",
    "log_every": "logging",
}


def build_parser(cls, description: str = "") -> argparse.ArgumentParser:
    parser = _Parser(description=description, formatter_class=_HelpFormatter, allow_abbrev=False)
    hints = typing.get_type_hints(cls)
    common = [f.name for f in dataclasses.fields(CommonConfig)]
    own = parser.add_argument_group("settings of this recipe (its Config)")
    groups, section = {}, None
    for name in common:
        section = SECTIONS.get(name, section)
        groups[name] = section
    sections = {title: parser.add_argument_group(f"{title} (every recipe)") for title in dict.fromkeys(groups.values())}
    for f in dataclasses.fields(cls):
        typ, meta = hints[f.name], described(cls, f.name)
        flag = "--" + f.name.replace("_", "-")
        group = sections[groups[f.name]] if f.name in groups else own
        if f.name in cls.not_read:
            names = {flag, "--" + f.name, "--no-" + f.name.replace("_", "-"), "--no_" + f.name}
            parser.add_argument(
                *sorted(names),
                dest=f.name,
                default=f.default,
                nargs="?",
                help=argparse.SUPPRESS,
                action=functools.partial(_NotRead, why=cls.not_read[f.name]),
            )
            continue
        kwargs = {"default": f.default, "help": meta.get("help", ""), "dest": f.name}
        if f.name == "lr" and getattr(cls, "lr_rule", None):  # every recipe with a rule states it, in the same words
            kwargs["help"] += cls.lr_rule.help()
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        # the snake_case spelling (--output_dir) that accelerate launch, torchrun and HfArgumentParser accept
        # works too; --help lists the kebab-case form only
        alias = "--" + f.name if "_" in f.name else None
        if typ is bool:
            # --flag turns it on, --flag false / --no-flag turn it off.
            kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
            group.add_argument(flag, **kwargs)
            negatives = ["--no-" + f.name.replace("_", "-")] + (["--no_" + f.name] if alias else [])
            group.add_argument(*negatives, dest=f.name, action="store_false", help=argparse.SUPPRESS)
        else:
            kwargs.update(type=typ, metavar=typ.__name__.upper())
            group.add_argument(flag, **kwargs)
        if alias:
            group.add_argument(alias, **{**kwargs, "help": argparse.SUPPRESS})
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file of settings (e.g. a run's config.json); flags on the command line override it",
    )
    return parser


TYPE_WORDS = {int: "a whole number", float: "a number", str: "a text value", bool: "true or false"}


def _from_file(cls, path: str) -> dict:
    """--config FILE: its fields converted to their types; unknown keys or wrong types are a ConfigError."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).expanduser().read_text())  # JSON is YAML too
    except OSError as err:
        raise ConfigError(
            f"--config {path}: cannot read it ({err.strerror or err}). Pass an existing YAML or JSON file."
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path} is not valid YAML or JSON ({str(err).splitlines()[0]}).") from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"--config {path} must hold a mapping of setting names to values (like a run's "
            "config.json), not {type(loaded).__name__}."
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    names = {k: k.replace("-", "_") for k in loaded}
    unknown = sorted(k for k, name in names.items() if name not in fields)
    if unknown:
        raise ConfigError(
            f"--config {path} has settings this recipe does not know: {', '.join(unknown)}. Remove "
            "them (python <recipe> --help lists every setting)."
        )
    return {names[key]: received(cls, names[key], value, f"--config {path}", key) for key, value in loaded.items()}


def received(cls, name: str, value, where: str, key: str | None = None):
    """A setting's value read from a file (--config, a run's config.json, a checkpoint): converted to the field's
    type as the command line would convert it, checked against its choices; anything else is a ConfigError naming
    ``where``. A file someone sends you is data: nothing it holds is trusted to have the right type."""
    key = key or name
    typ, default = typing.get_type_hints(cls)[name], {f.name: f.default for f in dataclasses.fields(cls)}[name]
    wanted = TYPE_WORDS.get(typ, f"a {getattr(typ, '__name__', typ)}")
    fix = (
        f"Give it {wanted} (e.g. `{key}: {json.dumps(default)}`, the recipe's default) or delete the line to "
        "keep the default."
    )
    if value is None:  # `lr:` with nothing after it, or `lr: null`
        raise ConfigError(f"{where}: {key} has no value (`{key}:` with nothing after it, or null). {fix}")
    try:
        if isinstance(value, (list, dict)) or (isinstance(value, bool) and typ in (int, float)):
            raise TypeError(value)
        if typ is bool:
            value = value if isinstance(value, bool) else _parse_bool(str(value))
        elif not isinstance(value, typ):
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            value = typ(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{where}: {key} = {value!r} is not {wanted}. {fix}") from None
    choices = described(cls, name).get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{where}: {key} = {value!r} is not one of {', '.join(map(str, choices))}. Set it to one "
            "of them in the file (one written by an older version may hold a value this setting no "
            "longer takes)."
        )
    return value


def parse_config(cls, argv=None, description: str = ""):
    """Parse the command line into a validated ``cls`` instance; bad values exit with one paragraph."""
    parser = build_parser(cls, description)
    args = parser.parse_args(argv)
    config_file = args.config
    # Which flags were given (not defaulted): --eval-only takes every other setting from the run it scores.
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv))) - {"config"}
    values = {k: v for k, v in vars(args).items() if k != "config"}
    lr_source = "as given" if "lr" in given else ""
    try:
        if config_file:  # the file's settings, then the command line's on top
            from_file = _from_file(cls, config_file)
            values.update({k: v for k, v in from_file.items() if k not in given})
            given |= set(from_file)
            # A run's config.json holds the lr it trained with, already scaled for its batch: taken as given,
            # so repeating a run from it never scales twice.
            if "lr" in from_file and not lr_source:
                lr_source = f"as given in {config_file}"
        cfg = cls(**values)
        check(cfg)  # first: the rule needs a valid --batch-size
    except ConfigError as err:
        raise SystemExit(report(err)) from None  # it may quote a key of the --config file: escaped
    cfg.explicit = given  # not a dataclass field: not saved, not logged
    # The same command gives the same lr, so --resume-from latest resumes with the lr the run started with.
    # NOTE: a run started before recipes had a rule, at another batch and without --lr, resumes with the rule's
    # lr (applied over the checkpoint's, and printed so); give its old --lr to keep it.
    rule = getattr(cfg, "lr_rule", None)  # common.schedules.LRRule, or None: the LR stays at every batch
    # not a field either: the startup line shows it
    cfg.lr_note = lr_source or (rule.follow(cfg) if rule is not None else "the recipe's default")
    try:
        cfg.settle()
    except ConfigError as err:
        raise SystemExit(report(err)) from None
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: Path) -> None:
    write_atomic(path, json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")
