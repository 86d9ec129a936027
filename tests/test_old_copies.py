"""A recipe copied from version 0.4 (before common/ was put in data/, train/ and tools/). Since 0.6 nothing of ours
reads it at start or redirects its imports: it fails at its first old import with Python's own error, and
UPGRADING.md's commands turn its imports into ones that resolve. Nothing that imports the current paths is stopped."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys

import pytest
from test_upgrading import commands, tables

import common

from helpers import REPO

# The import lines of three recipes of version 0.4, as a copy made then holds them, and the lines of their loops
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


def test_a_copy_from_0_4_fails_at_its_first_old_import_with_pythons_own_error(tmp_path):
    copy = tmp_path / "my_mnist_convnet.py"
    copy.write_text(
        '"""My copy."""\n\nimport accelerate_recipes  # noqa: F401\n'
        + OLD_IMPORTS["mnist_convnet"]
        + '\nprint("the recipe ran")\n'
    )
    proc = subprocess.run(
        [sys.executable, str(copy), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "the recipe ran" not in proc.stdout, proc.stderr
    assert proc.stderr.rstrip().endswith("ModuleNotFoundError: No module named 'common.augment'"), proc.stderr


def test_no_redirect_of_0_4_is_left():
    """No import hook, no module __getattr__: an old path or name is Python's own error, the current ones work."""
    assert not any(type(f).__module__.startswith("common") for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'common\.run'$"):
        importlib.import_module("common.run")
    with pytest.raises(ImportError, match=r"^cannot import name 'LRRule' from 'common\.config'"):
        exec("from common.config import LRRule", {})
    with pytest.raises(ImportError, match=r"^cannot import name 'make_loader' from 'common\.data'"):
        exec("from common.data import make_loader", {})
    exec("from common.data import cache, folders", {})  # the data folder's own modules
    for name in ("common.config", "common.vision", "common.data", "common.data.decoded", "common.train.run"):
        importlib.import_module(name)
    found = [name for name, module in sys.modules.items() if name.split(".")[0] == "common" and module is not None]
    assert len(found) > 5 and [n for n in found if "__getattr__" in vars(sys.modules[n])] == []
    assert importlib.util.find_spec("common.moved") is None and list(common.__path__) == [str(REPO / "common")]


def test_the_copy_with_the_new_paths_runs(tmp_path):
    """Changing the lines UPGRADING.md names is all it takes: the same imports at their new places start."""
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


@pytest.mark.parametrize("recipe", sorted(OLD_IMPORTS))
def test_upgradings_commands_update_a_copy_from_0_4(tmp_path, recipe):
    """Steps 1-3 of UPGRADING.md's 'Updating a copy' on a real 0.4 copy: the first finds its old lines, the sed
    rewrites every module path to one that imports, and each name that does not import from its line is one the
    third command finds and the names table places."""
    find, rewrite, find_names = commands()
    _, names = tables()
    copy = tmp_path / "my_recipe.py"
    copy.write_text(OLD_IMPORTS[recipe])
    proc = subprocess.run(["bash", "-c", find], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "common.run import TrainingRun" in proc.stdout, proc.stdout + proc.stderr
    subprocess.run(["bash", "-c", rewrite.replace("my_recipe.py", copy.name)], cwd=tmp_path, check=True, timeout=60)
    proc = subprocess.run(["bash", "-c", find], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.stdout == "", proc.stdout  # nothing of 0.4's module paths is left
    proc = subprocess.run(
        ["bash", "-c", find_names.replace("my_recipe.py", copy.name)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    hits = dict(hit.split(":", 1) for hit in proc.stdout.splitlines())  # line number -> line (grep -n)
    left = []  # (line, name): a name that does not import from the line the sed left
    for node in ast.walk(ast.parse(copy.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                if not (hasattr(module, alias.name) or submodule):
                    left.append((node.lineno, alias.name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vision":
            if not hasattr(importlib.import_module("common.vision"), node.attr):
                left.append((node.lineno, node.attr))
    assert left, "each of these copies uses a name that left its module"
    for line, name in left:
        assert name in hits.get(str(line), ""), (line, name, proc.stdout)
        assert any(old.endswith(f".{name}") for old in names), name
    if recipe == "mnist_convnet":
        assert "from common.data.decoded import load_image_data, make_loader" in copy.read_text()
        assert "import common.train.checkpoint as ckpt" in copy.read_text()
