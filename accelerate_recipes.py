"""Imported first by every recipe: makes sure that ``import common`` finds this repository's library.

A recipe copied into a folder that also holds a package of your own named ``common`` would otherwise import
yours (Python looks in the script's folder first) and fail later with a bare ModuleNotFoundError, or run
half of each. This module is installed beside ``common`` (``pip install -e .``) under a name nothing else
uses, so it is found either way and can name both folders.

Code written for version 0.4's module paths (a recipe copied then) fails at its first old import with Python's own
ModuleNotFoundError or ImportError; UPGRADING.md says where each name lives now and how to update a copy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

LIBRARY = (Path(__file__).resolve().parent / "common").resolve()


def imported_common() -> Path | None:
    """The folder ``import common`` loads (or loaded) in this process, None if there is none."""
    module = sys.modules.get("common")
    spec = getattr(module, "__spec__", None) if module is not None else importlib.util.find_spec("common")
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    if not locations and spec is not None and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    return Path(locations[0]).resolve() if locations else None


def check() -> None:
    found = imported_common()
    if found is not None and found != LIBRARY:
        sys.stderr.write(
            f"error: `import common` finds {found}, a package of your own, instead of this "
            f"repository's training library in {LIBRARY}. Python looks in the recipe's folder (and "
            "the current one) first, so a folder named `common` there hides the library. Rename your "
            "package (e.g. my_common), or move the recipe to a folder without one.\n"
        )
        raise SystemExit(2)


check()
