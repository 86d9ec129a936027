"""Where the modules and names of version 0.4 live since 0.5, which put ``common/`` in three folders (``data/``,
``train/``, ``tools/``). ``accelerate_recipes`` reads it when a recipe starts, and ``common/__init__`` installs an
import hook from it, so that code written for 0.4 (a recipe copied then, a script of your own) stops at its first
line that names an old place, saying where that name lives now, instead of failing halfway through a run."""

from __future__ import annotations

import ast
import importlib.abc
import os
import sys
from functools import cache
from pathlib import Path

MOVED_IN = "0.5.0"

MODULES = {  # a 0.4 module -> where its contents live now
    "common.optim": "common.optimizers",
    "common.schedule": "common.schedules",
    "common.sources": "common.data.sources",
    "common.folders": "common.data.folders",
    "common.pixels": "common.data.pixels",
    "common.cache": "common.data.cache",
    "common.scan_cache": "common.data.scan_cache",
    "common.splits": "common.data.splits",
    "common.data": "common.data.decoded",  # common.data is now the data folder; data.py became decoded.py
    "common.photos": "common.data.photos",
    "common.photo_check": "common.data.photo_check",
    "common.photo_tables": "common.data.photo_tables",
    "common.augment": "common.data.augment",
    "common.run": "common.train.run",
    "common.rundir": "common.train.rundir",
    "common.checkpoint": "common.train.checkpoint",
    "common.checkpointer": "common.train.checkpointer",
    "common.validation": "common.train.evaluator",
    "common.evalonly": "common.train.eval_only",
    "common.guard": "common.train.guard",
    "common.stopping": "common.train.stopping",
    "common.summary": "common.train.summary",
    "common.tracking": "common.train.tracking",
    "common.accelerator": "common.train.accelerator",
    "common.metrics": "common.train.metrics",
    "common.plots": "common.train.plots",
    "common.profiler": "common.train.profiler",
    "common.launching": "common.tools.launching",
    "common.machine": "common.tools.machine",
}

NAMES = {  # (0.4 module, name) -> where that name lives now, when not in MODULES' answer for its module
    ("common.config", "LRRule"): "common.schedules.LRRule",
    ("common.config", "follow_batch"): "common.schedules.LRRule.follow",
    ("common.config", "validate"): "common.config_checks.check",
    ("common.config", "validate_received"): "common.config_checks.check_received",
    ("common.config", "sanitize_for_hparams"): "common.train.tracking.sanitize_for_hparams",
    ("common.vision", "param_groups"): "common.optimizers.param_groups",
    ("common.vision", "batch_mix"): "common.data.augment.batch_mix",
    ("common.vision", "mixed"): "common.data.augment.mixed",
    ("common.photos", "load_photos"): "common.data.photo_sources.load_photos",
    ("common.photos", "node_shared"): "common.data.photo_sources.node_shared",
    ("common.photos", "open_rgb"): "common.data.pixels.open_rgb",
    ("common.photos", "read_rgb"): "common.data.pixels.read_rgb",
    ("common.accelerator", "per_process_batch"): "common.data.batches.per_process_batch",
    ("common.accelerator", "loader_batch"): "common.data.batches.loader_batch",
    ("common.folders", "image_endings"): "common.data.walk.image_endings",
    ("common.folders", "images_below"): "common.data.walk.images_below",
    ("common.folders", "TABLE_ENDINGS"): "common.data.folders.REPOSITORY_ENDINGS",
}

COMMON = Path(__file__).resolve().parent
DATA_FOLDER = COMMON / "data"


def new_place(module: str, name: str | None = None) -> str | None:
    """Where ``module`` (or ``name`` imported from it) of version 0.4 lives now; None when it has not moved. From
    ``common.data``, a name that is a module of the data folder has not moved; any other was data.py's."""
    if module == "common" and name is not None:
        return new_place(f"common.{name}")
    if name is not None and (module, name) in NAMES:
        return NAMES[module, name]
    if module == "common.data" and (name is None or (DATA_FOLDER / f"{name}.py").exists()):
        return None
    if module in MODULES:
        if name is None:
            return MODULES[module]
        # a name the new module does not define did not move there (a typo, or a name of the user's own): None, and
        # Python's own ImportError says so
        return f"{MODULES[module]}.{name}" if name in defined_names(MODULES[module]) else None
    return None


@cache
def defined_names(module: str) -> frozenset[str]:
    """The names a module of this library defines or imports at its top level, read from its source (nothing is
    imported)."""
    parts = module.split(".")[1:]
    path = COMMON.joinpath(*parts).with_suffix(".py")
    if not path.is_file():
        path = COMMON.joinpath(*parts, "__init__.py")
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def message(what: str, changes: list[str]) -> str:
    """One paragraph: ``what`` (a file, or an import) uses 0.4's places for ``changes`` ('old -> new' each)."""
    many = len(changes) > 1
    return (
        f"{what}: version {MOVED_IN} of this library put common/ in three folders (data/, train/, tools/), and "
        f"{'these names' if many else 'this name'} moved: {'; '.join(changes)}. Change "
        f"{'those imports' if many else 'the import'} and run it again (or copy the recipe afresh with "
        "`python -m common.tools.copy_recipe` and repeat your edits)."
    )


class OldPaths(importlib.abc.MetaPathFinder):
    """Refuses an import of a 0.4 module path that no longer exists, naming the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "common.data" or fullname not in MODULES:
            return None
        moved = [f"{old} -> {new}" for (m, old), new in NAMES.items() if m == fullname]
        changes = [f"{fullname} -> {MODULES[fullname]}"] + [f"{fullname}.{c}" for c in moved]
        raise ModuleNotFoundError(message(f"`{fullname}` is a module path of version 0.4", changes), name=fullname)


def install() -> None:
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())  # last: only a name no other finder knows reaches it


def getattr_hook(module: str):
    """A module ``__getattr__`` for a module that lost names in 0.5: those names raise ImportError naming their new
    place (``from common.config import LRRule``); any other is the usual AttributeError."""

    def __getattr__(name: str):
        new = new_place(module, name) if not name.startswith("__") else None
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        what = f"`from {module} import {name}` is an import of version 0.4"
        raise ImportError(message(what, [f"{module}.{name} -> {new}"]), name=module)

    return __getattr__


def old_imports(source: str) -> list[str]:
    """'line N: old -> new' for each place in Python ``source`` that imports a 0.4 path (``from common.run import
    TrainingRun``, ``import common.run``, ``from common import checkpoint``) or uses a name that left its module
    (``vision.param_groups`` after ``from common import vision``)."""
    tree = ast.parse(source)
    found, modules = [], {}  # modules: local name -> the common module it is (``from common import vision``)
    guarded = guarded_imports(tree)
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "common":
            for alias in node.names:
                new = new_place(node.module, alias.name)
                old = f"{node.module}.{alias.name}"
                if new is not None:
                    found.append((node.lineno, old, new))
                elif node.module == "common":
                    modules[alias.asname or alias.name] = old
        elif isinstance(node, ast.Import):
            for alias in node.names:
                new = new_place(alias.name) if alias.name.startswith("common.") else None
                if new is not None:
                    found.append((node.lineno, alias.name, new))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            new = new_place(modules[node.value.id], node.attr)
            if new is not None:
                found.append((node.lineno, f"{modules[node.value.id]}.{node.attr}", new))
    return [f"line {line}: {old} -> {new}" for line, old, new in sorted(set(found))]


IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def guarded_imports(tree) -> set[int]:
    """The imports inside a ``try`` that handles ImportError (its body or its handlers): a script that tries the new
    path and falls back to the old one, or the other way round, runs either way (the old path raises ImportError)."""
    guarded = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught.update("BaseException" if k is None else getattr(k, "id", getattr(k, "attr", "")) for k in kinds)
        if caught & IMPORT_ERRORS:
            for part in [*node.body, *node.handlers]:
                guarded.update(id(n) for n in ast.walk(part) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return guarded


def check_script(path: str) -> None:
    """Stop with one paragraph (exit 2) when the script at ``path`` (a recipe being started) imports 0.4's paths:
    every line to change, at once, before anything runs."""
    try:
        changes = old_imports(Path(path).read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return  # not a readable Python file: nothing to say
    if changes:
        if os.environ.get("RANK", "0") == "0":  # under a launcher every rank stops; the first one says why
            sys.stderr.write(f"error: {message(f'{path} was written for version 0.4', changes)}\n")
        raise SystemExit(2)
