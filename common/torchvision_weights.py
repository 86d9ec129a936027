"""torchvision's pretrained weights: named as its docs spell them (``DEFAULT``, ``IMAGENET1K_V1``,
``ResNet18_Weights.IMAGENET1K_V1``), kept in torch's hub cache, checked against the hash their file name records before
they are taken for torchvision's, and downloaded (hash-checked by torch.hub) when missing; offline, one paragraph
naming the folder torch looks in."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from common.console import say
from common.errors import ConfigError

WEIGHTS_FILE_ENDINGS = (".pth", ".pt", ".safetensors", ".bin", ".ckpt")
WEIGHTS_NAME = re.compile(r"^(?:(\w+)\.)?(\w+)$")  # torchvision's spellings: DEFAULT, IMAGENET1K_V1, X_Weights.MEMBER


def weights_entry(name: str, spec: str):
    """torchvision's weights entry that ``--weights`` names for ``--model name`` (``DEFAULT``, a member such as
    ``IMAGENET1K_V1``, or the enum's own spelling ``ResNet18_Weights.IMAGENET1K_V1`` as its docs and reference script
    write it), or None when ``spec`` is a file or folder. Weights of another model, or no such member, are one
    paragraph."""
    from torchvision import models

    match = WEIGHTS_NAME.match(spec)
    if match is None or Path(spec).expanduser().exists() or spec.lower().endswith(WEIGHTS_FILE_ENDINGS):
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


def download(entry) -> None:
    """``entry``'s file in torch's hub cache: the cached copy checked, else downloaded (the download's hash checked
    by torch.hub)."""
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
