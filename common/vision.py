"""torchvision's classification models for fine-tuning: built by name with the data's classes, started from a
weights file or torchvision's pretrained weights, with their own preprocessing; ``head`` names the classifier
(``common.optimizers.param_groups`` lets the backbone learn at a lower rate)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.console import say
from common.errors import ConfigError
from common.moved import getattr_hook

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def model_names() -> list[str]:
    from torchvision import models

    return models.list_models(module=models)  # the classification models (not detection, video, ...)


def check_name(name: str) -> None:
    """An unknown --model is said as such (before any weights are looked up for it)."""
    if name not in model_names():
        import difflib

        close = difflib.get_close_matches(name, model_names(), n=3)
        raise ConfigError(
            f"--model {name!r} is not a torchvision classification model"
            + (f" (did you mean {', '.join(close)}?)" if close else "")
            + ". Pick one of "
            f"{', '.join(model_names())} (e.g. resnet18, resnet50, convnext_tiny, efficientnet_b0, "
            "mobilenet_v3_large, vit_b_16)."
        )


AUX_HEADS = ("aux1.", "aux2.", "AuxLogits.")  # googlenet's and inception_v3's auxiliary classifiers


def build(name: str, num_classes: int, image_size: int | None = None) -> nn.Module:
    """``torchvision.models.get_model(name)`` from scratch, its classifier sized for ``num_classes``; ResNets with
    their residual branches' last BatchNorm at zero. googlenet and inception_v3 without their auxiliary classifiers
    (they return a tuple in training, which no loss takes; torchvision's reference script drops them too); a vision
    transformer built for ``image_size`` (its patch grid, and the position embedding, follow the image size)."""
    from torchvision import models

    check_name(name)
    kwargs = {}
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
        model = models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    return guard_cpu_bf16_strided_convs(model)


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
            f"{num_classes} outputs). Use a torchvision classification model."
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
    name; for a file, the model's DEFAULT entry (a file of torchvision's own weights, copied offline)."""
    from torchvision import models

    if not spec:
        return Pretrained("", None, None, None)
    check_name(name)
    entry = weights_entry(name, spec)
    if entry is None:  # a file: torchvision's own for the model when it has one (copied offline), else ImageNet's
        try:
            entry = models.get_model_weights(name).DEFAULT
        except (ValueError, KeyError, AttributeError):
            return Pretrained(spec, IMAGENET_MEAN, IMAGENET_STD, None)
    t = entry.transforms()
    return Pretrained(spec, list(t.mean), list(t.std), int(t.crop_size[0]))


WEIGHTS_FILE_ENDINGS = (".pth", ".pt", ".safetensors", ".bin", ".ckpt")
WEIGHTS_NAME = re.compile(r"^(?:(\w+)\.)?(\w+)$")  # torchvision's spellings: DEFAULT, IMAGENET1K_V1, X_Weights.MEMBER


def weights_entry(name: str, spec: str):
    """torchvision's weights entry that ``--weights`` names for ``--model name`` (``DEFAULT``, a member such as
    ``IMAGENET1K_V1``, or the enum's own spelling ``ResNet18_Weights.IMAGENET1K_V1`` as its docs and reference script
    write it), or None when ``spec`` is a file. Weights of another model, or no such member, are one paragraph."""
    from torchvision import models

    match = WEIGHTS_NAME.match(spec)
    if match is None or Path(spec).expanduser().is_file() or spec.lower().endswith(WEIGHTS_FILE_ENDINGS):
        return None
    prefix, member = match.groups()
    try:
        enum = models.get_model_weights(name)
    except (ValueError, KeyError):
        enum = None
    names = ", ".join(e.name for e in enum) if enum else "none"
    if enum is None or (prefix and prefix != enum.__name__) or (member != "DEFAULT" and member not in enum.__members__):
        whose = (
            f" (those are weights of another model: {name}'s are {enum.__name__})"
            if enum and prefix and prefix != enum.__name__
            else ""
        )
        raise ConfigError(
            f"--weights {spec!r} is neither a file (.pth, .pt or .safetensors) nor one of torchvision's "
            f"weights for {name}{whose}: {names}, or DEFAULT"
            f"{f' (also spelled {enum.__name__}.DEFAULT)' if enum else ''}."
        )
    return enum.DEFAULT if member == "DEFAULT" else enum[member]


def hub_file(entry) -> Path:
    """Where torch.hub keeps ``entry``'s download: torch.hub.get_dir()/checkpoints/<the URL's file name>."""
    from urllib.parse import urlparse

    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(entry.url).path).name


def check_cached(entry) -> None:
    """torch.hub checks a file's hash only when it downloads it; one already in its cache is loaded unchecked. Such a
    file is checked here against the sha256 prefix its name records (resnet18-f37072fd.pth) before it is taken for
    torchvision's weights. Hashing costs about a second per 500 MB."""
    path = hub_file(entry)
    prefix = _recorded_hash(path)
    if prefix is None or not path.is_file():
        return
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    found = digest.hexdigest()
    if not found.startswith(prefix):
        raise ConfigError(
            f"{path} is in torch's hub cache under the name of torchvision's {entry} weights, but its sha256 starts "
            f"{found[: len(prefix)]}, not {prefix} as the name records ({entry.url}): it is another file or a damaged "
            "copy, not those weights. Delete it (torchvision then downloads it again, checked), copy the right file "
            "there, or pass the file you meant with --weights /path/to/file.pth."
        )


def fetch_failed(entry, err: Exception) -> ConfigError:
    return ConfigError(
        f"torchvision could not fetch the {entry} weights ({type(err).__name__}: {err}); this machine is probably "
        f"offline. Download {entry.url} on a machine with network access, copy it here, and pass --weights "
        f"/path/to/{Path(entry.url).name} (or put it in {hub_file(entry).parent}/, where torchvision looks first)."
    )


def fetch(name: str, spec: str) -> None:
    """Make ``--weights`` readable before anything else is read: torchvision's weights downloaded into torch's hub
    cache (the download's hash checked by torch.hub) or the cached copy checked; a file must exist. An offline machine
    or a wrong path fails here, at start, instead of after the data is scanned."""
    entry = weights_entry(name, spec)
    if entry is None:
        if not Path(spec).expanduser().is_file():
            raise ConfigError(
                f"--weights {spec}: no such file. Pass a state_dict file (.pth, .pt or .safetensors), "
                "DEFAULT for torchvision's pretrained weights, or nothing to train from scratch."
            )
        return
    check_cached(entry)
    path = hub_file(entry)
    if path.is_file():
        return
    say(f"downloading {entry.url} to {path}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(entry.url, str(path), hash_prefix=_recorded_hash(path), progress=False)
    except Exception as err:  # noqa: BLE001 - urllib, socket and hash errors alike mean "no weights"
        raise fetch_failed(entry, err) from None


def _recorded_hash(path: Path) -> str | None:
    match = torch.hub.HASH_REGEX.search(path.name)
    return match.group(1) if match else None


def _read_state(spec: str, name: str) -> dict:
    fetch(name, spec)
    entry = weights_entry(name, spec)
    if entry is not None:  # in torch.hub.get_dir()/checkpoints now, checked
        return entry.get_state_dict(progress=False, check_hash=True)
    path = Path(spec).expanduser()
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
    return {k.removeprefix("module."): v for k, v in state.items()}  # DDP-saved files prefix every key


def load_pretrained(model: nn.Module, spec: str, name: str, num_classes: int) -> str:
    """Load ``--weights`` into ``model``; the head's tensors are skipped when their shape is another head's (the
    1000 ImageNet classes). Any other mismatch is refused. Returns a line saying what was loaded."""
    state = _read_state(spec, name)
    own = model.state_dict()
    head_name, _ = head(model, num_classes)
    head_keys = {k for k in own if k.startswith(head_name + ".")}
    aux = sorted(k for k in state if k.startswith(AUX_HEADS) and k not in own)  # heads the model is built without
    state = {k: v for k, v in state.items() if k not in aux}
    skipped = sorted(k for k, v in state.items() if k in own and own[k].shape != v.shape)
    unexpected = sorted(k for k in state if k not in own)
    # BatchNorm's step counters: files saved before torch kept them (torchvision's older ImageNet weights among them)
    # lack them, and torch's own load_state_dict starts them at 0, as it does here
    counters = {
        name + ".num_batches_tracked"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    }
    missing = sorted(k for k in own if k not in state and k not in counters)
    wrong = [k for k in skipped if k not in head_keys]
    if unexpected or wrong or set(missing) - head_keys:
        shown = (unexpected + wrong + missing)[:4]
        raise ConfigError(
            f"The weights in {spec} don't fit --model {name}: {len(missing)} of its tensors are "
            f"missing from the file, {len(unexpected)} in the file are not in the model, and "
            f"{len(wrong)} have another shape (e.g. {', '.join(shown)}). Pass weights of a {name} "
            "(torchvision's own file for it, or one saved from this model)."
        )
    model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    shapes = ", ".join(f"{k} {tuple(state[k].shape)} -> {tuple(own[k].shape)}" for k in skipped)
    absent = [k for k in missing if k in head_keys]
    return (
        f"weights {spec}: {len(state) - len(skipped)} tensors loaded"
        + (f"; skipped the head of another shape ({shapes}), trained from scratch" if skipped else "")
        + (f"; the file holds no head ({', '.join(absent)}): it starts fresh" if absent else "")
        + (
            f"; left out the auxiliary classifiers ({len(aux)} tensors), which this model is built without"
            if aux
            else ""
        )
    )


__getattr__ = getattr_hook(__name__)  # names that moved in 0.5 say where to
