"""torchvision's pretrained weights as torch's hub cache holds them: a cached file is checked against the hash its name
records before it is called ImageNet's, and an offline --weights DEFAULT fails at start, naming the real folder."""

from __future__ import annotations

import hashlib

import pytest
import torch

from common import vision
from common.errors import ConfigError


def test_a_cached_file_that_is_not_the_recorded_one_is_refused(tmp_path, monkeypatch):
    """torch.hub checks the hash only when it downloads: any file under the expected name was loaded as ImageNet's."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.save(vision.build("resnet18", 1000).state_dict(), cached)  # a resnet18, just not torchvision's
    with pytest.raises(ConfigError) as caught:
        vision.load_pretrained(vision.build("resnet18", 3), "DEFAULT", "resnet18", 3)
    message = str(caught.value)
    assert "\n" not in message and str(cached) in message and "not f37072fd" in message, message
    assert "Delete it" in message and "--weights /path/to/file.pth" in message, message


def test_a_cached_file_whose_hash_matches_its_name_loads_without_a_download(tmp_path, monkeypatch):
    """The same path with a file whose sha256 starts as its name says (an entry whose URL names it): loaded from the
    cache (this machine has no network), every tensor as saved."""
    from torchvision.models import ResNet18_Weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    state = vision.build("resnet18", 1000).state_dict()
    torch.save(state, folder / "draft.pth")
    prefix = hashlib.sha256((folder / "draft.pth").read_bytes()).hexdigest()[:8]
    (folder / "draft.pth").rename(folder / f"resnet18-{prefix}.pth")
    monkeypatch.setattr(ResNet18_Weights.IMAGENET1K_V1.value, "url",
                        f"https://download.pytorch.org/models/resnet18-{prefix}.pth")
    model = vision.build("resnet18", 1000)
    line = vision.load_pretrained(model, "ResNet18_Weights.IMAGENET1K_V1", "resnet18", 1000)
    assert f"{len(state)} tensors loaded" in line, line
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
