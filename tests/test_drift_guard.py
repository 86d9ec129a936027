"""Drift guard: the three recipes share one skeleton, so a fix made in one recipe must be made in all three.

Checked three ways: the source from the resume section to the end is identical (model name aside) and the
recipes import the same shared helpers; every shared knob is on each command line; and a tiny run of each
recipe leaves the same run-directory layout, checkpoint contents and TensorBoard tags."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, check_ok, launch, recipe_env

sys.path.insert(0, str(REPO))
from common.config import CommonConfig  # noqa: E402

RECIPES = ["fashion_mnist_mlp", "mnist_convnet", "cifar_cnn"]
SHARED_FROM = "    # --- checkpoint: resume ---\n"
SHARED_MODULES = ("common.runtime", "common.lifecycle", "common.ema")
SMALL = {"fashion_mnist_mlp": ["--hidden", "16"], "mnist_convnet": ["--width", "4"],
         "cifar_cnn": ["--widths", "4,8,8"]}


def source(recipe: str) -> str:
    return (REPO / "recipes" / f"{recipe}.py").read_text()


def shared_tail(recipe: str) -> list[str]:
    """The recipe from the resume section to the end, with the model name on the run-dir line normalised."""
    text = source(recipe)
    assert text.count(SHARED_FROM) == 1, f"recipes/{recipe}.py must have exactly one line {SHARED_FROM.strip()!r}"
    tail = text[text.index(SHARED_FROM):].splitlines(keepends=True)
    return [re.sub(r"model: \w+ ", "model: <MODEL> ", line) if 'say(f"run dir: ' in line else line for line in tail]


def test_shared_tail_is_identical():
    reference = RECIPES[0]
    diffs = []
    for other in RECIPES[1:]:
        diff = "".join(difflib.unified_diff(shared_tail(reference), shared_tail(other),
                                            fromfile=f"recipes/{reference}.py", tofile=f"recipes/{other}.py"))
        if diff:
            diffs.append(diff)
    assert not diffs, ("The recipes' shared part (from '# --- checkpoint: resume ---' to the end) has drifted; "
                       "make the same change in every recipe:\n" + "\n".join(diffs))


def common_imports(recipe: str) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {m: set() for m in SHARED_MODULES}
    for node in ast.walk(ast.parse(source(recipe))):
        if isinstance(node, ast.ImportFrom) and node.module in names:
            names[node.module] |= {alias.name for alias in node.names}
    return names


def test_same_shared_imports():
    imports = {r: common_imports(r) for r in RECIPES}
    reference = RECIPES[0]
    problems = []
    for module in SHARED_MODULES:
        assert imports[reference][module], f"recipes/{reference}.py imports nothing from {module}"
        for other in RECIPES[1:]:
            a, b = imports[reference][module], imports[other][module]
            if a != b:
                problems.append(f"from {module}: only recipes/{reference}.py imports {sorted(a - b)}, "
                                f"only recipes/{other}.py imports {sorted(b - a)}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def help_texts():
    procs = {recipe: subprocess.Popen([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), "--help"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for recipe in RECIPES}  # started together: each one is mostly importing torch
    out = {}
    for recipe, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"recipes/{recipe}.py --help failed:\n{stderr}"
        out[recipe] = stdout
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_every_common_knob(recipe, help_texts):
    flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(CommonConfig)]
    assert len(flags) > 30
    missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_texts[recipe])]
    assert not missing, f"recipes/{recipe}.py --help lacks the common knobs {missing}"


# --- runtime layout -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory, mnist_like, cifar_like):
    """One tiny 1-process run per recipe; the same shared knobs for all (EMA on everywhere, since its
    state is part of the checkpoint)."""
    root = tmp_path_factory.mktemp("drift")
    env = recipe_env(root)

    def run(recipe):
        data = cifar_like if recipe == "cifar_cnn" else mnist_like
        check_ok(launch(recipe, ["--dataset", data, "--epochs", 1, "--max-steps", 3, "--batch-size", 32,
                                 "--log-every", 1, "--ema-decay", 0.9, "--output-dir", root / recipe,
                                 *SMALL[recipe]], env))
        return root / recipe

    with ThreadPoolExecutor(len(RECIPES)) as pool:  # mostly start-up time: overlap the three
        return dict(zip(RECIPES, pool.map(run, RECIPES)))


def tb_tags(run: Path) -> dict[str, set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {p.parent for p in run.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    per_class = lambda tag: re.sub(r"/accuracy_class/.+$", "/accuracy_class/<class>", tag)
    return {kind: {per_class(t) for t in acc.Tags()[kind]} for kind in ("scalars", "images")}


def layout(run: Path) -> dict:
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    assert checkpoints, f"{run} has no checkpoints/step-*"
    return {
        "run dir entries": sorted(p.name for p in run.iterdir()),
        "newest checkpoint files": sorted(p.name for p in checkpoints[-1].iterdir()),
        "best/ files": sorted(p.name for p in (run / "best").iterdir()),
        "final/ files": sorted(p.name for p in (run / "final").iterdir()),
        "final/model.json keys": sorted(json.loads((run / "final" / "model.json").read_text())),
        "summary.json keys": sorted(json.loads((run / "summary.json").read_text())),
        "TensorBoard tags": {k: sorted(v) for k, v in tb_tags(run).items()},
    }


def test_same_runtime_layout(runs):
    layouts = {recipe: layout(run) for recipe, run in runs.items()}
    reference = RECIPES[0]
    ref = layouts[reference]
    assert "COMPLETE" in ref["newest checkpoint files"] and "trainer_state.json" in ref["newest checkpoint files"]
    assert {"train/loss", "eval/accuracy_class/<class>", "test/accuracy"} <= set(ref["TensorBoard tags"]["scalars"])
    problems = []
    for other in RECIPES[1:]:
        for what, value in layouts[other].items():
            if value != ref[what]:
                problems.append(f"{what}: recipes/{reference}.py gives {ref[what]}\n"
                                f"{' ' * len(what)}  recipes/{other}.py gives {value}")
    assert not problems, "The recipes' runs have drifted apart:\n" + "\n".join(problems)
