"""Flags a recipe does not have, answered with what it has instead: another recipe's knob is named as that
recipe's, and the flags of the scripts users come from (Hugging Face's examples and Trainer, torchvision's
classification reference script, Accelerate's cv_example) with this repository's name for them, instead of
argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LAUNCHER = "a launcher setting here: "
# Hugging Face's example scripts and HfArgumentParser (TrainingArguments)
HF_FLAGS = {
    "learning_rate": "--lr",
    "num_train_epochs": "--epochs",
    "per_device_train_batch_size": "--batch-size (the GLOBAL batch per optimizer step, split over processes)",
    "per_device_eval_batch_size": "--eval-batch-size (global, split over processes)",
    "train_batch_size": "--batch-size",
    "resume_from_checkpoint": "--resume-from (a checkpoint folder, or latest)",
    "with_tracking": "--report-to (tensorboard by default)",
    "checkpointing_steps": "--checkpoint-every",
    "gradient_accumulation_steps": "--grad-accum",
    "lr_scheduler_type": "--schedule",
    "num_warmup_steps": "--warmup-fraction (a fraction of the run's optimizer steps)",
    "warmup_ratio": "--warmup-fraction",
    "max_train_steps": "--max-steps",
    "logging_steps": "--log-every",
    "dataset_name": "--dataset",
    "mixed_precision": LAUNCHER + "put it before the script, "
    "`accelerate launch --mixed_precision bf16 recipes/<recipe>.py`, or set it in the launcher config",
    "fp16": LAUNCHER + "`accelerate launch --mixed_precision fp16 recipes/<recipe>.py`",
    "bf16": LAUNCHER + "`accelerate launch --mixed_precision bf16 recipes/<recipe>.py`",
}
# torchvision's references/classification/train.py
TORCHVISION_FLAGS = {
    "data_path": "--dataset",
    "j": "--workers",
    "workers": "--workers",
    "b": "--batch-size (the GLOBAL batch per optimizer step, split over processes; torchvision's -b is per GPU: "
    "multiply it by the GPU count)",
    "wd": "--weight-decay",
    "resume": "--resume-from (a checkpoint folder, or latest)",
    "start_epoch": "--resume-from (a checkpoint records its epoch and step)",
    "test_only": "--eval-only --checkpoint <run dir> (scores saved weights on the held-out split)",
    "lr_scheduler": "--schedule (cosine, linear or constant)",
    "lr_warmup_epochs": "--warmup-fraction (a fraction of the run's optimizer steps: warm-up epochs / --epochs)",
    "lr_warmup_decay": "--warmup-start (the LR multiplier the warm-up starts from)",
    "lr_min": "--final-lr (the multiplier of --lr the schedule ends at, not an LR)",
    "clip_grad_norm": "--max-grad-norm",
    "print_freq": "--log-every (in optimizer steps)",
    "mixup_alpha": "--mixup",
    "cutmix_alpha": "--cutmix",
    "model_ema": "--ema-decay (the decay per optimizer step; 0 = off)",
    "model_ema_decay": "--ema-decay",
    "train_crop_size": "--image-size (one crop side for training and evaluation)",
    "val_crop_size": "--image-size (one crop side for training and evaluation)",
    "amp": LAUNCHER + "`accelerate launch --mixed_precision bf16 recipes/<recipe>.py` (or fp16)",
    "world_size": LAUNCHER + "`accelerate launch --num_processes N recipes/<recipe>.py`",
    "dist_url": LAUNCHER + "`accelerate launch --main_process_ip HOST --main_process_port PORT ...`",
    "device": LAUNCHER + "a GPU is used when there is one; `accelerate launch --cpu recipes/<recipe>.py` for the CPU",
}
# Accelerate's examples/cv_example.py and complete_cv_example.py
CV_EXAMPLE_FLAGS = {
    "data_dir": "--dataset",
    "cpu": LAUNCHER + "`accelerate launch --cpu recipes/<recipe>.py`",
    "project_dir": "--output-dir (the run directory: checkpoints, metrics and the trackers' logs)",
    "num_epochs": "--epochs",
}
OTHER_SCRIPTS = {**CV_EXAMPLE_FLAGS, **TORCHVISION_FLAGS, **HF_FLAGS}


def recipe_flags(shared: set[str]) -> dict[str, list[str]]:
    """Flags of this repository's recipes that not every recipe has (not in ``shared``, the flags every recipe
    has), and which recipes have them, read from the recipes' source (parsed, never run)."""
    found: dict[str, list[str]] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                for item in node.body:
                    if (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and "ClassVar" not in ast.unparse(item.annotation)  # a ClassVar: not a field, not a flag
                    ):
                        found.setdefault("--" + item.target.id.replace("_", "-"), []).append(path.stem)
    return {flag: names for flag, names in found.items() if flag not in shared}


def unknown_flags(message: str) -> list[str]:
    """The flags in argparse's "unrecognized arguments: ..." (``--name=value`` and ``-j4`` cut to the flag)."""
    words = message.split(":", 1)[1].split()
    return [w.split("=")[0] if w.startswith("--") else w[:2] for w in words if re.match(r"--?[A-Za-z]", w)]


def hint(message: str, known: set[str], shared: set[str]) -> str:
    """What to add to argparse's "unrecognized arguments" ``message`` for a parser whose flags are ``known``;
    ``shared``: the flags every recipe has."""
    technique = recipe_flags(shared)
    others, mapped = [], []
    for flag in unknown_flags(message):
        if flag.replace("_", "-") in technique:
            others.append(f"{flag} (a knob of {', '.join(technique[flag.replace('_', '-')])})")
            continue
        target = OTHER_SCRIPTS.get(flag.lstrip("-").replace("-", "_"))
        if target is None:
            continue
        name = target.split()[0]
        if name.startswith("--") and name not in known:  # another recipe's knob
            target = f"none in this recipe ({name} is {' and '.join(technique.get(name, ['another recipe']))}'s)"
        mapped.append(f"{flag} -> {target}")
    extra = ""
    if others:
        extra += (
            f"; {', '.join(others)}: this recipe does not use that technique. Copy its lines from the recipe "
            "that has it, or use that recipe"
        )
    if mapped:
        extra += f"; flags of other scripts, and this recipe's name for them: {'; '.join(mapped)}"
    return extra
