"""Image classifiers for fine-tuning, by the --model that names them: torchvision's (a name it lists), timm's (a
registry name, ``timm/<name>.<tag>``, ``hf-hub:org/name``: ``common.timm_models``) or a folder holding a timm or
transformers model (config.json + weights: ``common.hf_models``). Each is built with the data's classes, started from
a weights file or its library's pretrained weights (``DEFAULT``), with their own preprocessing; ``head`` names the
classifier (``common.optimizers.param_groups`` lets the backbone learn at a lower rate). torchvision's names come
first: ``resnet50`` is torchvision's, ``timm/resnet50`` (or ``resnet50.a1_in1k``) timm's."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from common import hf_models, timm_models, torchvision_weights
from common.errors import ConfigError
from common.torchvision_weights import weights_entry

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # a Hub-layout folder's, in the order its libraries read


def model_names() -> list[str]:
    from torchvision import models

    return models.list_models(module=models)  # the classification models (not detection, video, ...)


MODEL_FORMS = (
    "--model takes a torchvision name (resnet18, resnet50, convnext_tiny, efficientnet_b0, vit_b_16, ...), a timm "
    "name (resnet50d, mobilenetv4_conv_small, resnet10t.c3_in1k or timm/resnet10t.c3_in1k with a pretrained tag; "
    "`python -c \"import timm; print(timm.list_models('resnet*'))\"` lists them), a timm model on the Hub "
    "(hf-hub:org/name), or a folder holding a timm or transformers model (config.json and model.safetensors)"
)


def check_name(name: str) -> str:
    """The library that builds --model ``name``: torchvision, timm or transformers. An unknown name is one paragraph
    with its closest names (before any weights are looked up for it)."""
    if name in model_names():
        return "torchvision"
    folder = model_folder(name)
    if folder is not None:
        return folder_family(folder)
    if timm_models.is_hub_name(name):
        return "timm"
    if not name.startswith("timm/") and importlib.util.find_spec("timm") is None:  # an extra: the name may be timm's
        close = difflib.get_close_matches(name, model_names(), n=5)
        raise ConfigError(
            f"--model {name!r} is not a torchvision classification model"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + ", and timm is not installed here: for a timm model, run `pip install -e '.[timm]'` in this repository "
            f"(or `pip install timm`). {MODEL_FORMS}."
        )
    if timm_models.registry_name(name) or name.startswith("timm/"):
        return "timm"
    close = timm_models.close_names(name, others=model_names())  # torchvision's and timm's, nearest first
    raise ConfigError(
        f"--model {name!r} is neither a torchvision classification model nor a timm model"
        + (f" (did you mean {', '.join(close)}?)" if close else "")
        + f". {MODEL_FORMS}."
    )


def model_folder(name: str) -> Path | None:
    """The folder --model names (``local-dir:DIR`` as timm spells it, or DIR), or None for a model's name."""
    path = Path(name.removeprefix("local-dir:")).expanduser()
    if path.is_dir():
        return path.absolute()
    hub = timm_models.is_hub_name(name) or name.startswith("timm/")
    if name.startswith(("local-dir:", "~", ".")) or (os.sep in name and not hub):
        raise ConfigError(
            f"--model {name}: no such folder. A model folder holds a timm or transformers model (config.json and "
            f"model.safetensors); a timm model on the Hub is hf-hub:{name.lstrip('./~')}; a transformers model on the "
            "Hub: download it as a folder (`hf download ORG/NAME --local-dir DIR`) and pass --model DIR."
        )
    return None


def folder_family(folder: Path) -> str:
    """timm's (config.json names an ``architecture``) or transformers' (a ``model_type``)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"--model {folder} holds no readable config.json ({type(err).__name__}): a model folder holds a timm or "
            "transformers model in the Hub's layout (config.json and model.safetensors). For a folder of weights "
            "only, name the architecture and the folder: --model resnet50d --weights DIR."
        ) from None
    if isinstance(config, dict) and "architecture" in config:
        return "timm"
    if isinstance(config, dict) and "model_type" in config:
        hf_models.transformers_module(folder)  # installed, and the folder brings no code: else one paragraph
        return "transformers"
    raise ConfigError(
        f'{folder / "config.json"} names neither a timm architecture ("architecture") nor a transformers '
        "model_type: --model takes a folder written by timm (save_for_hf) or transformers (save_pretrained)."
    )


def timm_name(name: str) -> str:
    return timm_models.timm_name(name, model_folder(name))


AUX_HEADS = ("aux1.", "aux2.", "AuxLogits.")  # googlenet's and inception_v3's auxiliary classifiers


def build(name: str, num_classes: int, image_size: int | None = None, drop_path: float | None = None) -> nn.Module:
    """``torchvision.models.get_model(name)`` from scratch, its classifier sized for ``num_classes``; ResNets with
    their residual branches' last BatchNorm at zero. googlenet and inception_v3 without their auxiliary classifiers
    (they return a tuple in training, which no loss takes; torchvision's reference script drops them too); a vision
    transformer built for ``image_size`` (its patch grid, and the position embedding, follow the image size).
    ``drop_path``: the residual branches' drop rate (stochastic depth: timm's ``drop_path_rate``, torchvision's
    ``stochastic_depth_prob``, a transformers config's ``drop_path_rate``); None keeps the model's own; a model
    without one is refused."""
    from torchvision import models

    family = check_name(name)
    if family in ("timm", "transformers"):
        try:
            if family == "timm":
                model = timm_models.build(timm_name(name), num_classes, image_size, drop_path, f"--model {name}")
            else:
                model = hf_models.build(model_folder(name), num_classes, image_size, drop_path)
        except TypeError as err:  # a model class without drop_path_rate
            if drop_path is None or "drop_path_rate" not in str(err):
                raise
            raise no_drop_path(name, f"{family}'s model has no drop_path_rate") from None
        return prepared_for_cpus_and_sharding(model)
    kwargs = {} if drop_path is None else {"stochastic_depth_prob": drop_path}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=True)
    if name.startswith("vit_") and image_size:
        patch = int(name.rsplit("_", 1)[1])
        if image_size % patch:
            raise ConfigError(
                f"--model {name} cuts each image into {patch}x{patch} patches, so --image-size must be "
                f"a multiple of {patch} (got {image_size}); pass e.g. --image-size "
                f"{max(patch, round(image_size / patch) * patch)}."
            )
        kwargs["image_size"] = image_size
    try:  # ResNets: each residual branch starts at zero, so the untrained network is shallow and stable (Goyal et
        # al. 2017); the large early losses of a from-scratch start are gone. Other families have no such switch.
        model = models.get_model(name, weights=None, num_classes=num_classes, zero_init_residual=True, **kwargs)
    except TypeError:
        try:
            model = models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
        except TypeError:
            if drop_path is None:
                raise
            raise no_drop_path(name, "torchvision's stochastic_depth_prob") from None
    return prepared_for_cpus_and_sharding(model)


def no_drop_path(name: str, what: str) -> ConfigError:
    return ConfigError(
        f"--drop-path: --model {name} takes no drop path ({what}). Among torchvision's models convnext_*, "
        "efficientnet_*, swin_* and maxvit_t take one; most of timm's do (convnext_tiny, vit_small_patch16_224, "
        "resnet50d, ...). Leave --drop-path out for this model."
    )


def check_regularisers(name: str, drop_path: float | None, layer_decay: float) -> None:
    """Before any data is read: --layer-decay needs a timm model (its layers are timm's ``group_matcher``'s), and a
    --drop-path a model that takes one (built on the meta device: no memory, no initialisation)."""
    family = check_name(name) if layer_decay else "timm"
    if family != "timm":
        raise ConfigError(
            f"--layer-decay needs a timm model (its layers as timm's group_matcher orders them); --model {name} is "
            f"{family}'s. Use a timm model (e.g. --model convnext_tiny.fb_in1k, vit_small_patch16_224), "
            "or --backbone-lr-scale for one lower rate below the head."
        )
    if drop_path is not None:
        with torch.device("meta"):
            build(name, 2, None, drop_path)


def prepared_for_cpus_and_sharding(model: nn.Module) -> nn.Module:
    return declare_blocks(guard_cpu_bf16_strided_convs(model))


class GuardedConv2d(nn.Conv2d):
    """A Conv2d that runs in fp32 on a 1x1 input under CPU autocast (``guard_cpu_bf16_strided_convs``: why)."""

    def forward(self, x):
        if x.device.type == "cpu" and x.shape[-2:] == (1, 1) and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float())
        return super().forward(x)


def guard_cpu_bf16_strided_convs(model: nn.Module) -> nn.Module:
    """Work around a CPU defect (torch 2.14's oneDNN path): under bf16 autocast, the weight gradient of a strided,
    padded Conv2d whose input is 1x1 is garbage in about one call of four (uninitialised memory; ResNet-18 below
    17 px reaches it in layer4, and the run's loss turns NaN). Such a convolution runs in fp32 instead: its input is
    a single pixel, so the cost is nothing; every other call is untouched. The class is swapped, not the instance's
    forward: a copy of the model (an EMA's) must compute with its own weights."""
    for conv in model.modules():
        if type(conv) is not nn.Conv2d or isinstance(conv.padding, str):  # "same"/"valid": no strided case here
            continue
        if max(conv.stride) > 1 and max(conv.padding) > 0:
            conv.__class__ = GuardedConv2d
    return model


def declare_blocks(model: nn.Module) -> nn.Module:
    """Declare the model's repeated block as FSDP's unit of sharding, the way transformers models declare theirs
    (``_no_split_modules``), where the model declares none: the class whose instances (two or more) hold the most
    parameters (ResNet's BasicBlock or Bottleneck, ViT's EncoderBlock, ConvNeXt's CNBlock). Under FSDP version 2 with
    Accelerate's transformer-based wrapping (`accelerate config`'s default) each block is then sharded on its own, so
    a process gathers one block's whole weights at a time, not the whole model's. Nothing else reads it."""
    if getattr(model, "_no_split_modules", None):
        return model
    held, count = Counter(), Counter()
    for module in model.modules():
        plain = isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or not next(module.children(), None)
        if module is model or plain:  # containers and single layers are not blocks
            continue
        name = type(module).__name__
        held[name] += sum(p.numel() for p in module.parameters())
        count[name] += 1
    blocks = [n for n, _ in held.most_common() if count[n] >= 2]  # most parameters first; ties in the model's order
    if blocks:
        model._no_split_modules = blocks[:1]
    return model


def head(model: nn.Module, num_classes: int) -> tuple[str, nn.Module]:
    """The classifier: the last Linear (or 1x1 Conv2d, SqueezeNet) with ``num_classes`` outputs."""
    found = None
    for name, module in model.named_modules():
        out = getattr(module, "out_features", None) or getattr(module, "out_channels", None)
        if isinstance(module, (nn.Linear, nn.Conv2d)) and out == num_classes:
            found = (name, module)
    if found is None:
        raise ConfigError(
            f"Could not find the classifier of {type(model).__name__} (a Linear layer with "
            f"{num_classes} outputs). Use a classification model."
        )
    return found


@dataclass
class Pretrained:
    """Where the starting weights come from and the preprocessing they were trained with."""

    spec: str  # '' (from scratch), DEFAULT or a weights enum name, or a file path
    mean: list[float] | None
    std: list[float] | None
    crop: int | None  # the weights' own crop size (224 for torchvision's ImageNet weights)


def resolve(name: str, spec: str) -> Pretrained:
    """The preprocessing of ``--weights`` for ``--model name``: torchvision's enum for DEFAULT or an enum value
    name; for a file, the model's DEFAULT entry (a file of torchvision's own weights, copied offline). timm's: the
    model's pretrained config; a transformers folder: its preprocessor_config.json. The name is checked even from
    scratch (a Hub repo's config.json fetched): an unknown or unreachable model fails at start."""
    from torchvision import models

    family = check_name(name)
    if family == "timm":  # the name checked even from scratch: a Hub repo's config.json read now
        timm_models.probe(timm_name(name), f"--model {name}")
    if not spec:
        return Pretrained("", None, None, None)
    if family != "torchvision":
        mean, std, crop = (
            timm_models.preprocessing(timm_name(name), f"--model {name}")
            if family == "timm"
            else hf_models.preprocessing(model_folder(name))
        )
        return Pretrained(spec, mean, std, crop)
    entry = weights_entry(name, spec)
    if entry is None:  # a file: torchvision's own for the model when it has one (copied offline), else ImageNet's
        try:
            entry = models.get_model_weights(name).DEFAULT
        except (ValueError, KeyError, AttributeError):
            return Pretrained(spec, IMAGENET_MEAN, IMAGENET_STD, None)
    t = entry.transforms()
    return Pretrained(spec, list(t.mean), list(t.std), int(t.crop_size[0]))


def fetch(name: str, spec: str) -> None:
    """Make ``--weights`` readable before anything else is read: torchvision's weights read through torch's hub
    cache (``common.torchvision_weights``), timm's DEFAULT through the Hugging Face cache (downloaded into either when
    missing), a model folder's own weights file, or the file named. An offline machine or a wrong path fails here, at
    start, instead of after the data is scanned."""
    family, folder = check_name(name), model_folder(name)
    entry = weights_entry(name, spec) if family == "torchvision" else None
    if spec == "DEFAULT" and folder is not None:
        weights_file(str(folder), f"--weights DEFAULT (the weights of the model folder {name})")
    elif spec == "DEFAULT" and family == "timm":
        timm_models.fetch(timm_name(name), f"--weights DEFAULT for --model {name}")
    elif entry is not None:
        torchvision_weights.state_dict(entry, load=False)
    else:
        weights_file(spec)


def weights_file(spec: str, what: str = "") -> Path:
    """--weights as a file: the file, or a folder's weights file (a Hub repo downloaded as a folder)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), path)
    if not path.is_file():
        raise ConfigError(
            f"{what or f'--weights {spec}'}: no such file{' in that folder' if path.is_dir() else ''}. Pass a "
            "state_dict file (.pth, .pt or .safetensors), a folder holding model.safetensors (or pytorch_model.bin), "
            "DEFAULT for the model's pretrained weights, or nothing to train from scratch."
        )
    return path


def _read_state(spec: str, name: str, image_size: int | None = None) -> dict:
    family, folder = check_name(name), model_folder(name)
    if spec == "DEFAULT" and folder is not None:
        fetch(name, spec)  # the folder holds a weights file: else one paragraph
    if family == "timm" and spec == "DEFAULT":  # loaded by timm: its filters, a ViT's grid resampled to image_size
        return timm_models.pretrained_state(timm_name(name), image_size, f"--weights DEFAULT for --model {name}")
    if family == "transformers" and (spec == "DEFAULT" or Path(spec).expanduser().is_dir()):
        return hf_models.pretrained_state(folder if spec == "DEFAULT" else Path(spec).expanduser())
    entry = weights_entry(name, spec) if family == "torchvision" else None
    if entry is not None:  # through torch's hub cache, checked
        return torchvision_weights.state_dict(entry)
    path = weights_file(spec)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:  # weights_only: a file someone sends you is data, never code
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(
            f"Could not read the weights file {path} ({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Pass a state_dict saved by torch.save (.pth/.pt) or safetensors (.safetensors), e.g. "
            "torchvision's own weight file for the model."
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):  # a training checkpoint that wraps the state_dict
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"{path} holds no state_dict (a mapping of names to tensors). Save one with "
            "torch.save(model.state_dict(), path)."
        )
    consume_prefix_in_state_dict_if_present(state, "module.")  # DDP-saved files prefix every key (torch's own fix)
    return hf_models.named_as_wrapped(state) if family == "transformers" else state


def load_pretrained(model: nn.Module, spec: str, name: str, num_classes: int, image_size: int | None = None) -> str:
    """Load ``--weights`` into ``model``; the head's tensors are skipped when their shape is another head's (the
    1000 ImageNet classes). Any other mismatch is refused. Returns a line saying what was loaded."""
    state = _read_state(spec, name, image_size)
    own = model.state_dict()
    head_name, _ = head(model, num_classes)
    aux = [k for k in state if k.startswith(AUX_HEADS) and k not in own]  # heads the model is built without
    skipped = sorted(k for k, v in state.items() if k in own and own[k].shape != v.shape)
    wrong = [k for k in skipped if not k.startswith(head_name + ".")]
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if k not in skipped and k not in aux}, strict=False
    )
    # BatchNorm's step counters: files saved before torch kept them (torchvision's older ImageNet weights among them)
    # lack them, and torch's own load_state_dict starts them at 0, as it does here
    missing = sorted(k for k in missing if k not in skipped and not k.endswith(".num_batches_tracked"))
    absent = [k for k in missing if k.startswith(head_name + ".")]
    if unexpected or wrong or len(absent) < len(missing):
        shown = (unexpected + wrong + missing)[:4]
        raise ConfigError(
            f"The weights in {spec} don't fit --model {name}: {len(missing)} of its tensors are "
            f"missing from the file, {len(unexpected)} in the file are not in the model, and "
            f"{len(wrong)} have another shape (e.g. {', '.join(shown)}). Pass weights of a {name} "
            "(torchvision's own file for it, or one saved from this model)."
        )
    shapes = ", ".join(f"{k} {tuple(state[k].shape)} -> {tuple(own[k].shape)}" for k in skipped)
    return (
        f"weights {spec}: {len(state) - len(skipped) - len(aux)} tensors loaded"
        + (f"; skipped the head of another shape ({shapes}), trained from scratch" if skipped else "")
        + (f"; the file holds no head ({', '.join(absent)}): it starts fresh" if absent else "")
        + (
            f"; left out the auxiliary classifiers ({len(aux)} tensors), which this model is built without"
            if aux
            else ""
        )
    )


EVAL_CROP = 0.875  # the evaluation crop: this share of the resized shorter side, for every family (torchvision's)


def library_files(model: nn.Module, mean, std, side: int, class_names) -> dict:
    """The files that make a run's best/ and final/ a folder the model's own library opens, beside its
    model.safetensors (``common.train.checkpoint.save_model_dir`` writes them): for a timm model timm's config.json
    (``timm.models._hub.save_config_for_hf``: architecture, classes, and a pretrained_cfg with the run's mean, std,
    input size and crop), which ``timm.create_model("local-dir:<folder>", pretrained=True)`` reads; for a transformers
    model its config.json with the classes as labels and a preprocessor_config.json (the run's resize, crop and
    normalisation), with ``weights_prefix``: the weights saved under the model's own names, as ``from_pretrained``
    reads them. {} for a torchvision model (docs/run-directory.md: how to open it)."""
    if isinstance(model, hf_models.ImageClassifier):
        import transformers

        config = model.model.config.to_dict()
        config["id2label"] = {str(i): name for i, name in enumerate(class_names)}
        config["label2id"] = {name: i for i, name in enumerate(class_names)}
        processor = transformers.BitImageProcessor(  # resize the shorter side, crop the centre, normalise
            size={"shortest_edge": round(side / EVAL_CROP)},
            crop_size={"height": side, "width": side},
            image_mean=list(mean),
            image_std=list(std),
        )
        return {
            "config.json": json.dumps(config, indent=2, sort_keys=True),
            "preprocessor_config.json": processor.to_json_string(),
            "weights_prefix": "model.",
        }
    if type(model).__module__.startswith("timm.") and hasattr(model, "pretrained_cfg"):
        import tempfile

        from timm.models._hub import save_config_for_hf

        data = {"input_size": (3, side, side), "mean": tuple(mean), "std": tuple(std), "crop_pct": EVAL_CROP}
        data["interpolation"] = "bilinear"
        with tempfile.TemporaryDirectory() as tmp:
            save_config_for_hf(model, f"{tmp}/config.json", {"label_names": list(class_names)}, data_config=data)
            return {"config.json": Path(tmp, "config.json").read_text()}
    return {}
