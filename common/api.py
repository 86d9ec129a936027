"""The names the recipes use: the library's public surface. A recipe, and a copy of one, imports from here; every
other module of common/ is internal and may change between versions (CHANGELOG.md says when, UPGRADING.md how to
follow). Each name's own docstring says what it does."""

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
    # the run: TrainingRun(cfg, RECIPE).execute(train) and the loop's calls; evaluation; watching a run's steps
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
