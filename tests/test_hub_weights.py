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
    monkeypatch.setattr(
        ResNet18_Weights.IMAGENET1K_V1.value, "url", f"https://download.pytorch.org/models/resnet18-{prefix}.pth"
    )
    model = vision.build("resnet18", 1000)
    line = vision.load_pretrained(model, "ResNet18_Weights.IMAGENET1K_V1", "resnet18", 1000)
    assert f"{len(state)} tensors loaded" in line, line
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("weights", ["DEFAULT", "missing.pth"])
def test_weights_that_cannot_be_had_fail_at_start_before_the_photos_are_read(tmp_path, env, weights):
    """Offline (no machine here reaches download.pytorch.org), --weights DEFAULT failed only after the folder was
    scanned, and its message said `$TORCH_HOME` instead of the folder torch looks in; a missing file, likewise late."""
    import subprocess
    import sys

    from helpers import REPO, write_photo_folder

    root = write_photo_folder(tmp_path / "photos" / "train", 4)
    env = {**env, "TORCH_HOME": str(tmp_path / "torch"), "ACCELERATE_RECIPES_CACHE": str(tmp_path / "cache")}
    spec = weights if weights == "DEFAULT" else str(tmp_path / weights)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "finetune_folder.py"),
            "--dataset",
            str(root.parent),
            "--weights",
            spec,
            "--workers",
            "0",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if weights == "DEFAULT":
        assert str(tmp_path / "torch" / "hub" / "checkpoints") in paragraph and "$TORCH_HOME" not in paragraph
    else:
        assert "no such file" in paragraph, paragraph
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # the folder was never checked
    assert not (tmp_path / "run").exists()
