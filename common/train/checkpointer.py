"""The run's position (epoch, batch, optimizer step) and its checkpoints: when one is written, what it holds,
and resuming from one: the newest readable checkpoint (past a damaged one), the checks that refuse a resume that
would change what the run means, and the notes on what a resume changed (hyperparameters, schedule length).

``common.train.checkpoint`` is the file format underneath (crash-safe writes, completion markers, model folders)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
from pathlib import Path

import torch

from common.config import (
    RESUME_APPLIED,
    RESUME_FREE,
    RESUME_LAUNCH_OWN,
    RESUME_MUST_MATCH,
    received,
    save_config,
)
from common.config_checks import check_received
from common.console import say
from common.data.splits import (
    DATA_FILES,
    data_fingerprint,
    files_fingerprint,
    files_listing_json,
    recorded_files_changed,
)
from common.errors import RecipeError
from common.files import fsync_dir, move_aside, write_atomic
from common.schedules import lr_multiplier
from common.train import checkpoint as ckpt
from common.train.accelerator import on_main
from common.train.sharding import share_buffers


class Checkpointer:
    """Owns the position: ``epoch`` (0-based, the one running), ``batch`` (batches of it handed out to the loop, the
    one in the loop's body included), ``through`` (those behind the loop), ``global_step`` (optimizer updates taken),
    ``start_batch`` (where a resumed epoch starts) and the newest checkpoint written or resumed (``saved``: its
    position, and ``saved_path``); the run's length (``steps_per_epoch``, ``total_steps``); and the data fingerprint
    every checkpoint records and a resume compares."""

    def __init__(
        self, cfg, accelerator, run_dir: Path, resume_path: Path | None, batches_per_epoch: int, data, epoch_sides=None
    ):
        self.cfg, self.accelerator, self.run_dir, self.resume_path = cfg, accelerator, run_dir, resume_path
        self.epoch_sides = epoch_sides  # a photo loader's crop side per epoch (progressive resizing), or None
        self.batches_per_epoch = batches_per_epoch
        self.steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
        self.total_steps = min(self.steps_per_epoch * cfg.epochs, cfg.max_steps or math.inf)
        self.data, self.data_fingerprint = data, data_fingerprint(data)
        self.files_fingerprint = files_fingerprint(data)  # which file is at each row (None for a table dataset)
        self.epoch = self.batch = self.start_batch = self.global_step = 0
        self.through = 0  # batches of the epoch behind the loop (the position a checkpoint records)
        self.accumulating = False  # micro-batches trained since the last update
        self.saved = self.saved_path = None
        self.completing = None  # the newest checkpoint's completion, running in a thread (common.train.checkpoint)
        compile_neutral_checkpoints(accelerator)

    def position(self) -> tuple[int, int, int]:
        """(epoch, batches of it trained, optimizer steps): what a checkpoint records and a resume continues from.
        A batch is behind the loop once an update took it, or the loop took the next one outside an accumulation
        (a ``continue``d batch); an epoch is complete when all its batches are: the position is then the next
        epoch's start, whatever the loop calls after it."""
        if self.through >= self.batches_per_epoch:
            return self.epoch + 1, 0, self.global_step
        return self.epoch, self.through, self.global_step

    @property
    def epochs_completed(self) -> int:
        return self.position()[0]

    def last_step(self) -> bool:
        """The run's last step (of its --epochs) is taken."""
        return self.global_step >= self.steps_per_epoch * self.cfg.epochs

    # --- moving the position: only through these, called where batches are handed out and updates counted --------

    def enter_epoch(self, epoch: int) -> int:
        """The loop starts epoch ``epoch``'s batches: at the resumed batch in the resumed epoch, else at 0. Returns
        it."""
        first = self.start_batch if epoch == self.epoch else 0
        self.epoch, self.batch, self.through, self.start_batch, self.accumulating = epoch, first, first, 0, False
        return first

    def handed_out(self) -> None:
        """The loop was handed the next batch of the epoch: the one before is behind it (trained, or skipped by a
        ``continue``), unless it began an accumulation the next update completes."""
        if not self.accumulating:
            self.through = self.batch
        self.batch += 1

    def micro_batch(self) -> None:
        """The loop trained on a --grad-accum micro-batch (run.track between updates)."""
        self.accumulating = True

    def update(self) -> None:
        """An optimizer update is taken on the batches handed out so far (run.track at a --grad-accum boundary)."""
        self.global_step += 1
        self.through, self.accumulating = self.batch, False

    def epoch_exhausted(self) -> None:
        """Every batch of the epoch was handed out and the loop asked for another: the epoch is complete (batches the
        loop skipped with ``continue`` are behind it)."""
        self.through = self.batches_per_epoch

    # --- resume or fresh start -------------------------------------------------------------------

    def start(self, model, optimizer, scheduler) -> dict:
        """Fresh, or resumed exactly from the newest complete checkpoint into everything prepared. Sets the position
        and returns the rest of the checkpoint's state (``best``, ``skipped_steps``). Restores a best/ or final/ a
        crash left mid-swap, and writes config.json (a resume continued in a new folder gets one too)."""
        if self.accelerator.is_main_process:
            ckpt.restore_interrupted_swaps(self.run_dir)
        state = {"epoch": 0, "batches_in_epoch": 0, "global_step": 0, "best": None, "skipped_steps": 0}
        state["stale_evaluations"] = 0  # --patience's count: evaluations since --monitor last improved
        if self.resume_path is not None:
            state = self._resume_newest_readable(model, optimizer, scheduler)
            self._finish_interrupted_swap()
        elif self.cfg.resume_from == "latest":
            say(f"nothing to resume in {self.run_dir / 'checkpoints'} (no complete checkpoint): starting fresh")
        if self.accelerator.is_main_process and (
            self.resume_path is None or not (self.run_dir / "config.json").exists()
        ):
            save_config(self.cfg, self.run_dir / "config.json")
            listing = files_listing_json(self.data)  # recorded, so that a changed folder is named file by file
            if listing is not None:
                write_atomic(self.run_dir / DATA_FILES, listing)
        self.epoch, self.start_batch, self.global_step = state["epoch"], state["batches_in_epoch"], state["global_step"]
        self.batch = self.through = self.start_batch
        if self.resume_path is not None:
            self.saved, self.saved_path = self.position(), self.resume_path
        return state

    def _finish_interrupted_swap(self) -> None:
        """Resumed from ``.old-step-N`` (a step written again, killed between its two renames:
        ``ckpt.complete_checkpoints``): it becomes ``step-N`` again, in place of the unmarked copy, if any."""
        path = self.resume_path
        if not path.name.startswith(".old-"):
            return

        def restore():
            final = path.with_name(path.name.removeprefix(".old-"))
            if final.exists():  # the new copy, renamed in but never marked complete: debris of the interrupted write
                shutil.rmtree(final)
            os.replace(path, final)
            fsync_dir(final.parent)
            return final.name

        self.resume_path = path.with_name(on_main(self.accelerator, restore))

    def _resume_newest_readable(self, model, optimizer, scheduler) -> dict:
        """--resume-from latest falls back past a checkpoint that was marked complete but cannot be read (a power
        loss while it was written), and says so; the damaged folder is renamed damaged-step-N (damaged-step-N.2, ...
        when that step was damaged before) and kept."""
        while True:
            try:
                return self._resume_from(self.resume_path, model, optimizer, scheduler)
            except ckpt.DamagedCheckpoint as err:
                damaged = self.resume_path
                older = [p for p in ckpt.complete_checkpoints(self.run_dir) if ckpt.step_of(p) < ckpt.step_of(damaged)]
                if self.cfg.resume_from != "latest" or not older:
                    raise RecipeError(
                        f"Cannot resume from {damaged}: {err}. "
                        + (
                            "Pass --resume-from latest to fall back to an older checkpoint, or another "
                            "checkpoint folder."
                            if older
                            else "No older complete checkpoint exists: start a new run with a new --output-dir."
                        )
                    ) from None
                self.accelerator.wait_for_everyone()  # every rank has seen the damage before the folder moves
                # a copy damaged before (the fallback re-wrote this step) keeps its name: this one gets damaged-step-N.2
                kept = on_main(self.accelerator, lambda path=damaged: move_aside(path, f"damaged-{path.name}").name)
                say(
                    f"NOTE: the newest checkpoint {damaged} is damaged ({err}); it was renamed "
                    f"{kept} and the run resumes from the previous one, {older[-1]}."
                )
                self.resume_path = older[-1]

    def _resume_from(self, path: Path, model, optimizer, scheduler) -> dict:
        cfg, acc = self.cfg, self.accelerator
        state = ckpt.read_state(path)
        notes = check_resumable(path, state, cfg, acc, model)
        moved = state.get("files_fingerprint") not in (None, self.files_fingerprint)  # older checkpoints: not recorded
        if state.get("data_fingerprint", self.data_fingerprint) != self.data_fingerprint or moved:
            named = recorded_files_changed(self.run_dir, self.data)
            named = f": {named}" if named else ""
            raise RecipeError(
                f"The data differs from what the checkpoint {path} trained on: the training images' "
                "labels, the files at their places or the images held out for validation are not the "
                f"same (the dataset folder changed, or another dataset was given){named}. "
                "Resuming would train and validate on other images than the run did. Resume on the run's "
                "own data, or start a new run with a new --output-dir."
            )
        if state["config"].get("epochs", cfg.epochs) != cfg.epochs:
            notes.append(self._schedule_change_note(state))
        if cfg.resume_from != "latest":
            moved = on_main(acc, lambda: ckpt.supersede_newer(self.run_dir, state["global_step"]))
            if moved:
                notes.append(
                    f"resuming from an older checkpoint: the newer ones of the abandoned continuation were "
                    f"renamed ({', '.join(moved)}) and will not be resumed from."
                )
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        check_prepared(path, acc)
        ckpt.verify_files(path)  # before Accelerate unpickles anything (it skips an unreadable RNG file quietly)
        extra = ckpt.not_loaded(path)
        if extra:
            notes.append(f"{path} also holds {', '.join(extra)}: not read by the resume, left as it is.")
        try:
            acc.load_state(str(path))
        except ValueError as err:  # torch's optimizer: "... different number of parameter groups", "... group ..."
            if "parameter group" not in str(err):
                raise
            raise RecipeError(
                f"The checkpoint {path} holds an optimizer whose parameter groups differ from this run's ({err}): "
                "it was written by another version of the recipe or with another --layer-decay. Resume it with "
                "the version and settings that wrote it, or start a new run with a new --output-dir."
            ) from None
        changes = apply_hyperparameters(optimizer, scheduler, fresh, cfg)
        notes += self._best_starts_over(state)
        for note in notes:
            say(f"NOTE: {note}")
        if changes:
            say(f"NOTE: applied from the command line over the checkpoint's values: {', '.join(changes)}")
        say(
            f"resumed from {path}: epoch {state['epoch'] + 1}, batch {state['batches_in_epoch']}, "
            f"step {state['global_step']}"
        )
        return state

    def _best_starts_over(self, state: dict) -> list[str]:
        """A resume that changes --monitor or --mode: the run's best value measured another thing (or the other way
        round), so it starts over with this launch's evaluations, and the run's best/ is kept aside under its
        metric's name (predict and export take best/: after the next evaluation, the new metric's best)."""
        cfg, saved = self.cfg, state.get("config", {})
        old = (saved.get("monitor", cfg.monitor), saved.get("mode", cfg.mode))
        if old == (cfg.monitor, cfg.mode) or state.get("best") is None:
            return []
        state["best"], state["stale_evaluations"] = None, 0
        best, name = self.run_dir / "best", f"best-{old[0].replace('/', '_')}-{old[1]}"
        moved = on_main(self.accelerator, lambda: move_aside(best, name).name if best.is_dir() else None)
        kept = f"; the run's best/ (by {old[0]}) was renamed {moved}" if moved else ""
        return [
            f"--monitor {cfg.monitor} --mode {cfg.mode} differs from the run's {old[0]} --mode {old[1]}: the best "
            f"value starts over with this launch's evaluations (a {old[0]} is never compared with a "
            f"{cfg.monitor}){kept}."
        ]

    def _schedule_change_note(self, state: dict) -> str:
        cfg, step, old_epochs = self.cfg, state["global_step"], state["config"]["epochs"]

        def multiplier(epochs):
            total = self.steps_per_epoch * epochs
            return lr_multiplier(
                step, total, int(round(cfg.warmup_fraction * total)), cfg.schedule, cfg.warmup_start, cfg.final_lr
            )

        crops = ""
        sides = self.epoch_sides
        if isinstance(sides, functools.partial) and sides.args and sides.args[0] is cfg:  # the recipe's crop_side(cfg)
            epoch, before = state["epoch"], dataclasses.replace(cfg, epochs=old_epochs)
            new = [sides.func(cfg, e) for e in range(epoch, cfg.epochs)]
            old = [sides.func(before, e) for e in range(epoch, old_epochs)]
            if new != old:
                crops = (
                    f" The training crops' progressive resizing follows --epochs too: epochs {epoch + 1}-{cfg.epochs} "
                    f"now train at {', '.join(map(str, new))} px (the run had planned "
                    f"{', '.join(map(str, old)) or 'none'} px for epochs {epoch + 1}-{old_epochs})."
                )
        return (
            f"--epochs {cfg.epochs} differs from the run's {old_epochs}: the LR schedule is recomputed for "
            f"{self.steps_per_epoch * cfg.epochs} steps instead of {self.steps_per_epoch * old_epochs}, so at step "
            f"{step} the learning rate moves from {multiplier(old_epochs):.3g} to {multiplier(cfg.epochs):.3g} of "
            f"its peak and follows the new curve from there.{crops} The result will differ from a run started with "
            f"--epochs {cfg.epochs}."
        )

    # --- writing ---------------------------------------------------------------------------------

    def save(self, model, best, skipped_steps: int, stale_evaluations: int = 0) -> Path:
        """A crash-safe checkpoint of everything prepared and the position (``common.train.checkpoint``). Returns once
        every rank's files are written; the main process completes it in a thread (``wait_written``)."""
        share_buffers(self.accelerator, model)  # FSDP2: one model's BatchNorm statistics on every process
        epoch, batches, step = self.position()
        state = {
            "epoch": epoch,
            "batches_in_epoch": batches,
            "global_step": step,
            "best": best,
            "skipped_steps": skipped_steps,
            "stale_evaluations": stale_evaluations,
            "data_fingerprint": self.data_fingerprint,
            "files_fingerprint": self.files_fingerprint,
            **checkpoint_meta(self.cfg, self.accelerator, model),
        }
        self.wait_written()  # one write at a time
        path, self.completing = ckpt.save_checkpoint(
            self.accelerator, self.run_dir, state, self.cfg.keep_checkpoints, background=True
        )
        self.saved, self.saved_path = self.position(), path
        return path

    def wait_written(self) -> None:
        """The newest checkpoint complete on disk (its files made durable, the folder renamed and marked COMPLETE),
        which the main process finishes in a thread while training goes on; raises what stopped it."""
        completing, self.completing = self.completing, None
        if completing is not None:
            completing.result()


# --- what a resume refuses, takes and applies ----------------------------------------------------------


COMPILED = "_orig_mod"  # the attribute torch.compile's wrapper keeps the model under, a segment of its state keys


def compile_neutral_checkpoints(accelerator) -> None:
    """A checkpoint holds the model's own state keys whether or not the run was compiled (``accelerate launch
    --dynamo_backend ...`` wraps the prepared model, whose state keys then start with ``_orig_mod.``), so a compiled
    run resumes without the flag and the other way round. Accelerate calls these hooks with the lists it saves
    from and loads into: a compiled model's weights are saved under their plain keys and loaded into the model
    inside the wrapper (the same parameters)."""

    def before_save(models, weights, out_dir):
        for i, state in enumerate(weights):
            if any(COMPILED in key.split(".") for key in state):
                weights[i] = {".".join(p for p in k.split(".") if p != COMPILED): v for k, v in state.items()}

    def before_load(models, in_dir):
        for i, model in enumerate(models):
            if isinstance(getattr(model, COMPILED, None), torch.nn.Module):
                models[i] = getattr(model, COMPILED)

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)


def checkpoint_meta(cfg, accelerator, model) -> dict:
    """What a checkpoint records besides the training position: enough to refuse a wrong resume."""
    return {
        "seed": cfg.seed,
        "world_size": accelerator.num_processes,
        "global_batch": cfg.batch_size,
        "config": dataclasses.asdict(cfg),
        "model_signature": ckpt.model_signature(accelerator.unwrap_model(model, keep_torch_compile=False)),
        "sharded": "FSDP2" if accelerator.is_fsdp2 else None,  # the model's files: sharded folders, or one file
    }


def adopt_resume_settings(path: Path, cfg) -> list[str]:
    """The run's own settings, read from the checkpoint ``path`` into ``cfg``, before anything is built from them (the
    Accelerator's data seed and accumulation, the data, the model): every setting this command does not give, except
    this launch's own (``common.config.RESUME_LAUNCH_OWN``: --max-steps, --output-dir, caches, workers, ...). A given
    value other than the run's is refused where it would change what the run means (``RESUME_MUST_MATCH``: it would
    validate on trained-on images or resume at the wrong data position); the others are the command's, said later by
    the resume. Returns a note on what was taken from the checkpoint."""
    try:
        saved = ckpt.read_state(path).get("config", {})
    except ckpt.DamagedCheckpoint:  # the resume falls back to an older checkpoint; the run's settings are the same
        try:
            saved = json.loads((Path(path).parents[1] / "config.json").read_text())
        except (OSError, ValueError):
            return []
    if not isinstance(saved, dict):
        return []
    explicit = getattr(cfg, "explicit", set())
    refused, taken = [], {}
    for field in dataclasses.fields(cfg):
        key = field.name
        if key not in saved or key in RESUME_LAUNCH_OWN or getattr(cfg, key) == saved[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if key not in explicit:
            value = received(type(cfg), key, saved[key], f"the checkpoint {path}")
            if value != getattr(cfg, key):
                setattr(cfg, key, value)
                taken[key] = f"{flag} {value!r}"
        elif key in RESUME_MUST_MATCH:
            refused.append(f"{flag} {getattr(cfg, key)!r} (the run used {saved[key]!r}: {RESUME_MUST_MATCH[key]})")
    if refused:
        raise RecipeError(
            f"Refusing to resume from {path} with {'; '.join(refused)}. Resume without "
            f"{'that flag' if len(refused) == 1 else 'those flags'} (the run's own values are then "
            "used), or start a new run with a new --output-dir. Nothing was changed."
        )
    if not taken:
        return []
    check_received(cfg, f"the checkpoint {path}")
    if "lr" in taken:  # the startup line says where the peak LR came from
        cfg.lr_note = "the run's own, from its checkpoint"
    return [f"resuming with the run's own {', '.join(taken.values())} (from the checkpoint)"]


def changed_settings(saved, cfg) -> dict:
    """The run's settings (``saved``: its config) that this command changes and that no rule of ``common.config``
    settles (neither refused, applied nor free: a recipe's model or augmentation settings, say):
    {name: (the run's value, this command's)}."""
    if not isinstance(saved, dict):
        return {}
    settled = RESUME_FREE | RESUME_APPLIED | set(RESUME_MUST_MATCH)
    mine = dataclasses.asdict(cfg)
    return {k: (saved[k], mine[k]) for k in sorted(mine) if k in saved and k not in settled and saved[k] != mine[k]}


PREPARED = {  # what accelerator.prepare() keeps, and the names save_state gives each one's files (a number after the
    # first: optimizer.bin, optimizer_1.bin; FSDP2's are folders)
    "models": ("_models", re.compile(r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)|pytorch_model_fsdp(_\d+)?")),
    "optimizers": ("_optimizers", re.compile(r"optimizer(_\d+)?(\.bin)?")),
    "schedulers": ("_schedulers", re.compile(r"scheduler(_\d+)?\.bin")),
}


def check_prepared(path: Path, accelerator) -> None:
    """A loop that prepares other objects than the run it resumes (a second optimizer or scheduler added, or one taken
    out) is refused before anything is loaded, naming both counts: Accelerate would fail on a missing file, or load
    the files it finds into objects in another order."""
    names = [p.name for p in path.iterdir()]
    differ = []
    for kind, (attribute, pattern) in PREPARED.items():
        held = sum(1 for n in names if pattern.fullmatch(n))
        prepared = len(getattr(accelerator, attribute, []))
        if held != prepared:
            differ.append(f"{prepared} {kind} prepared by this launch, {held} in the checkpoint")
    if differ:
        raise RecipeError(
            f"The loop prepares other objects than the checkpoint {path} holds: {'; '.join(differ)}. Every object "
            "passed to accelerator.prepare(...) is saved in a checkpoint and loaded back in the same order, so a "
            "resume must prepare the ones the run did. Resume with the loop the run was started with, or start a new "
            "run with a new --output-dir (a model of a run loads with --weights <run>/best/model.safetensors)."
        )


def check_resumable(path: Path, state: dict, cfg, accelerator, model) -> list[str]:
    """Refuse a checkpoint of another model or global batch; return notes on what else changed."""
    mine = ckpt.model_signature(accelerator.unwrap_model(model, keep_torch_compile=False))
    theirs = state.get("model_signature", {})
    if mine != theirs:
        diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs.get(k)]
        used = [
            f"--{key.replace('_', '-')} {str(old)[:60]!r} (this command: {str(new)[:60]!r})"
            for key, (old, new) in changed_settings(state.get("config"), cfg).items()
        ]
        raise RecipeError(
            f"The checkpoint {path} was written by a different model (first differences: {', '.join(diff[:4])}). "
            + (f"The run used {'; '.join(used[:6])}. " if used else "")
            + "Resume with the same recipe and model settings (see the config.json in its run directory), or "
            "start a new run with a new --output-dir."
        )
    sharded = "FSDP2" if accelerator.is_fsdp2 else None
    if state.get("sharded") != sharded:
        said = {"FSDP2": "sharded by FSDP version 2", None: "whole on every process (DDP or one process)"}
        raise RecipeError(
            f"The checkpoint {path} holds a model {said.get(state.get('sharded'), state.get('sharded'))}, and "
            f"this launch trains it {said[sharded]}: its files cannot be loaded that way. Resume with the launcher "
            "answer the run was started with (with or without --use_fsdp --fsdp_version 2); the number of "
            "processes may change. To go on without FSDP, start a new run from the run's final/ or best/ "
            "weights (--weights <run>/best/model.safetensors)."
        )
    if state["global_batch"] != cfg.batch_size:
        raise RecipeError(
            f"The checkpoint {path} was trained with global batch {state['global_batch']}, this run asks for "
            f"{cfg.batch_size}. The data position would be wrong; resume with --batch-size {state['global_batch']} "
            "(the per-process batch adapts to the number of processes)."
        )
    notes = []
    changed = changed_settings(state["config"], cfg)  # the must-match ones were settled before
    if changed:
        notes.append(f"resuming with changed settings {changed}; the result will differ from the original run.")
    if state["world_size"] != accelerator.num_processes:
        notes.append(
            f"the checkpoint was written by {state['world_size']} process(es), this run has "
            f"{accelerator.num_processes}. The global batch ({cfg.batch_size}) and data order are kept; "
            "per-rank augmentation draws differ, so the run will not be bit-identical to an uninterrupted "
            "one."
        )
    return notes


def apply_hyperparameters(optimizer, scheduler, fresh: list[dict], cfg) -> list[str]:
    """After ``load_state`` restored the checkpoint's optimizer and scheduler: put back the optimizer
    hyperparameters this command line asked for (``common.config.RESUME_APPLIED``, e.g. the
    learning rate, weight decay, momentum; ``fresh``: the param groups' values before loading), keeping the
    schedule's position. Returns what changed, e.g. ['lr 0.002 -> 1e-05']."""

    def show(value):
        return ",".join(f"{v:g}" for v in value) if isinstance(value, (tuple, list)) else f"{value:g}"

    changes = []
    scheduler = getattr(scheduler, "scheduler", scheduler)  # the LambdaLR inside Accelerate's wrapper
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh)):
        for key in RESUME_APPLIED & {f.name for f in dataclasses.fields(cfg)}:
            if key == "lr":
                old, new = group.get("initial_lr", group["lr"]), want.get("initial_lr", want["lr"])
                if old != new:
                    group["initial_lr"] = new
                    scheduler.base_lrs[i] = new
                    group["lr"] = new * scheduler.lr_lambdas[i](scheduler.last_epoch)
                    changes.append(f"lr {old:g} -> {new:g}")
            elif key in group and group[key] != want.get(key):
                changes.append(f"{key} {show(group[key])} -> {show(want[key])}")
                group[key] = want[key]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    return sorted(set(changes))
