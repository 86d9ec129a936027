"""Another revision of this repository beside the working tree, for the before/after studies
(``between_steps.py``): its library and recipes extracted with ``git archive``, and, in a
worker process of its own, that tree's ``common`` and a recipe of it imported (this module imports no ``common``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def extract(rev: str, dest: Path) -> Path:
    """``common``, ``recipes`` and (in revisions that have it) ``accelerate_recipes.py`` as they were at ``rev``."""
    dest.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "accelerate_recipes.py"], capture_output=True, text=True
    )
    paths = ["common", "recipes"] + listed.stdout.split()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, *paths],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def import_recipe_of(tree: Path, recipe: str):
    """``tree``'s recipe ``recipe`` as a module, with ``tree``'s ``common`` first on sys.path (a worker calls this
    before anything imports ``common``; it fails if another one was imported already)."""
    sys.path.insert(0, str(tree))
    import common

    assert Path(common.__file__).resolve().is_relative_to(Path(tree).resolve()), common.__file__
    spec = importlib.util.spec_from_file_location("bench_recipe", Path(tree) / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the Config class is made
    spec.loader.exec_module(module)
    return module
