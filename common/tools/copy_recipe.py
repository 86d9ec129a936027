"""Start a new recipe from an existing one.

    python -m common.tools.copy_recipe cifar_cnn my_recipe.py
    python -m common.tools.copy_recipe mnist_convnet ~/projects/digits/my_digits.py

Copies ``recipes/<name>.py`` to the destination (never over an existing file; missing parent
folders are created), sets its ``RECIPE = "..."`` line to the new file's stem (runs then go to
``runs/<stem>-<time>`` under the folder you launch from, and model.json records the new name),
points the usage lines of its docstring at the new file, and prints the next steps as commands that
work as printed from any folder (absolute paths). The copy may live anywhere: it imports the
installed ``common`` package (README's ``pip install -r requirements.txt`` installs this repository
with ``-e .``). When ``common`` is not installed, the printed steps say how to install it.

Exit codes: 0 ok, 2 bad input (unknown recipe, destination exists, bad name).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.errors import RecipeError, report

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
RECIPE_LINE = re.compile(r'^RECIPE = "([^"\n]*)"[ \t]*$', re.MULTILINE)
STEM_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
CONFIG_ARG = re.compile(r"--config_file accelerate_configs/([A-Za-z0-9_.-]+)")


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))


def common_installed() -> bool:
    """Whether a script outside this repository imports this repository's ``common`` (the editable
    install README asks for). Asked of a fresh interpreter in a neutral folder: here, the working
    directory could make it look importable."""
    probe = "import importlib.util as u; s = u.find_spec('common'); print(s.origin if s else '')"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", probe], cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return False
    origin = proc.stdout.strip()
    return bool(origin) and Path(origin).resolve() == (REPO_ROOT / "common" / "__init__.py").resolve()


def rewrite(text: str, source_name: str, new_stem: str, new_display: str, outside: bool = False) -> str:
    """Set the RECIPE line to ``new_stem`` and point ``recipes/<source>.py`` mentions at the copy; for a
    copy ``outside`` the repository, ``--config_file accelerate_configs/X`` becomes an absolute path."""
    matches = RECIPE_LINE.findall(text)
    if len(matches) != 1:
        raise RecipeError(
            f'recipes/{source_name}.py has {len(matches)} lines of the form RECIPE = "..." '
            "(expected exactly one), so it cannot be renamed safely. Copy it by hand and edit RECIPE."
        )
    text = RECIPE_LINE.sub(f'RECIPE = "{new_stem}"', text)
    if outside:
        text = CONFIG_ARG.sub(
            lambda m: "--config_file " + shlex.quote(str(REPO_ROOT / "accelerate_configs" / m[1])), text
        )
    return text.replace(f"recipes/{source_name}.py", new_display)


def copy_recipe(source: str, dest) -> Path:
    """Copy recipe ``source`` (a name such as cifar_cnn) to ``dest``; returns the new file's path."""
    name = Path(source).name
    name = name[:-3] if name.endswith(".py") else name
    src = RECIPES_DIR / f"{name}.py"
    if not src.is_file():
        raise RecipeError(
            f"There is no recipe {source!r} in {RECIPES_DIR}. Available: {', '.join(available_recipes()) or 'none'}."
        )
    dest = Path(dest).expanduser()
    if dest.is_dir():
        raise RecipeError(
            f"The destination {dest} is a folder. Pass the new file's path, e.g. {dest / 'my_recipe.py'}."
        )
    if dest.suffix != ".py":
        raise RecipeError(f"The destination {dest} does not end in .py. Pass a Python file name such as my_recipe.py.")
    if not STEM_OK.match(dest.stem):
        raise RecipeError(
            f"The file name {dest.name!r} is not usable as a recipe name (it names the run folders): "
            "use letters, digits, '_', '-' and '.', e.g. my_recipe.py."
        )
    if dest.exists():
        raise RecipeError(
            f"{dest} already exists; nothing was overwritten. Pass a new file name, or delete or "
            "rename the existing file first."
        )
    if dest.parent.exists() and not dest.parent.is_dir():
        raise RecipeError(
            f"{dest.parent} is a file, not a folder, so {dest.name} cannot be created in it. Pass a path in a folder."
        )
    try:  # docstring usage lines run from the repository root; a copy elsewhere gets absolute paths
        display, outside = dest.resolve().relative_to(REPO_ROOT).as_posix(), False
    except ValueError:
        display, outside = shlex.quote(str(dest.resolve())), True
    text = rewrite(src.read_text(), name, dest.stem, display, outside)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "x") as f:  # "x": fails rather than overwrite a file created meanwhile
            f.write(text)
    except FileExistsError:
        raise RecipeError(f"{dest} already exists; nothing was overwritten. Pass a new file name.") from None
    except OSError as err:
        raise RecipeError(f"Could not write {dest}: {err.strerror or err}. Pass a path in a writable folder.") from None
    shutil.copymode(src, dest)
    return dest


def next_steps(source: str, dest: Path) -> str:
    """What to do next, with commands that work exactly as printed from any folder."""
    script = shlex.quote(str(dest.resolve()))
    lines = [
        f'created {dest.resolve()} from recipes/{source}.py with RECIPE = "{dest.stem}".',
        "next steps (the commands work from any folder):",
        f"  1. edit the Config defaults in {script} (dataset, epochs, batch_size, lr, model sizes, ...)",
        "  2. list every knob:",
        f"       python {script} --help",
        "  3. train on your images (one sub-folder per class, optionally under train/ validation/ test/); the "
        f"run goes to runs/{dest.stem}-YYYYMMDD-HHMMSS/ under the current folder unless you pass --output-dir:",
        f"       accelerate launch {script} --dataset /path/to/image_folder",
        "  4. classify images with the trained model (from the folder you trained in, or give the run's full path):",
        "     (--recipe names the file that defines the model: predict and export import only the repository's "
        "own recipes unless told which file to trust)",
        f"       python -m common.tools.predict runs/{dest.stem}-YYYYMMDD-HHMMSS photo.png --recipe {script}",
    ]
    shadow = dest.parent / "common"
    if shadow.exists():
        lines.append(
            f"warning: {shadow.resolve()} exists beside the copy: Python would import it as `common` instead "
            f"of this repository's library, and the copy stops at start saying so. Rename that folder "
            "(e.g. my_common) or move the copy elsewhere."
        )
    if not common_installed():
        lines.append(
            f"note: the common package is not installed in this Python, so the commands above will not find "
            f"it. Run `pip install -e {shlex.quote(str(REPO_ROOT))}` (README's `pip install -r "
            "requirements.txt` does this)."
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.tools.copy_recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help=f"recipe to copy ({', '.join(available_recipes())})")
    parser.add_argument("dest", help="path of the new recipe file, e.g. my_recipe.py")
    args = parser.parse_args(argv)
    try:
        dest = copy_recipe(args.recipe, args.dest)
    except RecipeError as err:
        return report(err)
    name = Path(args.recipe).name
    print(next_steps(name[:-3] if name.endswith(".py") else name, dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
