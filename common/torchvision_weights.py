"""torchvision's pretrained weights: named as its docs spell them (``DEFAULT``, ``IMAGENET1K_V1``,
``ResNet18_Weights.IMAGENET1K_V1``: the weights enum's own ``verify`` reads each), read through torch's hub cache by
``WeightsEnum.get_state_dict`` (a download hash-checked by torch.hub). What this adds: a file already in that cache is
checked against the hash its name records (torch.hub checks only what it downloads), and a miss offline is one
paragraph naming the folder torch looks in."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from common.console import say
from common.errors import ConfigError

WEIGHTS_FILE_ENDINGS = (".pth", ".pt", ".safetensors", ".bin", ".ckpt")


def weights_entry(name: str, spec: str):
    """torchvision's weights entry that ``--weights`` names for ``--model name``, or None when ``spec`` is a file or
    folder. Weights of another model, or no such member, are one paragraph."""
    from torchvision import models

    if not re.fullmatch(r"(\w+\.)?\w+", spec) or Path(spec).expanduser().exists():
        return None
    if spec.lower().endswith(WEIGHTS_FILE_ENDINGS):
        return None
    try:
        enum = models.get_model_weights(name)
    except (ValueError, KeyError):
        enum = None
    try:
        return enum.verify(spec)  # DEFAULT, a member, or <Enum>.<member>
    except (AttributeError, KeyError):  # no enum, or no such member
        prefix = spec.partition(".")[0] if "." in spec else ""
    other = enum is not None and prefix not in ("", enum.__name__)
    whose = f" (those are weights of another model: {name}'s are {enum.__name__})" if other else ""
    raise ConfigError(
        f"--weights {spec!r} is neither a file (.pth, .pt or .safetensors) nor one of torchvision's weights for "
        f"{name}{whose}: "
        f"{', '.join(e.name for e in enum) if enum else 'none'}, or DEFAULT"
        f"{f' (also spelled {enum.__name__}.DEFAULT)' if enum else ''}."
    )


def state_dict(entry, load: bool = True) -> dict | None:
    """``entry``'s weights from torch's hub cache, the cached file checked first (``check_cached``); else downloaded
    there, hash-checked by torch.hub. Without ``load``, a cached file is only checked (None)."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(entry.url).name  # where torch.hub keeps it
    check_cached(entry, path)
    if path.is_file() and not load:
        return None
    if not path.is_file():
        say(f"downloading {entry.url} to {path}")
    try:
        return entry.get_state_dict(progress=False, check_hash=True)
    except Exception as err:  # noqa: BLE001 - urllib, socket and hash errors alike mean "no weights"
        raise ConfigError(
            f"torchvision could not fetch the {entry} weights ({type(err).__name__}: {err}); this machine is probably "
            f"offline. Download {entry.url} on a machine with network access, copy it here, and pass --weights "
            f"/path/to/{path.name} (or put it in {path.parent}/, where torchvision looks first)."
        ) from None


def check_cached(entry, path: Path) -> None:
    """A file torch.hub finds in its cache is loaded unchecked: checked here against the sha256 prefix its name
    records (resnet18-f37072fd.pth) before it is taken for torchvision's weights (about a second per 500 MB)."""
    match = torch.hub.HASH_REGEX.search(path.name)
    if match is None or not path.is_file():
        return
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    found, prefix = digest.hexdigest(), match.group(1)
    if not found.startswith(prefix):
        raise ConfigError(
            f"{path} is in torch's hub cache under the name of torchvision's {entry} weights, but its sha256 starts "
            f"{found[: len(prefix)]}, not {prefix} as the name records ({entry.url}): it is another file or a damaged "
            "copy, not those weights. Delete it (torchvision then downloads it again, checked), copy the right file "
            "there, or pass the file you meant with --weights /path/to/file.pth."
        )
