"""UPGRADING.md cannot go stale: every place its 0.4 -> 0.5 tables name as where a module or a name lives now
imports, every 0.4 module path it lists is gone, and its commands to find and rewrite a copy's imports flag nothing
in the shipped recipes or a fresh copy of them (applied to real 0.4 copies: test_old_copies.py)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import textwrap

import pytest

from common.tools.copy_recipe import available_recipes, copy_recipe

from helpers import REPO

DOC = REPO / "UPGRADING.md"
ROW = re.compile(r"^\| `([\w.]+)` \| `([\w.]+)`")
FILE_ROW = re.compile(r"^\| `([\w.]+)` \| `([\w/]+\.py)`", re.M)
MODULES_MOVED, NAMES_MOVED = 29, 17  # 0.4 -> 0.5 is history: the tables neither grow nor shrink


def section(title: str) -> str:
    return DOC.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def tables() -> tuple[dict[str, str], dict[str, str]]:
    """(0.4 module -> module now, 0.4 name -> where it lives now), from the two tables of 0.4 -> 0.5."""
    text = section("Upgrading from 0.4 to 0.5")
    modules = text.split("### Modules that moved", 1)[1].split("\n### ", 1)[0]
    names = text.split("### Names that left their module", 1)[1].split("\n### ", 1)[0]
    rows = lambda part: dict(m.groups() for line in part.splitlines() if (m := ROW.match(line)))  # noqa: E731
    return rows(modules), rows(names)


def commands() -> list[str]:
    """The shell blocks of 'Updating a copy', in order: find the 0.4 modules, rewrite them, find the moved names."""
    text = section("Upgrading from 0.4 to 0.5").split("### Updating a copy", 1)[1]
    return [textwrap.dedent(block) for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def resolve(path: str):
    """The object a dotted path names: the longest prefix that imports as a module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent that is not a package
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"UPGRADING.md: {path}: {obj.__name__} has no {attr}"
                obj = getattr(obj, attr)
            return obj
    raise AssertionError(f"UPGRADING.md: {path}: no such module")


def test_every_place_the_tables_name_exists():
    modules, names = tables()
    assert (len(modules), len(names)) == (MODULES_MOVED, NAMES_MOVED)
    left = dict(FILE_ROW.findall(section("Upgrading from 0.5 to 0.6")))  # 0.5 module -> its file in 0.6
    for old, new in modules.items():
        if new in left:  # left the package in 0.6: its file is where that section says
            assert (REPO / left[new]).is_file(), left[new]
            continue
        importlib.import_module(new)
        if old != "common.data":  # the data folder since 0.5; its 0.4 names are data.py's, now decoded.py's
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module(old)
    for old, new in names.items():
        resolve(new)
        old_module = old.rsplit(".", 1)[0]
        assert old_module in modules or importlib.util.find_spec(old_module), old  # a module of 0.4 that stayed


def test_the_commands_flag_nothing_current(tmp_path):
    find, rewrite, _ = commands()
    for recipe in available_recipes():
        (tmp_path / f"{recipe}.py").write_text((REPO / "recipes" / f"{recipe}.py").read_text())
        copy_recipe(recipe, tmp_path / f"copy_of_{recipe}.py")
    proc = subprocess.run(["bash", "-c", find], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr  # grep: no line matched
    # the rewrite leaves current code as it is
    before = {p: p.read_text() for p in tmp_path.glob("*.py")}
    for path in before:
        script = rewrite.replace("my_recipe.py", path.name)
        subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=60)
    assert {p: p.read_text() for p in before} == before
