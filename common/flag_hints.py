"""A flag a recipe does not have, answered with the recipe's closest flags by spelling (``difflib``) and, for a knob
of another recipe, that recipe's name; a flag of another script (torchvision's reference script, Hugging Face's
Trainer, Accelerate's examples) with its name here, read from docs/flags.md's tables."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

OTHER_SCRIPTS = (
    "flags of torchvision's train.py, Hugging Face's Trainer and Accelerate's examples, and their names here: "
    "docs/flags.md"
)


def recipe_flags(shared: set[str]) -> dict[str, list[str]]:
    """Flags of this repository's recipes that not every recipe has (not in ``shared``, the flags every recipe
    has), and which recipes have them, read from the recipes' source (parsed, never run)."""
    found: dict[str, list[str]] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                for item in node.body:
                    if (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and "ClassVar" not in ast.unparse(item.annotation)  # a ClassVar: not a field, not a flag
                    ):
                        found.setdefault("--" + item.target.id.replace("_", "-"), []).append(path.stem)
    return {flag: names for flag, names in found.items() if flag not in shared}


def unknown_flags(message: str) -> list[str]:
    """The flags in argparse's "unrecognized arguments: ..." (``--name=value`` and ``-j4`` cut to the flag)."""
    words = message.split(":", 1)[1].split()
    return [w.split("=")[0] if w.startswith("--") else w[:2] for w in words if re.match(r"--?[A-Za-z]", w)]


FLAGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def other_scripts_flags() -> dict[str, tuple[str, str]]:
    """docs/flags.md's tables as data: {a flag of another script: (that script, its name here)}, from rows
    ``| `--flag` | here |`` under each ``## script`` heading. Empty when the page is not there (a copy of the library
    without its docs)."""
    found: dict[str, tuple[str, str]] = {}
    try:
        lines = FLAGS_PAGE.read_text().splitlines()
    except OSError:
        return found
    script = ""
    for line in lines:
        if line.startswith("## "):
            script = line[3:].split(" (")[0].strip()
        row = re.fullmatch(r"\|\s*`(-[^`]+)`\s*\|\s*(.+?)\s*\|", line)
        if row and script:
            found.setdefault(row.group(1), (script, row.group(2).replace("`", "")))
    return found


def hint(message: str, known: set[str], shared: set[str]) -> str:
    """What to add to argparse's "unrecognized arguments" ``message`` for a parser whose flags are ``known``;
    ``shared``: the flags every recipe has."""
    technique = recipe_flags(shared)
    flags = sorted(f for f in known if f.startswith("--") and not f.startswith(("--no-", "--no_")) and "_" not in f)
    answers, others = [], other_scripts_flags()
    for flag in unknown_flags(message):
        kebab = flag.replace("_", "-")
        if flag in others:  # another script's spelling: this repository's name for it
            script, here = others[flag]
            ours = re.match(r"--[a-z-]+", here)
            elsewhere = technique.get(ours.group(0)) if ours and ours.group(0) not in known else None
            mine = f" (a knob of {' and '.join(elsewhere)})" if elsewhere else ""
            answers.append(f"{flag} is {script}'s flag; here: {here}{mine}")
            continue
        if kebab in technique:
            answers.append(f"{flag} is a knob of {' and '.join(technique[kebab])}, not of this recipe")
            continue
        close = difflib.get_close_matches(kebab, flags, n=3, cutoff=0.75)
        if close:
            answers.append(f"{flag}: did you mean {' or '.join(close)}?")
    from_table = all(flag in others for flag in unknown_flags(message))  # each named: no page to point at
    return "; " + "; ".join([*answers, *([] if from_table else [OTHER_SCRIPTS])])
