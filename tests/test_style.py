"""Checks of the source text that ruff does not make, run from the pattern .pre-commit-config.yaml gives pre-commit,
so the hook and the suite cannot disagree."""

from __future__ import annotations

import re

import yaml

from helpers import REPO


def local_hook(name: str) -> dict:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return next(h for repo in config["repos"] if repo["repo"] == "local" for h in repo["hooks"] if h["id"] == name)


def python_files():
    skip = {".venv", ".git", "build", "gpu-data"}
    return [p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)]


def test_no_comment_after_a_lone_closing_bracket():
    """`)  # called when due` under a call explains a bracket: such comments go on the line they are about."""
    pattern = re.compile(local_hook("comment-after-lone-bracket")["entry"])
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in python_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_check_catches_what_it_is_for():
    pattern = re.compile(local_hook("comment-after-lone-bracket")["entry"])
    assert pattern.search("    )  # called when due; best/ and checkpoints follow")
    assert pattern.search("        ],  # augmentation")
    assert not pattern.search("    )  # fmt: skip")
    assert not pattern.search("    evaluate=lambda: validate(val_loader),  # called when due")
