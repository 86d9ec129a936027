"""The names the recipes use: the library's public surface. A recipe, and a copy of one, imports from here; every
other module of common/ is internal and may change between versions (CHANGELOG.md says when). Each name's own
docstring says what it does."""

import sys
from pathlib import Path

# A folder named `common` of your own beside a recipe (or in the folder you launch from) is imported instead of this
# package, and with the editable install the library's modules would then load under it: half of each. Said first,
# before anything runs.
_found = sys.modules["common"]
if Path(getattr(_found, "__file__", None) or ".").resolve().parent != Path(__file__).resolve().parent:
    sys.stderr.write(
        f"error: `import common` found {list(getattr(_found, '__path__', ['?']))[0]}, a package of your own, instead "
        f"of this repository's training library in {Path(__file__).resolve().parent}. Python looks in the recipe's "
        "folder (and the current one) first, so a folder named `common` there hides the library. Rename your package "
        "(e.g. my_common), or move the recipe to a folder without one.\n"
    )
    raise SystemExit(2)

from common import vision
from common.averaging import EMA, Lookahead
from common.config import CommonConfig, knob, parse_config
from common.console import say
from common.data.augment import BatchTransform, batch_mix, channel_stats, mixed
from common.data.photo_sources import load_photos
from common.data.photos import photo_stats
from common.errors import ConfigError, RecipeError
from common.models import (
    MLP,
    CifarCNN,
    ConvNet,
    LeanConvNet,
    convert_sync_batchnorm,
    init_whitening,
    parse_floats,
    parse_ints,
)
from common.optimizers import param_groups, sgd_with_bias_groups
from common.schedules import LRRule, build_scheduler
from common.train.metrics import evaluate
from common.train.run import TrainingRun, watching

__all__ = [
    # the run: with TrainingRun(cfg, __file__) as run, its settings steps and the loop's calls; evaluation; watching
    "TrainingRun",
    "evaluate",
    "watching",
    # configuration: a recipe's Config (CommonConfig's fields and knob()s), its command line, its errors
    "CommonConfig",
    "knob",
    "parse_config",
    "ConfigError",
    "RecipeError",
    "say",
    # data: normalisation and augmentation on the device, per-channel statistics, MixUp/CutMix, photo folders
    "BatchTransform",
    "channel_stats",
    "batch_mix",
    "mixed",
    "load_photos",
    "photo_stats",
    # models and their optimisation
    "MLP",
    "ConvNet",
    "LeanConvNet",
    "CifarCNN",
    "vision",
    "convert_sync_batchnorm",
    "init_whitening",
    "parse_floats",
    "parse_ints",
    "param_groups",
    "sgd_with_bias_groups",
    "LRRule",
    "build_scheduler",
    "EMA",
    "Lookahead",
]
