"""Resuming a run: the newest readable checkpoint (past a damaged one), the checks that refuse a resume that
would change what the run means, and the notes on what a resume changed (hyperparameters, schedule length)."""

from __future__ import annotations

from pathlib import Path

from common import checkpoint as ckpt
from common.accelerator import on_main
from common.errors import RecipeError
from common.files import move_aside
from common.schedule import lr_multiplier


def start_state(run) -> dict:
    """Where training starts: the newest readable checkpoint's position (``run.resume_path``), or a fresh
    start's. Restores a best/ or final/ a crash left mid-swap, and writes config.json (a resume continued in
    a new folder gets one too)."""
    from common.config import save_config

    if run.accelerator.is_main_process:
        ckpt.restore_interrupted_swaps(run.run_dir)
    state = {"epoch": 0, "batches_in_epoch": 0, "global_step": 0, "best": None, "skipped_steps": 0}
    if run.resume_path is not None:
        state = resume_newest_readable(run)
    elif run.cfg.resume_from == "latest":
        run.say(f"nothing to resume in {run.run_dir / 'checkpoints'} (no complete checkpoint): starting fresh")
    if run.accelerator.is_main_process and (run.resume_path is None or not (run.run_dir / "config.json").exists()):
        save_config(run.cfg, run.run_dir / "config.json")
    return state


def resume_newest_readable(run) -> dict:
    """--resume-from latest falls back past a checkpoint that was marked complete but cannot be read (a power
    loss while it was written), and says so; the damaged folder is renamed damaged-step-N (damaged-step-N.2, ...
    when that step was damaged before) and kept."""
    while True:
        try:
            return resume_from(run, run.resume_path)
        except ckpt.DamagedCheckpoint as err:
            damaged = run.resume_path
            older = [p for p in ckpt.complete_checkpoints(run.run_dir) if p.name < damaged.name]
            if run.cfg.resume_from != "latest" or not older:
                raise RecipeError(f"Cannot resume from {damaged}: {err}. "
                                  + ("Pass --resume-from latest to fall back to an older checkpoint, or another "
                                     "checkpoint folder." if older else "No older complete checkpoint exists: start "
                                     "a new run with a new --output-dir.")) from None
            run.accelerator.wait_for_everyone()  # every rank has seen the damage before the folder moves
            # a copy damaged before (the fallback re-wrote this step) keeps its name: this one gets damaged-step-N.2
            kept = on_main(run.accelerator, lambda: move_aside(damaged, f"damaged-{damaged.name}").name)
            run.say(f"NOTE: the newest checkpoint {damaged} is damaged ({err}); it was renamed "
                     f"{kept} and the run resumes from the previous one, {older[-1]}.")
            run.resume_path = older[-1]

def resume_from(run, path: Path) -> dict:
    cfg, acc = run.cfg, run.accelerator
    state = ckpt.read_state(path)
    notes = ckpt.check_resumable(path, state, cfg, acc, run.model)
    if state.get("data_fingerprint", run.data_fingerprint) != run.data_fingerprint:
        raise RecipeError(f"The data differs from what the checkpoint {path} trained on: the training images' labels "
                          "or the images held out for validation are not the same (the dataset folder changed, or "
                          "another dataset was given). Resuming would validate on other images than the run did. "
                          "Resume on the run's own data, or start a new run with a new --output-dir.")
    if state["config"].get("epochs", cfg.epochs) != cfg.epochs:
        notes.append(schedule_change_note(run, state))
    if cfg.resume_from != "latest":
        moved = on_main(run.accelerator, lambda: ckpt.supersede_newer(run.run_dir, state["global_step"]))
        if moved:
            notes.append(f"resuming from an older checkpoint: the newer ones of the abandoned continuation were "
                         f"renamed ({', '.join(moved)}) and will not be resumed from.")
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    ckpt.verify_files(path)  # before Accelerate unpickles anything (it skips an unreadable RNG file quietly)
    acc.load_state(str(path))
    changes = ckpt.apply_hyperparameters(run.optimizer, run.scheduler, fresh, cfg)
    for note in notes:
        run.say(f"NOTE: {note}")
    if changes:
        run.say(f"NOTE: applied from the command line over the checkpoint's values: {', '.join(changes)}")
    run.say(f"resumed from {path}: epoch {state['epoch'] + 1}, batch {state['batches_in_epoch']}, "
             f"step {state['global_step']}")
    return state

def schedule_change_note(run, state: dict) -> str:
    cfg, step = run.cfg, state["global_step"]
    old_epochs = state["config"]["epochs"]

    def multiplier(epochs):
        total = run.steps_per_epoch * epochs
        return lr_multiplier(step, total, int(round(cfg.warmup_fraction * total)), cfg.schedule,
                             cfg.warmup_start, cfg.final_lr)

    return (f"--epochs {cfg.epochs} differs from the run's {old_epochs}: the LR schedule is recomputed for "
            f"{run.steps_per_epoch * cfg.epochs} steps instead of {run.steps_per_epoch * old_epochs}, so at step "
            f"{step} the learning rate moves from {multiplier(old_epochs):.3g} to {multiplier(cfg.epochs):.3g} of "
            f"its peak and follows the new curve from there; the result will differ from a run started with "
            f"--epochs {cfg.epochs}.")
