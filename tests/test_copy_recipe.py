"""common.copy_recipe: copy a recipe, rename its RECIPE, never overwrite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.copy_recipe import main  # noqa: E402


def recipe_names(text: str) -> list[str]:
    return re.findall(r'^RECIPE = "([^"]*)"', text, flags=re.MULTILINE)


def test_copy_rewrites_recipe_line(tmp_path, capsys):
    dest = tmp_path / "my_recipe.py"
    assert main(["cifar_cnn", str(dest)]) == 0
    text = dest.read_text()
    assert recipe_names(text) == ["my_recipe"]
    assert "recipes/cifar_cnn.py" not in text
    original = (REPO / "recipes" / "cifar_cnn.py").read_text()
    # nothing else changed but the RECIPE line and the usage lines that named the old file
    changed = [(a, b) for a, b in zip(original.splitlines(), text.splitlines()) if a != b]
    assert all("recipes/cifar_cnn.py" in a or a.startswith("RECIPE =") for a, _ in changed)
    assert len(original.splitlines()) == len(text.splitlines())
    out = capsys.readouterr().out
    assert "accelerate launch" in out and "--dataset /path/to/image_folder" in out
    assert "PYTHONPATH" in out  # tmp_path is outside the repository: the copy says how to find common


def test_copy_runs_help_from_outside_the_repo(tmp_path):
    dest = tmp_path / "digits.py"
    assert main(["mnist_convnet.py", str(dest)]) == 0
    proc = subprocess.run([sys.executable, str(dest), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "--dataset" in proc.stdout


def test_refuses_to_overwrite(tmp_path, capsys):
    dest = tmp_path / "mine.py"
    dest.write_text("# my own work\n")
    assert main(["cifar_cnn", str(dest)]) == 2
    err = capsys.readouterr().err
    assert str(dest) in err and "already exists" in err
    assert dest.read_text() == "# my own work\n"


def test_unknown_recipe_and_bad_destination(tmp_path, capsys):
    assert main(["no_such_recipe", str(tmp_path / "x.py")]) == 2
    err = capsys.readouterr().err
    assert "no_such_recipe" in err and "cifar_cnn" in err  # lists what is available
    assert main(["cifar_cnn", str(tmp_path)]) == 2  # a folder, not a file
    assert main(["cifar_cnn", str(tmp_path / "x.txt")]) == 2
    assert not any(tmp_path.iterdir())


def test_cli_exit_code(tmp_path):
    dest = tmp_path / "again.py"
    dest.write_text("")
    proc = subprocess.run([sys.executable, "-m", "common.copy_recipe", "fashion_mnist_mlp", str(dest)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
