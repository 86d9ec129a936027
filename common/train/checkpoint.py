"""Crash-safe checkpoints on top of ``accelerator.save_state`` (the file format; the run's position and resuming
are ``common.train.checkpointer``'s).

Layout of a run directory::

    <run>/checkpoints/step-00001234/   accelerate state (model, optimizer, scheduler, scaler, RNG, EMA)
                                       + trainer_state.json + COMPLETE
    <run>/best/ and <run>/final/       model.safetensors + model.json (recipe, config, classes, preprocessing)

Order of a save: write into ``.tmp-step-N`` -> barrier -> fsync -> rename to ``step-N`` -> write COMPLETE ->
prune (the steps after the barrier run on the main process, in a thread while training goes on when asked). A folder
without COMPLETE is never loaded, never counted and never kept as "latest"; pruning runs only after the new
checkpoint is complete, so the last good checkpoint always survives. Every rank takes the same branches (a save never
returns early on one rank). Resume state is read from trainer_state.json, never parsed from folder names.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from common import vision
from common.data.splits import data_record
from common.errors import RecipeError
from common.files import fsync_dir as _fsync_dir
from common.files import fsync_file as _fsync_file
from common.files import move_aside
from common.files import write_fsynced as _fsync_write
from common.train.sharding import plain_class, share_buffers

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
WEIGHTS = "model.safetensors"
LIBRARY_FILES = "library_files"  # a card's files for the model's own library: {name: text}, and the weights' prefix
MODEL_CARD = "model.json"
STEP_DIR = re.compile(r"^step-\d{8}$")


def follow_umask(path: Path) -> None:
    """safetensors writes files 0600; give them the mode every other file of the run gets."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def is_complete(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / MARKER).is_file() and (path / STATE_FILE).is_file()


POSITION_FIELDS = ("epoch", "batches_in_epoch", "global_step")


def read_state(path: Path) -> dict:
    """The checkpoint's position and record, checked field by field (a file someone sends you is data: a wrong type
    would surface later as a crash far from its cause); DamagedCheckpoint names what is wrong."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{file} is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{file} holds {type(state).__name__}, not the checkpoint's record")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    bad = [f"{k} = {state.get(k)!r}" for k in POSITION_FIELDS if not count(state.get(k))]
    if "skipped_steps" in state and not count(state["skipped_steps"]):
        bad.append(f"skipped_steps = {state['skipped_steps']!r}")
    if not isinstance(state.get("config", {}), dict):
        bad.append("config is not a mapping")
    best = state.get("best")
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
        bad.append(f"best = {best!r}")
    if bad:
        raise DamagedCheckpoint(
            f"{file} holds values a run never writes ({'; '.join(bad)}): not counts of epochs, batches and steps"
        )
    return state


def step_of(path: Path) -> int:
    """The optimizer step a checkpoint records; for one marked complete but unreadable, its folder name's (so a
    resume that meets it says so and falls back past it)."""
    try:
        return read_state(path)["global_step"]
    except DamagedCheckpoint:
        return int(Path(path).name.removeprefix(".old-").split("-")[1])


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete ``step-N`` checkpoints, oldest first, ordered by the global step they record. A step written again
    (the same step, a later position) swaps the new folder in by two renames, ``step-N`` to ``.old-step-N``, then the
    new one to ``step-N``: a kill between them leaves ``.old-step-N`` complete and no complete ``step-N``, and then
    ``.old-step-N`` is that step's checkpoint (a resume reads it where it is; the next completion prunes it)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        name = child.name.removeprefix(".old-")
        if not STEP_DIR.match(name) or not is_complete(child):
            continue
        if name != child.name and is_complete(root / name):  # the swap finished: the new one counts
            continue
        found.append((step_of(child), child))
    return [p for _, p in sorted(found)]


def find_latest(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, run_dir: Path, state: dict, keep: int, background: bool = False):
    """Write a checkpoint on all ranks (every rank must call this); returns (its final path, the completion or None).
    The ranks write their files together (``save_state``); then the main process makes them durable, renames the
    folder, marks it COMPLETE and prunes: at once, or with ``background`` in a thread of its own (a
    ``concurrent.futures.Future``, returned on the main process), so that training goes on meanwhile; wait for it
    before the next save and before the run ends. A complete folder of the same step (from an abandoned continuation
    of this run) is replaced, never kept."""
    root = Path(run_dir) / "checkpoints"
    name = f"step-{state['global_step']:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an interrupted write
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    completion = None
    if accelerator.is_main_process:
        work = functools.partial(_complete, run_dir, state, keep, tmp, final)
        if background:  # Future.result() returns once the checkpoint is complete on disk, or raises what stopped
            # it (a full disk: the folder stays .tmp-step-N, never loaded, and the checkpoint before it is kept)
            pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-completion")
            completion = pool.submit(work)
            pool.shutdown(wait=False)  # the thread ends with its one task
        else:
            work()
    accelerator.wait_for_everyone()
    return final, completion


def _complete(run_dir: Path, state: dict, keep: int, tmp: Path, final: Path) -> None:
    """The main process's part of a save, after every rank's files are written: fsync them and the folder, rename,
    COMPLETE, prune."""
    for f in tmp.glob("*.safetensors"):
        follow_umask(f)
    for f in sorted(tmp.rglob("*")):  # every rank's files on disk (FSDP2's in folders) before the folder is
        if f.is_file():  # renamed and marked complete
            _fsync_file(f)
    for sub in (d for d in tmp.iterdir() if d.is_dir()):
        _fsync_dir(sub)
    _fsync_write(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
    _fsync_dir(tmp)  # and their names: an fsync of a file does not make its entry in a new folder durable
    swap_in(tmp, final, mark=True)
    prune(run_dir, keep)


def swap_in(tmp: Path, final: Path, mark: bool = False) -> None:
    """Put the folder ``tmp`` in the place of ``final`` by two renames, ``final`` to ``.old-<name>`` first, so that a
    crash between them leaves the previous copy whole (``complete_checkpoints``, ``restore_interrupted_swaps``);
    ``mark``: COMPLETE is written in the new one before the previous copy is deleted."""
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if mark:
        _fsync_write(final / MARKER, "ok\n")
        _fsync_dir(final)
    shutil.rmtree(old, ignore_errors=True)


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and the debris of interrupted writes."""
    ckpts = complete_checkpoints(run_dir)
    for old in ckpts[: max(0, len(ckpts) - max(keep, 1))]:
        shutil.rmtree(old, ignore_errors=True)
    kept = set(ckpts[-max(keep, 1) :])  # an .old-step-N among them is that step's checkpoint (complete_checkpoints)
    for child in (Path(run_dir) / "checkpoints").iterdir():
        debris = child not in kept and (
            child.name.startswith((".tmp-step-", ".old-step-"))
            or (STEP_DIR.match(child.name) and not is_complete(child))
        )
        if child.is_dir() and debris:
            shutil.rmtree(child, ignore_errors=True)


def supersede_newer(run_dir: Path, step: int) -> list[str]:
    """Resuming from an older checkpoint abandons the newer ones: rename them (kept, never resumed from,
    never pruned) so that ``--resume-from latest`` continues this run, not the abandoned one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for path in complete_checkpoints(run_dir):
        if step_of(path) > step:
            # never over an earlier superseded copy of this step (two such resumes within one second)
            moved.append(move_aside(path, f"superseded-{stamp}-{path.name}").name)
    return moved


class DamagedCheckpoint(Exception):
    """A complete-marked checkpoint whose files cannot be read (a crash or power loss while it was written)."""


# What a resume reads of a checkpoint folder: Accelerate's files (models, optimizers, schedulers, samplers, data loader
# states, random states, the loss scaler, custom objects; FSDP2's sharded folders) and the weight averages' (EMA,
# Lookahead), each named by one of these stems, alone or followed by "_" (optimizer_1.bin, pytorch_model_fsdp_0/).
LOADED_STEMS = (
    "model",
    "pytorch_model",
    "optimizer",
    "scheduler",
    "sampler",
    "dl_state_dict",
    "random_states",
    "scaler",
    "custom_checkpoint",
    "ema",
    "lookahead",
)


def is_loaded(entry: Path) -> bool:
    """Whether a resume reads ``entry`` of a checkpoint folder (``LOADED_STEMS``)."""
    stem = entry.name.split(".", 1)[0]
    return not entry.name.startswith(".") and any(stem == s or stem.startswith(f"{s}_") for s in LOADED_STEMS)


def not_loaded(path: Path) -> list[str]:
    """What a checkpoint folder holds beyond what a resume reads (an editor's or a notebook's folder, a file of
    yours): left as it is, never judged."""
    return sorted(
        e.name + ("/" if e.is_dir() else "")
        for e in path.iterdir()
        if not is_loaded(e) and e.name not in (MARKER, STATE_FILE)
    )


def verify_files(path: Path) -> None:
    """Before Accelerate loads ``path``, read what it would read: every ``*.safetensors`` file's header against its
    length (safetensors' ``safe_open``); every ``*.pkl``, ``*.bin`` and ``*.pt`` file with Accelerate's ``load``
    (``weights_only``, numpy arrays allowed); every folder (FSDP2's sharded model and optimizer) with
    ``verify_sharded``. No pickle is opened in a way that could run code. Raises DamagedCheckpoint if a file cannot be
    read whole (a safetensors file shorter than its header says, a truncated pickle or .distcp file) and refuses
    (RecipeError) a checkpoint holding pickled data beyond plain data (tensors, numpy arrays, numbers, strings and
    their containers: loading it could run code; a checkpoint written here holds none), an index naming a file
    outside its folder, or custom_checkpoint_*.pkl files, which Accelerate would unpickle without ``weights_only``.
    Every rank reaches the same verdict (the files are shared), so every rank takes the same way on."""
    from accelerate.utils.other import load
    from safetensors import safe_open

    for f in sorted(f for f in path.glob("*.safetensors") if is_loaded(f)):  # others are not read: not judged
        try:
            with safe_open(str(f), "pt"):  # checks that the file holds every byte its header places
                pass
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise DamagedCheckpoint(f"{f} is damaged ({_first_line(err)})") from None

    bad = [f"{f} (custom state, which these recipes never write)" for f in sorted(path.glob("custom_checkpoint_*"))]
    for folder in sorted(p for p in path.iterdir() if p.is_dir() and is_loaded(p)):  # FSDP2's sharded folders
        bad += verify_sharded(folder)
    for f in sorted(f for f in path.iterdir() if is_loaded(f)):
        if f.suffix in (".pkl", ".bin", ".pt") and not f.name.startswith("custom_checkpoint_"):
            bad += _plain_data(f, functools.partial(load, f, map_location="cpu"))
    if bad:
        raise RecipeError(
            f"The checkpoint {path} holds pickled data that is not plain tensors: {'; '.join(bad)}. "
            "Loading it could run code, so the resume was refused and nothing was loaded. Resume only "
            "from checkpoints you wrote or trust, or start a new run with a new --output-dir."
        )


def _plain_data(f: Path, read, item: str = "") -> list[str]:
    """Run ``read`` (a ``weights_only`` load of ``f``, or of its ``item``): [] if it reads plain data, ["<f> (the
    global it needs)"] if torch's weights_only refuses it; DamagedCheckpoint if it cannot be read at all (truncated,
    emptied by a crash). weights_only runs nothing either way."""
    item = f"its item {item}: " if item else ""
    try:
        read()
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            return [f"{f} ({item}{_weights_only_reason(err)})"]
        raise DamagedCheckpoint(f"{f} is damaged ({item}{_first_line(err)})") from None
    except Exception as err:  # noqa: BLE001 - torch.load raises what its reader meets
        raise DamagedCheckpoint(f"{f} is damaged ({item}{type(err).__name__}: {_first_line(err)})") from None
    return []


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0][:160] if str(err) else type(err).__name__


def _weights_only_reason(err: Exception) -> str:
    """The line of torch's weights_only refusal that says what the pickle needs (``Unsupported global: GLOBAL
    builtins.getattr was not an allowed global by default``), without torch's advice to load it anyway."""
    found = re.search(r"unsupported[^\n]*?(?=\. Please|\.?\n|\.?$)", str(err), re.IGNORECASE)
    return (found.group(0) if found else str(err).splitlines()[0])[:160]


# what a sharded checkpoint's index (torch.distributed.checkpoint's .metadata, a pickle torch's
# FileSystemReader.read_metadata reads with plain pickle.load) may name: its own records, torch's sizes, dtypes and
# layouts, and the paths of its files
DCP_INDEX_NAMES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in DCP_INDEX_NAMES.get(module, ()) or (
            module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the index names {module}.{name}, which a sharded checkpoint never holds")


def verify_sharded(folder: Path) -> list[str]:
    """A folder of torch.distributed.checkpoint files (FSDP2's model or optimizer), read before torch reads it. Its
    ``.metadata`` index: with an unpickler that knows only the records an index holds (anything else: returned, as
    not plain data). Every file the index names: inside the folder (else returned) and long enough for the bytes it
    is said to hold (else DamagedCheckpoint). Every byte item (an index entry of BytesStorageMetadata, an optimizer's
    ``param_groups.0.lr``, betas, flags and parameter names: torch unpickles these without ``weights_only``): read by
    torch's own FileSystemReader (offset, length, stream transforms) and opened with ``torch.load(weights_only=True)``;
    one that needs anything beyond plain data (numbers, strings, None, tuples, lists, dicts, tensors) is returned,
    one that cannot be read is DamagedCheckpoint. The tensor items are not unpickled here: torch itself loads them
    with ``weights_only``. Returns what is not plain data, [] if nothing."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    index = folder / ".metadata"
    if not index.is_file():
        raise DamagedCheckpoint(f"{folder} has no .metadata index (an interrupted write)")
    try:
        with open(index, "rb") as f:
            meta = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "never holds" in str(err):
            return [f"{index} ({err})"]
        raise DamagedCheckpoint(f"{index} is damaged ({str(err)[:160]})") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise DamagedCheckpoint(f"{index} is damaged ({type(err).__name__}: {str(err)[:160]})") from None
    storage = getattr(meta, "storage_data", None) or {}
    described = getattr(meta, "state_dict_metadata", None) or {}
    if not isinstance(storage, dict) or not isinstance(described, dict):
        raise DamagedCheckpoint(f"{index} is damaged (not the index of a sharded checkpoint)")
    for item in storage.values():
        if not isinstance(item, _StorageInfo):
            raise DamagedCheckpoint(f"{index} is damaged (it places an item with {type(item).__name__})")
        name = str(item.relative_path)
        if Path(name).name != name or name in ("", ".", ".."):
            return [f"{index} (it names {name!r}, a file outside its folder)"]
        f = folder / name
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (item.offset, item.length)):
            raise DamagedCheckpoint(f"{index} is damaged (it places an item of {name} at {item.offset!r})")
        if not f.is_file() or f.stat().st_size < item.offset + item.length:
            raise DamagedCheckpoint(f"{f} is damaged (shorter than its index says, or missing)")

    # what torch reads as bytes: the entries its planner loads with torch.load(weights_only=False)
    byte_items = {fqn for fqn, what in described.items() if isinstance(what, BytesStorageMetadata)}
    bad = []

    class Opener:  # the one planner call FileSystemReader.read_data makes for a byte item, with its bytes
        def load_bytes(self, item, data) -> None:
            f = folder / str(storage[item.storage_index].relative_path)
            read = functools.partial(torch.load, data, map_location="cpu", weights_only=True)
            bad.extend(_plain_data(f, read, item.storage_index.fqn))

    size = torch.Size([0])
    plan = LoadPlan([ReadItem(LoadItemType.BYTE_IO, k, size, k, size, size) for k in storage if k.fqn in byte_items])
    reader = FileSystemReader(folder)
    reader.set_up_storage_reader(meta, is_coordinator=True)
    try:
        reader.read_data(plan, Opener()).wait()
    except DamagedCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001 - an unreadable file, an unknown transform, bytes it cannot undo
        raise DamagedCheckpoint(f"{folder} is damaged ({type(err).__name__}: {_first_line(err)})") from None
    return bad


# --- model files (best/, final/) -----------------------------------------------------------------


def model_card(recipe: str, recipe_file: str, model, data, transform, cfg) -> dict:
    """What model.json says: the recipe that built the model (predict and export rebuild it from there), its
    input, classes and normalisation, the run's config, and what it trained and validated on (``--eval-only``
    refuses data that changed since). ``recipe_sha256``: the recipe file's bytes, by which predict and export tell a
    repository's recipe from a copy of it named alike."""
    import dataclasses
    import hashlib

    return {
        "recipe": recipe,
        "recipe_file": recipe_file,
        "recipe_sha256": hashlib.sha256(Path(recipe_file).read_bytes()).hexdigest() if recipe_file else None,
        "model": plain_class(model).__name__,
        "input_shape": list(data.shape),
        "class_names": data.class_names,
        "mean": transform.mean,
        "std": transform.std,
        "config": dataclasses.asdict(cfg),
        "data": data_record(data),
        **({"preprocess": data.train.preprocess} if hasattr(data.train, "preprocess") else {}),
        # a timm or transformers model's own files (config.json, ...), written beside: not part of model.json
        LIBRARY_FILES: vision.library_files(model, transform.mean, transform.std, data.shape[-1], data.class_names),
    }


def whole_weights(accelerator, model: torch.nn.Module, copy: bool = False) -> dict:
    """The model's state_dict whole, on the main process's host ({} on the others): under FSDP2 gathered from every
    process's shards (every process must call this then; Accelerate's ``get_state_dict``), else the unwrapped model's
    own (a compiled model's keys and class). ``copy``: copied even where the tensors already live on the host, for a
    write that outlives training's next update."""
    if getattr(accelerator, "is_fsdp2", False):
        share_buffers(accelerator, model)  # the main process's BatchNorm statistics, as every process has them
        state = accelerator.get_state_dict(model)  # full tensors on the main process, offloaded to its host
        return {k: v.detach().contiguous() for k, v in state.items()} if accelerator.is_main_process else {}
    if not accelerator.is_main_process:
        return {}
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)
    return {k: v.detach().to("cpu", copy=copy).contiguous() for k, v in plain.state_dict().items()}


def save_model_dir(accelerator, model, out_dir: Path, card: dict) -> None:
    """model.safetensors + model.json (what predict/export/--eval-only need to rebuild the model). ``model``: the
    model (every process calls this: an FSDP2 model is gathered first) or its weights (``whole_weights``). Written
    by the main process to a temp folder and swapped in, so a crash leaves the previous copy intact."""
    state = model if isinstance(model, dict) else whole_weights(accelerator, model)
    if not accelerator.is_main_process:
        return
    from safetensors.torch import save_file

    own = dict(card.get(LIBRARY_FILES) or {})
    prefix = own.pop("weights_prefix", "")  # a transformers model's names, as from_pretrained reads them
    card = {k: v for k, v in card.items() if k != LIBRARY_FILES} | ({"weights_prefix": prefix} if prefix else {})
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k.removeprefix(prefix): v for k, v in state.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    follow_umask(tmp / WEIGHTS)
    _fsync_file(tmp / WEIGHTS)  # on disk before the folder takes the previous copy's place
    for name, text in own.items():  # config.json (timm's or transformers'), preprocessor_config.json
        _fsync_write(tmp / name, text)
    _fsync_write(tmp / MODEL_CARD, json.dumps(card, indent=2, sort_keys=True))
    _fsync_dir(tmp)
    swap_in(tmp, out_dir)


def restore_interrupted_swaps(run_dir: Path) -> list[str]:
    """A crash between the two renames of ``save_model_dir`` leaves best/ (or final/) missing and its previous
    copy as .old-best: put it back. Returns the folders restored."""
    restored = []
    for name in ("best", "final"):
        folder, old = Path(run_dir) / name, Path(run_dir) / f".old-{name}"
        if old.is_dir() and not folder.exists():
            os.replace(old, folder)
            restored.append(name)
    return restored


def find_model_dir(path: Path) -> Path:
    """Accept a model dir, or a run dir (prefers best/, then final/)."""
    path = Path(path)
    for cand in (path, path / "best", path / "final"):
        if (cand / WEIGHTS).is_file() and (cand / MODEL_CARD).is_file():
            return cand
    raise FileNotFoundError(
        f"{path} holds no model weights: expected {WEIGHTS} and {MODEL_CARD} in it or in its best/ or final/ "
        "folder. Pass a run directory of a finished run, or its best/ or final/ folder."
    )


def load_model_dir(path: Path):
    """Returns (state_dict, card) from a folder written by ``save_model_dir``."""
    model_dir = find_model_dir(path)
    card = json.loads((model_dir / MODEL_CARD).read_text())
    return read_weights(model_dir / WEIGHTS, card), card


def read_weights(file: Path, card: dict | None = None) -> dict:
    """A weights file under the recipe's model's names: those of a model folder whose model.json (``card``, read
    beside the file when not given) names a ``weights_prefix`` (a transformers model's, saved as from_pretrained reads
    them) get it back."""
    from safetensors.torch import load_file

    if card is None:
        beside = Path(file).with_name(MODEL_CARD)
        card = json.loads(beside.read_text()) if beside.is_file() else {}
    prefix = card.get("weights_prefix", "")
    return {f"{prefix}{k}": v for k, v in load_file(str(file)).items()}


def model_signature(model: torch.nn.Module) -> dict:
    """Names and shapes of every parameter and buffer: what must match to load a checkpoint."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}
