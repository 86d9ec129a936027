"""Start a new recipe from an existing one.

    python -m common.tools.copy_recipe cifar_cnn my_recipe.py
    python -m common.tools.copy_recipe mnist_convnet recipes/my_digits.py

Copies ``recipes/<name>.py`` to the destination (never over an existing file), sets its
``RECIPE = "..."`` line to the new file's stem (runs then go to ``runs/<stem>-<time>``, and
model.json records the new name), points the usage lines of its docstring at the new file, and
prints the next steps. A recipe finds the ``common`` package by walking up the parent folders of
the script, so place the copy in the repository (its root or recipes/), or set PYTHONPATH to the
repository root.

Exit codes: 0 ok, 2 bad input (unknown recipe, destination exists, bad name).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from common.errors import EXIT_BAD_INPUT, RecipeError

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
RECIPE_LINE = re.compile(r'^RECIPE = "([^"\n]*)"[ \t]*$', re.MULTILINE)
STEM_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")



def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))


def finds_common(path: Path) -> bool:
    """Whether the recipe's own search (parents of the script holding common/__init__.py) succeeds."""
    return any((parent / "common" / "__init__.py").is_file() for parent in path.resolve().parents)


def rewrite(text: str, source_name: str, new_stem: str, new_display: str) -> str:
    """Set the RECIPE line to ``new_stem`` and point ``recipes/<source>.py`` mentions at the copy."""
    matches = RECIPE_LINE.findall(text)
    if len(matches) != 1:
        raise RecipeError(f"recipes/{source_name}.py has {len(matches)} lines of the form RECIPE = \"...\" "
                        "(expected exactly one), so it cannot be renamed safely. Copy it by hand and edit RECIPE.")
    text = RECIPE_LINE.sub(f'RECIPE = "{new_stem}"', text)
    return text.replace(f"recipes/{source_name}.py", new_display)


def copy_recipe(source: str, dest) -> Path:
    """Copy recipe ``source`` (a name such as cifar_cnn) to ``dest``; returns the new file's path."""
    name = Path(source).name
    name = name[:-3] if name.endswith(".py") else name
    src = RECIPES_DIR / f"{name}.py"
    if not src.is_file():
        raise RecipeError(f"There is no recipe {source!r} in {RECIPES_DIR}. Available: "
                        f"{', '.join(available_recipes()) or 'none'}.")
    dest = Path(dest).expanduser()
    if dest.is_dir():
        raise RecipeError(f"The destination {dest} is a folder. Pass the new file's path, e.g. {dest / 'my_recipe.py'}.")
    if dest.suffix != ".py":
        raise RecipeError(f"The destination {dest} does not end in .py. Pass a Python file name such as my_recipe.py.")
    if not STEM_OK.match(dest.stem):
        raise RecipeError(f"The file name {dest.name!r} is not usable as a recipe name (it names the run folders): "
                        "use letters, digits, '_', '-' and '.', e.g. my_recipe.py.")
    if dest.exists():
        raise RecipeError(f"{dest} already exists; nothing was overwritten. Pass a new file name, or delete or "
                        "rename the existing file first.")
    if not dest.parent.is_dir():
        raise RecipeError(f"The folder {dest.parent} does not exist. Create it first or pass a path in an existing folder.")
    try:  # docstring usage lines run from the repository root
        display = dest.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        display = str(dest)
    text = rewrite(src.read_text(), name, dest.stem, display)
    try:
        with open(dest, "x") as f:  # "x": fails rather than overwrite a file created meanwhile
            f.write(text)
    except FileExistsError:
        raise RecipeError(f"{dest} already exists; nothing was overwritten. Pass a new file name.") from None
    except OSError as err:
        raise RecipeError(f"Could not write {dest}: {err.strerror or err}. Pass a path in a writable folder.") from None
    shutil.copymode(src, dest)
    return dest


def next_steps(source: str, dest: Path) -> str:
    lines = [f"created {dest} from recipes/{source}.py with RECIPE = \"{dest.stem}\" "
             f"(its runs go to runs/{dest.stem}-<time>/ unless you pass --output-dir).",
             "next steps:",
             f"  1. edit the Config defaults in {dest} (dataset, epochs, batch_size, lr, model sizes, ...);",
             f"  2. python {dest} --help   lists every knob;",
             f"  3. accelerate launch {dest} --dataset /path/to/image_folder   "
             "(one sub-folder per class, optionally under train/ validation/ test/);",
             "  4. python -m common.tools.predict runs/<run> image.png   classifies images with the trained model."]
    if not finds_common(dest):
        lines.append(f"note: {dest} is outside this repository, so it will not find the common package by itself. "
                     f"Move it into {REPO_ROOT} (or its recipes/ folder), or run it with PYTHONPATH={REPO_ROOT}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.tools.copy_recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help=f"recipe to copy ({', '.join(available_recipes())})")
    parser.add_argument("dest", help="path of the new recipe file, e.g. my_recipe.py")
    args = parser.parse_args(argv)
    try:
        dest = copy_recipe(args.recipe, args.dest)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    name = Path(args.recipe).name
    print(next_steps(name[:-3] if name.endswith(".py") else name, dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
