"""timm's image models (PyTorch Image Models) by name, built by ``timm.create_model``: a registry name (``resnet50d``,
with a pretrained tag ``resnet10t.c3_in1k``, or as the Hub spells it ``timm/resnet10t.c3_in1k``), a Hub repo in timm's
layout (``hf-hub:org/name``, its config.json read by timm) or a folder in that layout (``local-dir:<folder>``). Their
pretrained weights (``--weights DEFAULT``) are loaded by timm itself (its checkpoint filters, a ViT's position grid
resampled to ``--image-size``), from the Hugging Face cache (no network when the files are there) or the Hub; their
normalisation and input size are ``timm.data.resolve_data_config``'s. What this adds: what timm cannot get (offline and
not in the cache, no such repository, no timm model there, a download URL offline) is one paragraph naming the cache.
NOTE: the evaluation crop is the recipe's (0.875, bilinear: torchvision's), not the model's ``crop_pct``.
"""

from __future__ import annotations

import difflib
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from common.errors import ConfigError

HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's spelling of a Hub repo (hf_hub: is its older one)


def timm_module():
    try:
        import timm
    except ImportError as err:
        raise ConfigError(
            f"timm models need the timm package, which is not importable ({err}). Run `pip install -e '.[timm]'` in "
            "this repository (or `pip install timm`), or pick a torchvision --model."
        ) from None
    return timm


def is_hub_name(name: str) -> bool:
    return name.startswith(HUB_PREFIXES)


def registry_name(name: str) -> str | None:
    """The name timm's registry knows ``--model name`` by (``timm/`` left off), or None when it names no timm
    architecture. A known architecture with a pretrained tag it lacks is one paragraph naming its tags."""
    bare = name.removeprefix("timm/")
    arch, dot, tag = bare.partition(".")
    if "/" in bare or ":" in bare or not arch or not timm_module().is_model(arch):
        return None
    if dot:
        tagged = timm_module().list_models(arch, pretrained=True)
        if bare not in tagged:
            raise ConfigError(
                f"--model {name!r}: timm's {arch} has no pretrained tag {tag!r}; its tags: "
                f"{', '.join(t.partition('.')[2] for t in tagged) or 'none (no pretrained weights)'} "
                f"(--model {tagged[0] if tagged else arch})."
            )
    return bare


def close_names(name: str, others=(), n: int = 5) -> list[str]:
    """The names nearest to ``name`` among timm's (with their pretrained tags when ``name`` has one) and ``others``."""
    bare = name.removeprefix("timm/")
    pool = list(dict.fromkeys([*others, *timm_module().list_models(pretrained="." in bare)]))
    prefix = "timm/" if name.startswith("timm/") else ""
    return [(prefix if m not in others else "") + m for m in difflib.get_close_matches(bare, pool, n=n)]


def timm_name(name: str, folder: Path | None = None) -> str:
    """What ``timm.create_model`` takes for --model ``name``: ``local-dir:<folder>`` for a model folder, the registry
    name, or ``hf-hub:<repo>`` (a Hub repo, and ``timm/<name>`` this timm's registry lacks)."""
    if folder is not None:
        return f"local-dir:{folder}"
    if is_hub_name(name):
        return "hf-hub:" + name.split(":", 1)[1]
    return registry_name(name) or f"hf-hub:{name}"


def create(model: str, what: str, **kwargs) -> nn.Module:
    """``timm.create_model(model, **kwargs)``: from the Hugging Face cache alone first (no network, nor its retries
    on a machine without one, when the files are there), then from the Hub; what it cannot build or load is one
    paragraph (``failed``), but for a model without ``drop_path_rate`` (a TypeError), which the caller says."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        if not constants.HF_HUB_OFFLINE:
            try:
                with hub_cache_only(constants):
                    return timm_module().create_model(model, **kwargs)
            except LocalEntryNotFoundError:  # a file the cache lacks: from the Hub
                pass
        return timm_module().create_model(model, **kwargs)
    except Exception as err:  # noqa: BLE001 - Hub, socket, file and config errors alike
        if isinstance(err, TypeError) and "drop_path_rate" in str(err):
            raise  # a model without one: the caller says so
        raise failed(model, what, err, kwargs.get("pretrained", False)) from None


@contextmanager
def hub_cache_only(constants):
    """huggingface_hub's offline mode (what HF_HUB_OFFLINE=1 sets), for one call."""
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = False


def failed(model: str, what: str, err: Exception, pretrained: bool) -> ConfigError:
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    said = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    repo = model.split(":", 1)[1] if model.startswith("hf-hub:") else None
    if repo is None and pretrained and not model.startswith("local-dir:"):  # a registry name's Hub weights
        repo = probe(model, what).pretrained_cfg.get("hf_hub_id")
    lacked = repo and repo.startswith("timm/") and not timm_module().is_model(repo[5:].partition(".")[0])
    close = close_names(repo, n=3) if lacked and model.startswith("hf-hub:") else []
    if close:  # a timm/ name this timm's registry lacks, looked for on the Hub
        what += f" (not an architecture of timm {timm_module().__version__}: did you mean {', '.join(close)}?)"
    if repo and isinstance(err, RepositoryNotFoundError):
        return ConfigError(
            f"{what}: the Hugging Face Hub has no repository {repo} (or it is private or gated: log in with "
            "`hf auth login`). Check the name (timm's models are timm/<architecture>.<tag>)."
        )
    remote = isinstance(err, EntryNotFoundError) and not isinstance(err, LocalEntryNotFoundError)
    if repo and (isinstance(err, KeyError) or remote):  # no config.json, one without an architecture, no weights
        return ConfigError(
            f"{what}: the Hub repository {repo} holds no timm model (a config.json naming an architecture, and its "
            f"weights; {said}). A transformers model: download it as a folder (`hf download {repo} --local-dir DIR`) "
            "and pass --model DIR."
        )
    if repo and isinstance(err, (OSError, EntryNotFoundError)):
        cache, offline = Path(constants.HF_HUB_CACHE), constants.HF_HUB_OFFLINE
        return ConfigError(
            f"{what} needs {repo} from the Hugging Face Hub: it is not in the Hub's cache at {cache} (HF_HOME or "
            "HF_HUB_CACHE set that folder) and could not be downloaded ("
            + ("HF_HUB_OFFLINE is set" if offline else f"this machine is probably offline; {type(err).__name__}")
            + f"). On a machine with network access run `hf download {repo}` and copy the folder "
            f"models--{repo.replace('/', '--')} from its Hub cache into {cache}, or download it as a folder "
            f"(`hf download {repo} --local-dir DIR`), copy that here and pass --model DIR (its weights with it)."
            + ("" if offline else " On a machine without network, HF_HUB_OFFLINE=1 skips the download's retries.")
        )
    if not pretrained:
        return ConfigError(
            f"{what}: timm could not build {model} ({said}). A model folder needs timm's config.json (architecture, "
            "pretrained_cfg) as save_for_hf writes it."
        )
    return ConfigError(
        f"{what}: timm could not load them ({said}). Offline, put the file in "
        f"{Path(torch.hub.get_dir()) / 'checkpoints'} or pass --weights /path/to/file; a model without pretrained "
        "weights trains from scratch (no --weights)."
    )


PROBED: dict[str, nn.Module] = {}


def probe(model: str, what: str = "") -> nn.Module:
    """The model built on the meta device (no memory, no initialisation): its pretrained config and data config. A
    Hub repo's config.json is read now, so an unknown or unreachable model fails at start."""
    if model not in PROBED:
        with torch.device("meta"):
            PROBED[model] = create(model, what or f"--model {model}", pretrained=False)
    return PROBED[model]


def size_args(model: str, image_size: int | None) -> dict:
    """A model built for one input size (a ViT: its patch grid and position embedding) is built for ``image_size``."""
    fixed = probe(model).pretrained_cfg.get("fixed_input_size")
    return {"img_size": image_size} if fixed and image_size else {}


def build(model: str, num_classes: int, image_size: int | None, drop_path: float | None, what: str) -> nn.Module:
    """From scratch (timm's own initialisation; its ResNets start their residual branches at zero); ``drop_path``:
    timm's ``drop_path_rate`` (None: the model's own)."""
    extra = {} if drop_path is None else {"drop_path_rate": drop_path}
    return create(model, what, num_classes=num_classes, **size_args(model, image_size), **extra)


def preprocessing(model: str, what: str) -> tuple[list[float], list[float], int]:
    """Mean, std and input side of the model's pretrained config (``timm.data.resolve_data_config``)."""
    data = timm_module().data.resolve_data_config({}, model=probe(model, what))
    return list(data["mean"]), list(data["std"]), int(data["input_size"][-1])


def fetch(model: str, what: str) -> None:
    """--weights DEFAULT made readable before anything else is read: loaded by timm on the meta device (no memory),
    so what is missing is downloaded into its cache now, or fails now."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # "copying ... to a meta parameter is a no-op", once per tensor
        create(model, what, pretrained=True)


def pretrained_state(model: str, image_size: int | None, what: str) -> dict:
    """The pretrained weights with their own head, as timm loads them into a model built for ``image_size`` (which
    the caller then loads, skipping a head of another shape)."""
    return create(model, what, pretrained=True, **size_args(model, image_size)).state_dict()
