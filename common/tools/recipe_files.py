"""A recipe file as a module: what predict and export rebuild a model from (model.json names the file), and what the
tests and benchmarks read a recipe's Config from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
_IMPORTED: dict[Path, object] = {}


def recipe_path(recipe) -> Path:
    """A recipe name (recipes/<name>.py) or a path to a recipe file."""
    path = Path(recipe)
    return (path if path.suffix == ".py" else RECIPES_DIR / f"{recipe}.py").resolve()


def import_recipe(recipe, prefix: str = "_recipe"):
    """The recipe file as a module, imported once per file (recipes run nothing at import)."""
    path = recipe_path(recipe)
    if path not in _IMPORTED:
        spec = importlib.util.spec_from_file_location(f"{prefix}_{len(_IMPORTED)}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the Config class is made
        spec.loader.exec_module(module)
        _IMPORTED[path] = module
    return _IMPORTED[path]
