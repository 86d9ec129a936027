"""The start and the end of a run, shared by the recipes: resuming from a checkpoint, the best model,
and the final evaluation, weights, summary and target check. The training loop stays in the recipe."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from common import checkpoint as ckpt
from common.config import sanitize_for_hparams, to_dict
from common.metrics import evaluate
from common.runtime import EXIT_TARGET_MISSED, RecipeError

# Config fields that may change on resume without changing what the checkpoint means.
RESUME_MAY_CHANGE = {"epochs", "profile", "output_dir", "resume_from", "checkpoint_every", "keep_checkpoints", "log_every",
                     "eval_every", "target_accuracy", "timeout_s", "max_steps", "cache_dir",
                     "data_on_device", "eval_batch_size", "dataset"}


def build_model(make):
    """Call the model constructor; a shape it can't take becomes a one-paragraph error."""
    try:
        return make()
    except ValueError as err:
        raise RecipeError(f"The data can't feed this model: {err}. Pass --image-size N to resize the images "
                          "(and --channels 1 or 3), or pick the recipe whose model fits the data.") from None


def checkpoint_meta(cfg, accelerator, model) -> dict:
    """What a checkpoint records besides the training position: enough to refuse a wrong resume."""
    return {"seed": cfg.seed, "world_size": accelerator.num_processes, "global_batch": cfg.batch_size,
            "config": to_dict(cfg), "model_signature": ckpt.model_signature(accelerator.unwrap_model(model))}


def resume_checkpoint(accelerator, cfg, run_dir: Path, model, say=print) -> dict:
    """Load the newest complete checkpoint (or the one named) into the prepared objects; return its
    trainer state. Refuses checkpoints from another model or with a different global batch."""
    path = ckpt.find_latest(run_dir) if cfg.resume_from == "latest" else Path(cfg.resume_from)
    state = ckpt.read_state(path)
    mine = ckpt.model_signature(accelerator.unwrap_model(model))
    theirs = state.get("model_signature", {})
    if mine != theirs:
        diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs.get(k)]
        raise RecipeError(
            f"The checkpoint {path} was written by a different model (first differences: {', '.join(diff[:4])}). "
            "Resume with the same recipe and model settings (see the config.json in its run directory), or "
            "start a new run with a new --output-dir.")
    if state["global_batch"] != cfg.batch_size:
        raise RecipeError(
            f"The checkpoint {path} was trained with global batch {state['global_batch']}, this run asks for "
            f"{cfg.batch_size}. The data position would be wrong; resume with --batch-size {state['global_batch']} "
            "(the per-process batch adapts to the number of processes).")
    changed = {k: (v, getattr(cfg, k)) for k, v in state["config"].items()
               if k not in RESUME_MAY_CHANGE and hasattr(cfg, k) and getattr(cfg, k) != v}
    if changed:
        say(f"NOTE: resuming with changed settings {changed}; the result will differ from the original run.")
    if state["world_size"] != accelerator.num_processes:
        say(f"NOTE: the checkpoint was written by {state['world_size']} process(es), this run has "
            f"{accelerator.num_processes}. The global batch ({cfg.batch_size}) and data order are kept; "
            "per-rank augmentation draws differ, so the run will not be bit-identical to an uninterrupted one.")
    accelerator.load_state(str(path))
    say(f"resumed from {path}: epoch {state['epoch'] + 1}, batch {state['batches_in_epoch']}, "
        f"step {state['global_step']}")
    return state


def evaluate_and_log(accelerator, cfg, model, loader, transform, data, log, step: int, split: str = "eval",
                     images=None, say=None) -> dict:
    """Evaluate (exactly, on every process), then log ``<split>/loss``, ``<split>/accuracy``,
    ``<split>/accuracy_class/<name>`` and the confusion-matrix and misclassified-image grids."""
    metrics = evaluate(accelerator, model, loader, transform, data.num_classes, tta_flip=cfg.tta, desc=split)
    per_class = {f"{split}/accuracy_class/{name}": acc
                 for name, acc in zip(data.class_names, metrics.get("per_class_accuracy", []))}
    log.log({f"{split}/loss": metrics["loss"], f"{split}/accuracy": metrics["accuracy"], **per_class}, step=step)
    if metrics["count"]:
        log_eval_images(log, metrics, images if images is not None else data.val.images, data.class_names, split,
                        step)
    if say is not None:
        say(f"{split} at step {step}: loss {metrics['loss']:.4f} accuracy {metrics['accuracy']:.4f} "
            f"({metrics['count']} images)")
    return metrics


def log_eval_images(log, metrics: dict, images: torch.Tensor, class_names, split: str, step: int) -> None:
    """Confusion matrix and a grid of misclassified images (class names, not indices) into TensorBoard."""
    writer = log.writer
    if writer is None:
        return
    from common.plots import confusion_matrix_image, misclassified_grid

    writer.add_image(f"{split}/confusion_matrix", confusion_matrix_image(metrics["confusion"], class_names), step,
                     dataformats="HWC")
    preds, labels = metrics["preds"], metrics["labels"]
    wrong = (preds != labels).nonzero().flatten()[:36]
    writer.add_image(f"{split}/misclassified", misclassified_grid(images[wrong], labels[wrong], preds[wrong],
                                                                  class_names), step, dataformats="HWC")


def is_better(value: float, best, mode: str) -> bool:
    return best is None or (value > best if mode == "max" else value < best)


def versions() -> dict:
    import accelerate
    import datasets

    return {"python": platform.python_version(), "torch": torch.__version__, "accelerate": accelerate.__version__,
            "datasets": datasets.__version__, "platform": platform.platform()}


def finish_run(accelerator, cfg, run_dir: Path, model, eval_loader, transform, data, card: dict, log,
               state: dict, start_time: float, train_samples: int) -> int:
    """Final evaluation (test split, else validation), final weights, hparams, summary, target check."""
    split = "test" if data.test is not None else "val"
    final = {}
    if eval_loader is not None:
        metrics = evaluate_and_log(accelerator, cfg, model, eval_loader, transform, data, log, state["global_step"],
                                   split, (data.test if split == "test" else data.val).images)
        final = {f"{split}/loss": metrics["loss"], f"{split}/accuracy": metrics["accuracy"],
                 f"{split}/count": metrics["count"]}
    ckpt.save_model_dir(accelerator, model, run_dir / "final",
                        {**card, "metrics": final, "epoch": state["epoch"]})
    wall = time.time() - start_time
    summary = {
        "recipe": card["recipe"], "final": final, "best": {cfg.monitor: state["best"]},
        "epochs_completed": state["epoch"], "global_step": state["global_step"], "skipped_steps": state["skipped_steps"],
        "wall_time_s": round(wall, 2), "train_samples_per_sec": round(train_samples / max(wall, 1e-9), 1),
        "processes": accelerator.num_processes, "precision": accelerator.mixed_precision,
        "device": accelerator.device.type, "versions": versions(),
    }
    log.hparams(sanitize_for_hparams(to_dict(cfg)),
                {k: v for k, v in final.items() if not k.endswith("/count")})
    log.close()
    if accelerator.is_main_process:
        from common.plots import save_curves_png

        save_curves_png(run_dir / "metrics.jsonl", run_dir / "curves.png")
        if final.get(f"{split}/count"):
            from common.plots import confusion_matrix_image, save_image_png

            save_image_png(confusion_matrix_image(metrics["confusion"], data.class_names), run_dir / "confusion_matrix.png")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in final.items()]
        rows += [("best " + cfg.monitor, f"{state['best']:.4f}" if state["best"] is not None else "-"),
                 ("epochs completed", str(state["epoch"])), ("optimizer steps", str(state["global_step"])),
                 ("wall time", f"{wall:.1f} s"), ("processes", str(accelerator.num_processes)),
                 ("precision", accelerator.mixed_precision), ("run dir", str(run_dir))]
        width = max(len(k) for k, _ in rows)
        accelerator.print("summary:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows))
    acc = final.get(f"{split}/accuracy")
    if cfg.target_accuracy and (acc is None or acc < cfg.target_accuracy):
        accelerator.print(f"TARGET MISSED: final {split} accuracy {acc if acc is None else f'{acc:.4f}'} is below "
                          f"--target-accuracy {cfg.target_accuracy:.4f}.")
        return EXIT_TARGET_MISSED
    if cfg.target_accuracy:
        accelerator.print(f"target reached: final {split} accuracy {acc:.4f} >= {cfg.target_accuracy:.4f}")
    return 0


def evaluate_weights(accelerator, cfg, model, eval_loader, transform, data, say=print) -> int:
    """--eval-only: load the weights in --checkpoint (a run, best/, final/ or a checkpoint folder) and
    evaluate them on the test split (else validation) on every process; print and write the metrics."""
    from safetensors.torch import load_file

    root = Path(cfg.checkpoint).expanduser()
    candidates = [root, root / "best", root / "final", ckpt.find_latest(root)]
    found = next((c / ckpt.WEIGHTS for c in candidates if c is not None and (c / ckpt.WEIGHTS).is_file()), None)
    if found is None:
        raise RecipeError(f"--checkpoint {cfg.checkpoint} holds no {ckpt.WEIGHTS} (looked in it, its best/ and "
                          "final/ folders and its newest checkpoint). Pass a run directory or one of those folders.")
    if eval_loader is None:
        raise RecipeError(f"The dataset {data.source!r} has no test or validation split to evaluate on. Add a test "
                          "split, or set --val-fraction above 0.")
    try:
        accelerator.unwrap_model(model).load_state_dict(load_file(str(found)))
    except RuntimeError as err:
        raise RecipeError(f"The weights in {found} don't fit this recipe's model with these settings "
                          f"({str(err).splitlines()[0]}). Use the recipe and model options the run was trained with "
                          "(see model.json or config.json beside them).") from None
    split = "test" if data.test is not None else "val"
    metrics = evaluate(accelerator, model, eval_loader, transform, data.num_classes, tta_flip=cfg.tta)
    result = {"weights": str(found), "split": split, "loss": metrics["loss"], "accuracy": metrics["accuracy"],
              "count": metrics["count"], "per_class_accuracy": dict(zip(data.class_names, metrics["per_class_accuracy"])),
              "processes": accelerator.num_processes}
    say(f"eval-only: {split} accuracy {metrics['accuracy']:.4f} loss {metrics['loss']:.4f} "
        f"({metrics['count']} images) weights {found}")
    if accelerator.is_main_process:
        (found.parent / f"eval-{split}.json").write_text(json.dumps(result, indent=2) + "\n")
    if cfg.target_accuracy and metrics["accuracy"] < cfg.target_accuracy:
        say(f"TARGET MISSED: {split} accuracy {metrics['accuracy']:.4f} is below --target-accuracy {cfg.target_accuracy:.4f}.")
        return EXIT_TARGET_MISSED
    return 0
