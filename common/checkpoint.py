"""Crash-safe checkpoints on top of ``accelerator.save_state``.

Layout of a run directory::

    <run>/checkpoints/step-00001234/   accelerate state (model, optimizer, scheduler, scaler, RNG)
                                       + trainer_state.json + COMPLETE
    <run>/best/ and <run>/final/       model.safetensors + model.json (config, classes, preprocessing)

Order of a save: write into ``.tmp-step-N`` -> barrier -> rename to ``step-N`` -> write COMPLETE ->
prune. A folder without COMPLETE is never loaded, never counted and never kept as "latest"; pruning
runs only after the new checkpoint is complete, so the last good checkpoint always survives.
Resume state is read from trainer_state.json, never parsed from folder names.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
WEIGHTS = "model.safetensors"
MODEL_CARD = "model.json"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first, ordered by the global step they record."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not is_complete(child):
            continue
        try:
            found.append((read_state(child)["global_step"], child))
        except (OSError, ValueError, KeyError):
            continue  # unreadable state: treat as incomplete
    return [p for _, p in sorted(found)]


def find_latest(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, run_dir: Path, state: dict, keep: int) -> Path:
    """Write a checkpoint on all ranks (every rank must call this), return its final path."""
    root = Path(run_dir) / "checkpoints"
    name = f"step-{state['global_step']:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # debris of an interrupted write
    accelerator.wait_for_everyone()
    if is_complete(final):  # e.g. epoch end right after a --checkpoint-every save: same state
        return final
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_write(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
        if final.exists():  # an incomplete folder of the same name
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _fsync_write(final / MARKER, "ok\n")
        _fsync_dir(final)
        prune(run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete debris older than them."""
    ckpts = complete_checkpoints(run_dir)
    for old in ckpts[: max(0, len(ckpts) - max(keep, 1))]:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / "checkpoints"
    for child in root.iterdir():
        if child.is_dir() and not is_complete(child):
            shutil.rmtree(child, ignore_errors=True)


# --- model files (best/, final/) -----------------------------------------------------------------

def save_model_dir(accelerator, model, out_dir: Path, card: dict) -> None:
    """model.safetensors + model.json (what predict/eval need to rebuild the model). Main process only;
    written to a temp folder and swapped in, so a crash leaves the previous copy intact."""
    if not accelerator.is_main_process:
        return
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp, old = out_dir.with_name(f".tmp-{out_dir.name}"), out_dir.with_name(f".old-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    _fsync_write(tmp / MODEL_CARD, json.dumps(card, indent=2, sort_keys=True))
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def find_model_dir(path: Path) -> Path:
    """Accept a model dir, a run dir (prefers best/, then final/) or a checkpoint dir's run."""
    path = Path(path)
    for cand in (path, path / "best", path / "final"):
        if (cand / WEIGHTS).is_file() and (cand / MODEL_CARD).is_file():
            return cand
    raise FileNotFoundError(
        f"{path} holds no model weights: expected {WEIGHTS} and {MODEL_CARD} in it or in its best/ or final/ "
        "folder. Pass a run directory of a finished run, or its best/ or final/ folder.")


def load_model_dir(path: Path):
    """Returns (state_dict, card) from a folder written by ``save_model_dir``."""
    from safetensors.torch import load_file

    model_dir = find_model_dir(path)
    return load_file(str(model_dir / WEIGHTS)), json.loads((model_dir / MODEL_CARD).read_text())


def model_signature(model: torch.nn.Module) -> dict:
    """Names and shapes of every parameter and buffer: what must match to load a checkpoint."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}
