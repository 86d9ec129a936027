"""The plan of common/ holds: imports go one way (ground floor, techniques, data/, train/, tools/), no cycles, each
module says its one job, no import of the project's own modules inside a function, and README's Layout table names
every module."""

from __future__ import annotations

import ast
import re

from helpers import REPO

COMMON = REPO / "common"
GROUND = {"errors", "console", "files", "config", "config_checks", "flag_hints"}
TECHNIQUES = {
    "models",
    "vision",
    "torchvision_weights",
    "timm_models",
    "hf_models",
    "optimizers",
    "schedules",
    "averaging",
}
FLOORS = {"data": 2, "train": 3, "tools": 4, "api": 5}  # api: the names recipes use, from every floor


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(COMMON.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text())
    return found


def floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 2 or parts[-1] in FLOORS:
        return FLOORS[parts[1]]
    if len(parts) == 1:
        return 0
    assert parts[1] in GROUND | TECHNIQUES, f"{module}: a module at the top of common/ that is on no floor"
    return 1 if parts[1] in TECHNIQUES else 0


def imported(module: str, node, known) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("common"):
        return []
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]


def test_imports_go_down_and_never_round():
    mods = modules()
    edges = {m: {t for node in tree.body for t in imported(m, node, mods)} - {m, "common"} for m, tree in mods.items()}
    packages = {f"common.{f}" for f in FLOORS}  # `from common.data import cache` names the module, not the package
    upward = [(m, t) for m, targets in edges.items() for t in targets - packages if floor(t) > floor(m)]
    assert upward == []
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in edges[m]:
            if state.get(t) == "open":
                cycles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, [*path, t])
        state[m] = "done"

    for m in edges:
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_import_of_the_projects_modules_inside_a_function():
    mods, inner = modules(), []
    for m, tree in mods.items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and imported(m, node, {"common", *mods}):
                        inner.append(f"{m}:{node.lineno}")
    assert inner == []


def test_every_module_says_its_one_job():
    """One job per module, said in its docstring (its length is the job's: no line cap)."""
    assert [m for m, tree in modules().items() if not ast.get_docstring(tree)] == []


def test_the_layout_page_names_every_module():
    table = (REPO / "docs" / "layout.md").read_text()
    missing = []
    for m in modules():
        parts = m.split(".")
        if parts[-1] in ("common", *FLOORS):
            continue
        if not re.search(rf"`{re.escape(parts[-1])}(\.py)?`", table):
            missing.append(m)
    assert missing == []


def test_recipes_use_only_the_public_names():
    """common.api's __all__ is the public surface: the recipes (which users copy) import from it alone, and
    every name it declares exists."""
    import common.api

    assert not [n for n in common.api.__all__ if not hasattr(common.api, n)]
    outside = []
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(recipe.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common"):
                if node.module != "common.api" or {a.name for a in node.names} - set(common.api.__all__):
                    outside.append(f"{recipe.name}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("common") for a in node.names):
                outside.append(f"{recipe.name}: import {', '.join(a.name for a in node.names)}")
    assert outside == []


def names_a_reader_learns(recipe) -> tuple[set[str], set[str]]:
    """The names of the library a reader of ``recipe`` meets: what it imports from common.api, and the ``run.*``
    members it uses (``run`` being the TrainingRun)."""
    tree = ast.parse(recipe.read_text())
    imported = {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "common.api" for a in n.names
    }
    members = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "run"
    }
    return imported, members


def test_the_loop_teaches_few_names_and_each_exists():
    """The loop's *how* stays small: mnist_convnet's common.api imports and run.* members together are at most 33
    (39 when main had three fixed calls and the loop end_epoch, updated and max_steps_reached; 32 before --patience's
    run.no_improvement joined the break lines); every recipe's loop
    uses the same run.* calls (the photo recipe adds ``resuming``), each one of TrainingRun's."""
    from common.train.run import TrainingRun

    imported, members = names_a_reader_learns(REPO / "recipes" / "mnist_convnet.py")
    assert len(imported) + len(members) <= 33, (sorted(imported), sorted(members))
    instance_only = {"accelerator", "exit_code"}  # set in the constructor
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        used = names_a_reader_learns(recipe)[1]
        assert used - {"resuming"} == members, (recipe.name, sorted(used ^ members))
        assert all(hasattr(TrainingRun, m) or m in instance_only for m in used), (recipe.name, sorted(used))
