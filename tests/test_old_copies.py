"""A recipe copied from version 0.4 (before common/ was put in data/, train/ and tools/) stops at start with one
paragraph naming every import to change and where each name lives now; code of your own that imports a 0.4 path is
told the same at that import. Nothing that imports the current paths is stopped."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys

import pytest

from common import moved
from common.tools.copy_recipe import available_recipes, copy_recipe

from helpers import REPO, launch, recipe_env

# The import lines of the four recipes of version 0.4, as a copy made then holds them, and the lines of their loops
# that used a name that has since left common.vision.
OLD_IMPORTS = {
    "cifar_cnn": """from common.augment import BatchTransform, channel_stats
from common.config import CommonConfig, LRRule, knob, parse_config
from common.averaging import Lookahead
from common.metrics import evaluate
from common.models import CifarCNN, convert_sync_batchnorm, init_whitening, parse_ints
from common.optim import sgd_with_bias_groups
from common.run import TrainingRun
from common.schedule import build_scheduler
""",
    "finetune_folder": """from common import vision
from common.augment import BatchTransform
from common.averaging import EMA
from common.config import CommonConfig, LRRule, knob, parse_config
from common.console import say
from common.errors import ConfigError
from common.metrics import evaluate
from common.photos import load_photos, photo_stats
from common.run import TrainingRun
from common.schedule import build_scheduler


def build_optimizer(cfg, model, num_classes):
    return vision.param_groups(model, num_classes, cfg.lr, 0.1)
""",
    "mnist_convnet": """from common.augment import BatchTransform, channel_stats
from common.config import CommonConfig, LRRule, knob, parse_config
from common.metrics import evaluate
from common.models import ConvNet, LeanConvNet, convert_sync_batchnorm, parse_floats
from common.run import TrainingRun
from common.schedule import build_scheduler
from common.data import load_image_data, make_loader
import common.checkpoint as ckpt
""",
}


@pytest.mark.parametrize("recipe", sorted(OLD_IMPORTS))
def test_a_recipe_copied_from_0_4_stops_at_start_naming_every_new_path(tmp_path, recipe):
    copy = tmp_path / f"my_{recipe}.py"
    copy.write_text(
        '"""My copy."""\n\nimport accelerate_recipes  # noqa: F401\n'
        + OLD_IMPORTS[recipe]
        + '\nprint("the recipe ran")\n'
    )
    proc = subprocess.run(
        [sys.executable, str(copy), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the recipe ran" not in proc.stdout and lines[0].startswith(f"error: {copy} was written for version 0.4")
    expected = moved.old_imports(copy.read_text())
    assert len(expected) >= 6 and all(change in lines[0] for change in expected)
    # every moved line is named, each with its new home
    assert re.search(r"line \d+: common\.augment\.BatchTransform -> common\.data\.augment\.BatchTransform;", lines[0])
    assert "common.run.TrainingRun -> common.train.run.TrainingRun" in lines[0]
    assert "common.config.LRRule -> common.schedules.LRRule" in lines[0]
    assert "common.models" not in lines[0] and "common.errors" not in lines[0]  # not moved: not named
    if recipe == "finetune_folder":
        assert "common.vision.param_groups -> common.optimizers.param_groups" in lines[0]
        assert "common.photos.load_photos -> common.data.photo_sources.load_photos" in lines[0]
    if recipe == "mnist_convnet":
        assert "common.data.load_image_data -> common.data.decoded.load_image_data" in lines[0]
        assert "common.checkpoint -> common.train.checkpoint" in lines[0]


def test_the_copy_with_the_named_paths_runs(tmp_path):
    """Changing the lines the message names is all it takes: the same imports at their new places start."""
    copy = tmp_path / "my_recipe.py"
    copy.write_text(
        '"""My copy."""\n\nimport accelerate_recipes  # noqa: F401\n'
        "from common.data.augment import BatchTransform, channel_stats\n"
        "from common.config import CommonConfig, knob, parse_config\n"
        "from common.schedules import LRRule, build_scheduler\n"
        "from common.train.metrics import evaluate\n"
        "from common.models import ConvNet, LeanConvNet, convert_sync_batchnorm, parse_floats\n"
        "from common.train.run import TrainingRun\n"
        "from common.data.decoded import load_image_data, make_loader\n"
        "import common.train.checkpoint as ckpt\n"
        'print("the recipe ran")\n'
    )
    proc = subprocess.run([sys.executable, str(copy)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "the recipe ran" in proc.stdout, proc.stderr


def test_code_of_your_own_is_told_at_the_import():
    with pytest.raises(ModuleNotFoundError, match=r"common\.run -> common\.train\.run"):
        importlib.import_module("common.run")
    with pytest.raises(ImportError, match=r"common\.config\.LRRule -> common\.schedules\.LRRule"):
        exec("from common.config import LRRule", {})
    with pytest.raises(ImportError, match=r"common\.data\.make_loader -> common\.data\.decoded\.make_loader"):
        exec("from common.data import make_loader", {})
    with pytest.raises(ImportError, match=r"common\.vision\.batch_mix -> common\.data\.augment\.batch_mix"):
        exec("from common.vision import batch_mix", {})
    # the data folder's own modules, and names that never existed, are as before
    exec("from common.data import cache, folders", {})
    import common.config
    import common.vision

    assert not hasattr(common.vision, "no_such_name") and not hasattr(common.config, "no_such_name")


def test_every_new_place_exists_and_nothing_current_is_stopped(tmp_path):
    for old, new in moved.MODULES.items():
        importlib.import_module(new)
    for new in moved.NAMES.values():
        first, *attrs = new.split(".")
        obj = importlib.import_module(first)
        for attr in attrs:  # a module of a package, or a name in a module
            is_module = hasattr(obj, "__path__") and importlib.util.find_spec(f"{obj.__name__}.{attr}") is not None
            obj = importlib.import_module(f"{obj.__name__}.{attr}") if is_module else getattr(obj, attr)
    for recipe in available_recipes():  # the shipped recipes, and a copy of each, name the current paths only
        assert moved.old_imports((REPO / "recipes" / f"{recipe}.py").read_text()) == [], recipe
        copy = tmp_path / f"copy_of_{recipe}.py"
        copy_recipe(recipe, copy)
        assert moved.old_imports(copy.read_text()) == [], recipe
        assert "from common.train.run import TrainingRun" in copy.read_text()


def test_through_the_launcher_on_two_processes_it_is_said_once(tmp_path):
    """Every rank stops at start; only the first says why (the launcher then reports its failed children)."""
    copy = tmp_path / "my_cifar_cnn.py"
    copy.write_text('"""My copy."""\n\nimport accelerate_recipes  # noqa: F401\n' + OLD_IMPORTS["cifar_cnn"])
    proc = launch(copy, [], recipe_env(tmp_path), nproc=2)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(said) == 1 and "common.run.TrainingRun -> common.train.run" in said[0]
    assert "exitcode  : 2" in proc.stderr  # both ranks stopped with the bad-input code


def test_a_guarded_fallback_runs_and_a_typo_is_not_called_moved(tmp_path):
    """Before, a script that tries the new path and falls back to 0.4's under `except ImportError` was stopped at
    start as written for 0.4, and a misspelt name from common.data was said to have moved to common.data.decoded.
    Now the guarded imports run (the fallback is never needed), and a typo gets Python's own ImportError."""
    script = tmp_path / "mine.py"
    script.write_text(
        "import accelerate_recipes  # noqa\n"
        "try:\n"
        "    from common.train.run import TrainingRun\n"
        "except ImportError:  # version 0.4\n"
        "    from common.run import TrainingRun\n"
        "try:\n"
        "    from common.run import TrainingRun as Old\n"
        "except (ModuleNotFoundError, AttributeError):\n"
        "    Old = None\n"
        'print("ran", TrainingRun.__name__, Old)\n'
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ran TrainingRun None" in proc.stdout, proc.stderr
    assert moved.old_imports("from common.data import load_image_dta\nfrom common.run import TrainingRn\n") == []
    with pytest.raises(ImportError) as raised:
        exec("from common.data import load_image_dta", {})
    assert "moved" not in str(raised.value) and "decoded" not in str(raised.value)
    # a real 0.4 name is still named where it went
    assert moved.old_imports("from common.data import load_image_data\n") == [
        "line 1: common.data.load_image_data -> common.data.decoded.load_image_data"
    ]
