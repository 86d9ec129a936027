"""timm's image models (PyTorch Image Models, Hugging Face's image-model library) by name: a registry name
(``resnet50d``, ``mobilenetv4_conv_small``, with a pretrained tag ``resnet10t.c3_in1k``, or as the Hub spells it
``timm/resnet10t.c3_in1k``), a Hub repo in timm's layout (``hf-hub:org/name``) or a folder in that layout (config.json
and model.safetensors, as ``timm.models.save_for_hf`` or ``hf download`` write it). Each is built with the data's
classes, its pretrained weights (``--weights DEFAULT``) loaded by timm itself (its checkpoint filters, a ViT's
position grid resampled to ``--image-size``), with the normalisation and input size of its pretrained config.

Files from the Hub are taken from huggingface_hub's cache first (no network when they are there: a run, predict and
export on an offline machine), downloaded when missing; a miss that cannot be downloaded is one paragraph naming the
cache folder. NOTE: the evaluation crop's share of the resized photo is the recipe's (0.875, torchvision's), not the
model's ``crop_pct``; its interpolation is the recipe's bilinear one.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from common.errors import ConfigError

HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's spelling of a Hub repo (hf_hub: is its older one)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the order timm reads a Hub repo's weights in


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


def registry_names(tagged: bool) -> list[str]:
    """timm's architectures, or with ``tagged`` its pretrained ``architecture.tag`` names."""
    return timm_module().list_models(pretrained=tagged)


def close_names(name: str, others=(), n: int = 5) -> list[str]:
    """The names nearest to ``name`` among timm's (with their pretrained tags when ``name`` has one) and ``others``."""
    bare = name.removeprefix("timm/")
    pool = list(dict.fromkeys([*others, *registry_names("." in bare)]))
    prefix = "timm/" if name.startswith("timm/") else ""
    return [(prefix if m not in others else "") + m for m in difflib.get_close_matches(bare, pool, n=n)]


# --- files from the Hub: its cache first --------------------------------------------------------------------------


def hub_unreachable(repo_id: str, what: str, err: Exception) -> ConfigError:
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(err, RepositoryNotFoundError):
        return ConfigError(
            f"{what}: the Hugging Face Hub has no repository {repo_id} (or it is private or gated: log in with "
            "`hf auth login`). Check the name (timm's models are timm/<architecture>.<tag>)."
        )
    cache = Path(constants.HF_HUB_CACHE)
    offline = constants.HF_HUB_OFFLINE
    return ConfigError(
        f"{what} needs {repo_id} from the Hugging Face Hub: it is not in the Hub's cache at {cache} (HF_HOME or "
        "HF_HUB_CACHE set that folder) and could not be downloaded ("
        + ("HF_HUB_OFFLINE is set" if offline else f"this machine is probably offline; {type(err).__name__}")
        + f"). On a machine with network access run `hf download {repo_id}` and copy the folder "
        f"models--{repo_id.replace('/', '--')} from its Hub cache into {cache}, or download it as a folder "
        f"(`hf download {repo_id} --local-dir DIR`), copy that here and pass --model DIR (its weights with it)."
        + ("" if offline else " On a machine without network, HF_HUB_OFFLINE=1 skips the download's retries.")
    )


def hub_file(repo_id: str, filename: str, what: str, revision: str | None = None) -> Path | None:
    """A file of a Hub repo from the cache, else downloaded into it; None when the repo has no such file."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo_id, filename, revision=revision)
    if isinstance(cached, str):  # no network asked: an offline machine with the files runs as one with network
        return Path(cached)
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except LocalEntryNotFoundError as err:  # offline, not cached (a subclass of the next: caught first)
        raise hub_unreachable(repo_id, what, err) from None
    except EntryNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - httpx, socket and Hub errors alike mean "no file"
        raise hub_unreachable(repo_id, what, err) from None


def hub_weights(repo_id: str, what: str, revision: str | None = None, names=WEIGHT_FILES) -> Path:
    for filename in names:
        path = hub_file(repo_id, filename, what, revision)
        if path is not None:
            return path
    raise ConfigError(f"{what}: the Hub repository {repo_id} holds no weights file ({', '.join(names)}).")


# --- what timm.create_model is given ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    create: str  # what timm.create_model takes: a registry name, or local-dir:<folder> (a Hub repo's cached copy)
    repo_id: str | None  # the Hub repo of --model hf-hub:..., whose weights DEFAULT reads


def source(name: str, folder: Path | None = None) -> Source:
    """--model ``name`` as timm builds it. ``folder``: a model folder ``name`` names. A Hub repo's config.json is
    taken from the cache or downloaded now, so an offline miss fails at start."""
    if folder is not None:
        return Source(f"local-dir:{folder}", None)
    if not is_hub_name(name):
        known = registry_name(name)
        if known is not None:
            return Source(known, None)
    repo_id = name.split(":", 1)[1] if is_hub_name(name) else name  # timm/<name> this timm's registry lacks
    close = close_names(name, n=3) if not is_hub_name(name) else []
    what = f"--model {name}" + (
        f" (not an architecture of timm {timm_module().__version__}: did you mean {', '.join(close)}?)" if close else ""
    )
    config = hub_file(repo_id, "config.json", what)
    if config is None or "architecture" not in json.loads(config.read_text()):
        raise ConfigError(
            f"{what}: the Hub repository {repo_id} holds no timm config.json (one naming an architecture), so it is "
            f"not a timm model. A transformers model: download it as a folder (`hf download {repo_id} --local-dir "
            "DIR`) and pass --model DIR."
        )
    return Source(f"local-dir:{config.parent}", repo_id)


@lru_cache(maxsize=8)
def probe(create: str) -> nn.Module:
    """The model built on the meta device (no memory, no initialisation): its pretrained config and data config."""
    try:
        with torch.device("meta"):
            return timm_module().create_model(create, pretrained=False)
    except Exception as err:  # noqa: BLE001 - a folder whose config.json timm cannot read
        raise ConfigError(
            f"timm could not build {create} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "A model folder needs timm's config.json (architecture, pretrained_cfg) as save_for_hf writes it."
        ) from None


def size_args(src: Source, image_size: int | None) -> dict:
    """A model built for one input size (a ViT: its patch grid and position embedding) is built for ``image_size``."""
    fixed = probe(src.create).pretrained_cfg.get("fixed_input_size")
    return {"img_size": image_size} if fixed and image_size else {}


def build(src: Source, num_classes: int, image_size: int | None, drop_path: float | None = None) -> nn.Module:
    """From scratch (timm's own initialisation; its ResNets start their residual branches at zero); ``drop_path``:
    timm's ``drop_path_rate`` (None: the model's own)."""
    extra = {} if drop_path is None else {"drop_path_rate": drop_path}
    return timm_module().create_model(
        src.create, pretrained=False, num_classes=num_classes, **size_args(src, image_size), **extra
    )


def preprocessing(src: Source) -> tuple[list[float], list[float], int]:
    """Mean, std and input side of the model's pretrained config (``timm.data.resolve_data_config``)."""
    from timm.data import resolve_data_config

    data = resolve_data_config({}, model=probe(src.create))
    return list(data["mean"]), list(data["std"]), int(data["input_size"][-1])


def pretrained_cfg_file(name: str, src: Source, what: str) -> dict:
    """Where --weights DEFAULT is read from, as ``pretrained_cfg_overlay`` for timm: a registry name's Hub weights (from
    the cache, or downloaded now); {} where timm reads them itself (a folder's own, or a download URL)."""
    if src.repo_id is not None:  # the cached repo's own revision: config and weights of one commit
        hub_weights(src.repo_id, what, revision=Path(src.create.split(":", 1)[1]).name)
        return {}
    if src.create.startswith("local-dir:"):
        return {}
    cfg = probe(src.create).pretrained_cfg
    if cfg.get("hf_hub_id"):
        names = (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else WEIGHT_FILES
        return {"file": str(hub_weights(cfg["hf_hub_id"], what, names=names))}
    if not cfg.get("url"):
        raise ConfigError(
            f"{what}: timm has no pretrained weights for {name}. Pass a weights file, or train from "
            "scratch (no --weights)."
        )
    return {}  # a URL: timm downloads it into torch's hub cache


def pretrained_state(name: str, src: Source, image_size: int | None) -> dict:
    """The pretrained weights of ``name`` with their own head, as timm loads them into a model built for
    ``image_size`` (which the caller then loads, skipping a head of another shape)."""
    what = f"--weights DEFAULT for --model {name}"
    overlay = pretrained_cfg_file(name, src, what)
    try:
        model = timm_module().create_model(
            src.create, pretrained=True, pretrained_cfg_overlay=overlay or None, **size_args(src, image_size)
        )
    except Exception as err:  # noqa: BLE001 - a URL download (torch.hub) or a damaged file
        raise ConfigError(
            f"{what}: timm could not load them ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            f". Offline, put the file in {Path(torch.hub.get_dir()) / 'checkpoints'} or pass --weights /path/to/file."
        ) from None
    return model.state_dict()


def fetch(name: str, src: Source) -> None:
    """Make --weights DEFAULT readable before anything else is read: downloaded into the Hub's cache when missing, a
    folder's own weights file there."""
    what = f"--weights DEFAULT for --model {name}"
    if src.create.startswith("local-dir:") and src.repo_id is None:
        folder = Path(src.create.split(":", 1)[1])
        if not any((folder / f).is_file() for f in WEIGHT_FILES):
            raise ConfigError(
                f"{what}: the model folder {folder} holds no weights file ({', '.join(WEIGHT_FILES)}). Pass "
                "--weights /path/to/weights.safetensors, or train from scratch with --weights ''."
            )
        return
    if pretrained_cfg_file(name, src, what) or src.repo_id is not None:
        return
    with warnings.catch_warnings(), torch.device("meta"):  # a URL: timm's download, loaded into no memory
        warnings.simplefilter("ignore")  # "copying ... to a meta parameter is a no-op", once per tensor
        try:
            timm_module().create_model(src.create, pretrained=True)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(
                f"{what}: timm could not download them ({type(err).__name__}); this machine is probably offline. "
                f"Put the file in {Path(torch.hub.get_dir()) / 'checkpoints'} or pass --weights /path/to/file."
            ) from None
