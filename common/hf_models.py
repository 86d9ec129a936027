"""transformers' image classifiers (``AutoModelForImageClassification``) saved in a folder: ``save_pretrained``'s, or
a Hub repo downloaded with ``hf download REPO --local-dir DIR`` (config.json, model.safetensors and
preprocessor_config.json). Built from its config.json with the data's classes, wrapped to take images and return
logits as the recipes' models do, started from the folder's weights, with the normalisation and crop of its
preprocessor_config.json.

transformers is optional (``pip install 'accelerate-recipes[transformers]'``); a folder of a transformers model
without it is one paragraph. A folder is data: only architectures built into transformers are read, and code shipped
in a folder is never run. A folder that asks for its own code (config.json's ``auto_map``, or a ``model_type``
transformers lacks with .py files beside it) is refused in one paragraph by ``transformers_module``, which every read
of a folder goes through (--model, and predict, export and --eval-only rebuilding a run's model), before transformers
sees it; transformers is called with ``trust_remote_code=False`` besides, so it never runs such code nor asks whether
to (its prompt on stdin).
"""

from __future__ import annotations

import inspect
import json
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from common.errors import ConfigError


def transformers_module(folder: Path):
    """transformers, to read the model folder ``folder``: refused first, in one paragraph, when the folder asks to run
    code of its own (``refuse_own_code``) or transformers is not installed."""
    refuse_own_code(folder)
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(
            f"--model {folder} is a transformers model (its config.json has a model_type), and reading it needs the "
            f"transformers package, which is not importable ({err}). Install it with "
            "`pip install 'accelerate-recipes[transformers]'` (or `pip install transformers`), or pick a "
            "torchvision or timm --model."
        ) from None
    refuse_own_code(folder, known_types=transformers.CONFIG_MAPPING)
    return transformers


def config_json(folder: Path) -> dict:
    """The folder's config.json as a mapping ({} where unreadable: said where the folder is read)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def refuse_own_code(folder: Path, known_types=None) -> None:
    """One paragraph (ConfigError) for a folder whose model is defined by Python shipped in it: config.json's
    ``auto_map`` names classes of the folder's .py files (transformers would import them, after asking on stdin when
    the model_type is not its own), or, given the ``known_types`` of transformers (its CONFIG_MAPPING), the
    model_type is none of them and .py files lie beside it. Read as JSON only: nothing of the folder is imported.
    A model_type transformers lacks, with no code in sight, is a paragraph of its own (a model newer than it)."""
    config = config_json(folder)
    auto_map, model_type = config.get("auto_map"), config.get("model_type")
    unknown = known_types is not None and isinstance(model_type, str) and model_type not in known_types
    files = sorted(p.name for p in folder.glob("*.py") if p.is_file())
    if auto_map or (unknown and files):
        what = []
        if auto_map:
            entries = (
                ", ".join(f"{key}: {value}" for key, value in auto_map.items())
                if isinstance(auto_map, dict)
                else str(auto_map)
            )
            what.append(f"config.json's auto_map names {entries[:300]}{'...' if len(entries) > 300 else ''}")
        if unknown:
            what.append(f"its model_type {model_type!r} is not an architecture built into transformers")
        if files:
            what.append(f"the folder holds {', '.join(files[:8])}{', ...' if len(files) > 8 else ''}")
        raise ConfigError(
            f"The model folder {folder} asks to run custom code, Python shipped in the folder ({'; '.join(what)}), "
            "which transformers would import to build its model. The recipes never run a model folder's code (a "
            "folder is data; its code would run with your permissions in every process of the run), so the folder "
            "is refused. Use a model whose architecture is built into transformers (an AutoModelForImageClassification "
            "of its own, saved with save_pretrained from an environment you trust: its config.json then has a "
            "model_type transformers knows and no auto_map), or a torchvision or timm --model."
        )
    if unknown:
        raise ConfigError(
            f"The model folder {folder} holds a transformers model of model_type {model_type!r}, which is not an "
            "architecture built into the transformers installed here, and the recipes build only those (a model "
            "folder's own code is never run). If it is an architecture transformers added later, a transformers "
            "release that includes it reads this folder; otherwise use a model whose architecture is built into "
            "transformers (saved with save_pretrained), or a torchvision or timm --model."
        )


@contextmanager
def quiet(transformers):
    """transformers' per-load report and progress bar off (the recipe says what it loaded in one line)."""
    logging = transformers.utils.logging
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


class ImageClassifier(nn.Module):
    """A transformers image classifier as the recipes call a model: normalised images in, logits out. A vision
    transformer trained at another size than ``image_size`` interpolates its position embedding (transformers'
    ``interpolate_pos_encoding``); at its own size the forward is the model's, as export traces it."""

    def __init__(self, model: nn.Module, image_size: int | None):
        super().__init__()
        self.model = model
        own = getattr(model.config, "image_size", None)
        accepts = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
        self.extra = {"interpolate_pos_encoding": True} if accepts and image_size and own != image_size else {}

    def forward(self, images):
        return self.model(pixel_values=images, **self.extra).logits


def from_folder(folder: Path, auto: str, needs: str):
    """``transformers.<auto>.from_pretrained(folder)``, quietly, and never with the folder's code nor a question on
    stdin whether to run it (such a folder is refused before this); what it cannot read is one paragraph."""
    transformers = transformers_module(folder)
    try:
        with quiet(transformers):
            return getattr(transformers, auto).from_pretrained(str(folder), trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - a damaged file, a value this transformers refuses
        raise ConfigError(
            f"transformers {transformers.__version__} could not read {folder} with {auto} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). {needs}"
        ) from None


def config(folder: Path, num_classes: int | None = None):
    cfg = from_folder(folder, "AutoConfig", "Pass a folder that save_pretrained of an image classifier wrote, whole.")
    if num_classes is not None:
        cfg.num_labels = num_classes  # id2label/label2id follow
    return cfg


def build(folder: Path, num_classes: int, image_size: int | None, drop_path: float | None = None) -> nn.Module:
    transformers = transformers_module(folder)
    cfg = config(folder, num_classes)
    if drop_path is not None:
        if not hasattr(cfg, "drop_path_rate"):
            raise TypeError(f"a {cfg.model_type} model has no drop_path_rate")
        cfg.drop_path_rate = drop_path
    try:
        with quiet(transformers):
            model = transformers.AutoModelForImageClassification.from_config(cfg, trust_remote_code=False)
    except ValueError as err:
        raise ConfigError(
            f"{folder} holds a {cfg.model_type} model, which transformers has no image classifier for "
            f"({str(err).splitlines()[0]}). Pass a folder of an AutoModelForImageClassification model."
        ) from None
    return ImageClassifier(model, image_size)


def pretrained_state(folder: Path) -> dict:
    """The folder's weights with their own head, as ``from_pretrained`` reads them (older key names converted),
    under the wrapper's names."""
    needs = "It needs model.safetensors (or pytorch_model.bin) beside config.json."
    model = from_folder(folder, "AutoModelForImageClassification", needs)
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def named_as_wrapped(state: dict) -> dict:
    """A state_dict saved from the bare transformers model (``vit.…``, ``classifier.…``) under the wrapper's names."""
    return state if all(k.startswith("model.") for k in state) else {f"model.{k}": v for k, v in state.items()}


def preprocessing(folder: Path) -> tuple[list[float], list[float], int | None]:
    """Mean, std and crop side of the folder's image processor (``AutoImageProcessor``, its
    preprocessor_config.json); ImageNet's, and config.json's image_size, where the folder has none."""
    processor = None
    if (folder / "preprocessor_config.json").is_file():
        needs = "Pass a folder that save_pretrained wrote, or delete that file to normalise with ImageNet's statistics."
        processor = from_folder(folder, "AutoImageProcessor", needs)
    size = getattr(processor, "crop_size", None) or getattr(processor, "size", None) or {}
    side = size.get("height") or size.get("shortest_edge") or getattr(config(folder), "image_size", None)
    constants = transformers_module(folder).utils.constants  # ImageNet's mean and std, as transformers has them
    mean = getattr(processor, "image_mean", None) or constants.IMAGENET_DEFAULT_MEAN
    std = getattr(processor, "image_std", None) or constants.IMAGENET_DEFAULT_STD
    return list(map(float, mean)), list(map(float, std)), side if isinstance(side, int) else None
