"""common.tools.copy_recipe: copy a recipe anywhere, rename its RECIPE, never overwrite; the printed
next steps work exactly as printed from any folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from common.tools.copy_recipe import main

REPO = Path(__file__).resolve().parents[1]


def printed_commands(out: str) -> list[str]:
    """The command lines of the printed next steps (indented 7 spaces)."""
    return [line.strip() for line in out.splitlines() if line.startswith("       ") and line.strip()]


def users_shell_env(tmp_path: Path) -> dict:
    """A user's shell after README's install: the environment's python first on PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    return env


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
    # a copy outside the repository names the shipped launcher configs by absolute path
    configs = re.findall(r"--config_file (\S+)", text)
    assert configs and all(Path(c).is_absolute() and Path(c).is_file() for c in configs)
    assert len(original.splitlines()) == len(text.splitlines())
    out = capsys.readouterr().out
    assert "accelerate launch" in out and "--dataset /path/to/image_folder" in out
    assert "PYTHONPATH" not in out and "note:" not in out  # common is installed: nothing to set up


def test_copy_into_missing_folders_and_printed_commands_work_as_printed(tmp_path):
    """Copy into folders that do not exist yet (outside the repository, a space in a name), then run the
    printed commands exactly as printed, from a different folder than either."""
    dest = tmp_path / "new projects" / "digits" / "my_digits.py"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = users_shell_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "common.tools.copy_recipe", "mnist_convnet", str(dest)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert dest.is_file() and recipe_names(dest.read_text()) == ["my_digits"]
    commands = printed_commands(proc.stdout)
    help_cmd = next(c for c in commands if c.endswith(" --help"))
    launch_cmd = next(c for c in commands if c.startswith("accelerate launch "))
    predict_cmd = next(c for c in commands if "common.tools.predict" in c)
    assert str(dest) in launch_cmd and "--dataset" in launch_cmd

    other = tmp_path / "another cwd"
    other.mkdir()
    ran = subprocess.run(help_cmd, shell=True, cwd=other, env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, f"{help_cmd}\n{ran.stdout}\n{ran.stderr}"
    assert "--dataset" in ran.stdout and "--epochs" in ran.stdout
    # No run exists yet: the predict command is found and answers with its own bad-input error (exit 2).
    ran = subprocess.run(predict_cmd, shell=True, cwd=other, env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 2 and "does not exist" in ran.stderr, f"{predict_cmd}\n{ran.stdout}\n{ran.stderr}"


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
    proc = subprocess.run(
        [sys.executable, "-m", "common.tools.copy_recipe", "fashion_mnist_mlp", str(dest)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr


def test_parent_is_a_file_and_common_not_installed(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "taken"
    blocker.write_text("")
    assert main(["cifar_cnn", str(blocker / "my_recipe.py")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err

    import common.tools.copy_recipe as copy_recipe

    monkeypatch.setattr(copy_recipe, "common_installed", lambda: False)
    assert main(["cifar_cnn", str(tmp_path / "mine.py")]) == 0
    assert f"pip install -e {REPO}" in capsys.readouterr().out


def test_console_scripts_are_installed_beside_python_m(tmp_path):
    """`pip install -e .` (requirements.txt) puts recipes-predict, recipes-export and recipes-copy next to
    the interpreter; each is the same tool as `python -m common.tools.<name>`."""
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    for script in ("recipes-predict", "recipes-export", "recipes-copy"):
        assert (bin_dir / script).is_file(), (
            f"{script} is not installed: reinstall with pip install -r requirements.txt"
        )
    out = subprocess.run([str(bin_dir / "recipes-copy"), "--help"], capture_output=True, text=True, timeout=120)
    ref = subprocess.run(
        [sys.executable, "-m", "common.tools.copy_recipe", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == ref.returncode == 0
    assert out.stdout.split("\n", 1)[1] == ref.stdout.split("\n", 1)[1]  # all but the usage line's program name


def test_windows_gets_one_paragraph_instead_of_an_import_traceback():
    import subprocess
    import sys

    code = "import sys; sys.platform = 'win32'; import common"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "use WSL 2" in proc.stderr and "Traceback" not in proc.stderr


def test_a_package_of_your_own_named_common_is_named_instead_of_a_traceback(tmp_path, capsys):
    """A copy beside a folder `common/` of the user's: copy_recipe warns, and the copy stops at start with one
    paragraph naming both folders (Python would import the user's package as `common`); renamed, it runs."""
    work = tmp_path / "work"
    (work / "common").mkdir(parents=True)
    (work / "common" / "__init__.py").write_text("HELPERS = 1\n")
    assert main(["fashion_mnist_mlp", str(work / "mine.py")]) == 0
    assert f"warning: {work / 'common'} exists beside the copy" in capsys.readouterr().out
    env = users_shell_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(work / "mine.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [paragraph] = proc.stderr.strip().splitlines()
    assert str(work / "common") in paragraph and str(REPO / "common") in paragraph and "Rename" in paragraph
    (work / "common").rename(work / "my_common")
    proc = subprocess.run(
        [sys.executable, str(work / "mine.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--report-to" in proc.stdout, proc.stderr
