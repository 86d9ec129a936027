"""--eval-only: score saved weights on the split their run held out, with the run's own settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.config import DECIDES_SPLIT, EVAL_OWN, received
from common.config_checks import check_received
from common.console import say
from common.data.splits import DATA_FILES, data_record, recorded_files_changed
from common.errors import RecipeError, printable
from common.train import checkpoint as ckpt


class EvalOnly:
    """An --eval-only run: the run's own settings adopted (``note``: what differs, '' if nothing), then the
    weights loaded (``weights``: their file) and scored."""

    def __init__(self, cfg):
        self.cfg, self.note, self.weights = cfg, adopt_run_config(cfg), None

    def load(self, accelerator, model, data) -> None:
        self.weights = load_weights(self.cfg, accelerator, model)
        check_data(self.weights, data, other_data=bool(self.note))

    def normalisation(self) -> tuple[list[float], list[float]] | None:
        """The mean and std the scored run normalised its inputs with (its model.json: the folder given, its best/
        or final/, or the run of a checkpoint folder), or None when no model.json records them."""
        root = Path(self.cfg.checkpoint).expanduser()
        for folder in (root, root / "best", root / "final", root.parent.parent / "best", root.parent.parent / "final"):
            try:
                card = json.loads((folder / ckpt.MODEL_CARD).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(card, dict) and isinstance(card.get("mean"), list) and isinstance(card.get("std"), list):
                return [float(v) for v in card["mean"]], [float(v) for v in card["std"]]
        return None

    def report(self, accelerator, data, metrics: dict | None) -> bool:
        """Printed and written beside the weights; True when --target-accuracy was missed."""
        return report(self.cfg, accelerator, self.weights, self.note, data, metrics)


def precision_note(cfg, accelerator) -> str:
    """What differs when the launcher's mixed precision is not the one the scored run trained under (its
    summary.json's), and how to score as it trained; '' when they agree or the run records none."""
    root = Path(cfg.checkpoint).expanduser()
    for folder in (root, root.parent, root.parent.parent):
        try:
            trained = json.loads((folder / "summary.json").read_text()).get("precision")
            break
        except (OSError, ValueError, AttributeError):
            continue
    else:
        return ""
    now = accelerator.mixed_precision
    if not isinstance(trained, str) or trained == now:
        return ""
    return (
        f"trained under {trained} precision, scored now under {now}: accuracy and loss may differ a little; "
        f"launch with `accelerate launch --mixed_precision {trained} ...` to score as trained"
    )


def adopt_run_config(cfg) -> str:
    """Take the dataset, split and model settings from the run's config.json, so the weights are scored on
    the images the run held out; refuse overrides that would change the split. Returns a note ('' if none)."""
    root = Path(cfg.checkpoint).expanduser()
    found = next(  # the run's; not a model folder's (best/, final/: its config.json is its model library's)
        (
            d / "config.json"
            for d in (root, root.parent, root.parent.parent)
            if (d / "config.json").is_file() and not (d / ckpt.MODEL_CARD).is_file()
        ),
        None,
    )
    note = ""
    if found is None:
        say(f"NOTE: no config.json found beside {root}: evaluating with this command line's settings.")
        return note
    recorded = json.loads(found.read_text())
    explicit = getattr(cfg, "explicit", set())
    for key, value in recorded.items():
        if key in EVAL_OWN or not hasattr(cfg, key):  # this command line's own (common.config.EVAL_OWN)
            continue
        mine = getattr(cfg, key)
        if key in explicit and mine != value:
            if key in DECIDES_SPLIT:
                raise RecipeError(
                    f"--{key.replace('_', '-')} {mine} differs from the run's {value} ({found}), which chose the "
                    "images held out of train for validation: evaluating with it would score images the model trained "
                    f"on. Drop --{key.replace('_', '-')}; --eval-only uses the run's settings."
                )
            if key == "dataset":
                note = f"dataset {mine!r} (the run trained on {value!r})"
            continue
        setattr(cfg, key, received(type(cfg), key, value, str(found)))
    check_received(cfg, str(found))
    return note


def load_weights(cfg, accelerator, model) -> Path:
    """Load the weights in --checkpoint (a run, best/, final/ or a checkpoint folder); returns their file."""
    root = Path(cfg.checkpoint).expanduser()
    candidates = [root, root / "best", root / "final", ckpt.find_latest(root)]
    found = next((c / ckpt.WEIGHTS for c in candidates if c is not None and (c / ckpt.WEIGHTS).is_file()), None)
    if found is None:
        raise RecipeError(
            f"--checkpoint {cfg.checkpoint} holds no {ckpt.WEIGHTS} (looked in it, its best/ and "
            "final/ folders and its newest checkpoint). Pass a run directory or one of those folders."
        )
    try:
        accelerator.unwrap_model(model, keep_torch_compile=False).load_state_dict(ckpt.read_weights(found))
    except RuntimeError as err:
        raise RecipeError(
            f"The weights in {found} don't fit this recipe's model with these settings "
            f"({str(err).splitlines()[0]}). Use the recipe the run was trained with (model.json "
            "beside the weights names it)."
        ) from None
    return found


def check_data(weights: Path, data, other_data: bool) -> None:
    """Refuse to score weights on data that changed since their run: a folder that gained, lost or moved an
    image redraws the held-out split, which would then hold images the model trained on. The record is the
    model card's (best/, final/) or the checkpoint's. Skipped, with a note, when --dataset names other data
    than the run's (``other_data``: the command line's explicit word) or the weights carry no record."""
    card, state = weights.parent / ckpt.MODEL_CARD, weights.parent / ckpt.STATE_FILE
    try:
        if card.is_file():
            recorded = json.loads(card.read_text()).get("data") or {}
        else:
            saved = json.loads(state.read_text()) if state.is_file() else {}
            recorded = {"fingerprint": saved.get("data_fingerprint"), "files": saved.get("files_fingerprint")}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    if not recorded.get("fingerprint"):
        say(
            f"NOTE: {weights.parent} records no fingerprint of its run's data (an older run): the images held out "
            "now are assumed to be the run's own."
        )
        return
    now = data_record(data)
    moved = recorded.get("files") not in (None, now.get("files"))  # older runs: not recorded
    if (now["fingerprint"] == recorded["fingerprint"] and not moved) or other_data:  # other data: noted already
        return
    run_dir = next((d for d in list(weights.parents)[:3] if (d / DATA_FILES).is_file()), None)  # best/, step-N
    named = recorded_files_changed(run_dir, data) if run_dir is not None else ""
    sizes = ", ".join(
        f"{k} {recorded[k]} -> {now[k]}" for k in ("train", "val") if k in recorded and recorded[k] != now[k]
    )
    raise RecipeError(
        f"The data differs from what the weights in {weights.parent} were trained and validated on"
        f"{f' ({sizes} images)' if sizes else ''}: the training images' labels, the files at their places or the "
        "images held out for validation are not the same (the dataset folder gained, lost, renamed or replaced "
        f"images since{f': {named}' if named else ''}). Scoring now "
        "would count images the model trained on as held out. Evaluate on the folder as the run saw it, or on other "
        "data named by --dataset with a path of its own (e.g. a copy holding a test/ split)."
    )


def report(cfg, accelerator, weights: Path, note: str, data, metrics: dict | None) -> bool:
    """Print and write eval-<split>.json beside the weights (a new file if one exists). True when
    --target-accuracy was missed."""
    if metrics is None:
        raise RecipeError(
            f"The dataset {data.source!r} has no test or validation split to evaluate on. Add a "
            "test split, or set --val-fraction above 0."
        )
    split = "test" if data.test is not None else "val"
    note = "; ".join(n for n in (note, precision_note(cfg, accelerator)) if n)
    result = {
        "weights": str(weights),
        "split": split,
        "dataset": data.source,
        "loss": metrics["loss"],
        "accuracy": metrics["accuracy"],
        **({"top5_accuracy": metrics["top5_accuracy"]} if "top5_accuracy" in metrics else {}),
        "count": metrics["count"],
        "per_class_accuracy": dict(zip(data.class_names, metrics["per_class_accuracy"])),
        "processes": accelerator.num_processes,
        "precision": accelerator.mixed_precision,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
    }
    if note:
        result["note"] = note
    out = weights.parent / f"eval-{split}.json"
    if out.exists():  # earlier results are kept: a new file per evaluation
        out = out.with_name(f"eval-{split}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    say(
        f"eval-only: {split} accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f} "
        f"({metrics['count']} images) weights {printable(weights)}"
        + (f"; NOTE: {printable(note)}" if note else "")
        + f"; wrote {printable(out)}"
    )
    if accelerator.is_main_process:
        out.write_text(json.dumps(result, indent=2) + "\n")
    missed = bool(cfg.target_accuracy) and not metrics["accuracy"] >= cfg.target_accuracy  # a NaN misses it
    if missed:
        say(
            f"TARGET MISSED: {split} accuracy {metrics['accuracy']:.4f} is below --target-accuracy "
            f"{cfg.target_accuracy:.4f}."
        )
    return missed
