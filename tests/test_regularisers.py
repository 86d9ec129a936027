"""The photo recipe's fine-tuning regularisers, as timm's train.py has them: no weight decay on norms, biases and what a
model names in ``no_weight_decay()``; --layer-decay (timm's layer-wise LR decay, timm's own grouping); --drop-path
(stochastic depth) for timm, torchvision and transformers models that take it, refused up front for those that do
not. Small models only: timm's test_* networks, torchvision's resnet18 and convnext_tiny built on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common import vision
from common.errors import ConfigError
from common.optimizers import param_groups

from helpers import SMALL, check_ok, import_recipe, run_in_process

timm = pytest.importorskip("timm")


def groups_by_param(groups):
    return {id(p): g for g in groups for p in g["params"]}


@pytest.mark.parametrize("name", ["resnet18", "test_vit"])
def test_weight_decay_skips_norms_biases_and_the_models_own_exemptions(name):
    model = vision.build(name if name == "resnet18" else f"timm/{name}", 5, 32 if name == "test_vit" else None)
    groups = param_groups(model, 5, lr=0.1, backbone_scale=0.25, weight_decay=5e-4)
    where = groups_by_param(groups)
    assert len(where) == sum(1 for _ in model.parameters())  # each parameter in exactly one group
    exempt = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    for pname, p in model.named_parameters():
        g = where[id(p)]
        norm_or_bias = p.ndim <= 1 or pname.endswith(".bias") or pname in exempt
        assert g["weight_decay"] == (0.0 if norm_or_bias else 5e-4), pname
        head = pname.startswith(("fc.", "head."))
        assert g["lr"] == pytest.approx(0.1 if head else 0.025), pname
    if name == "test_vit":  # timm's exemptions reach the groups: the position embedding and class token
        named = dict(model.named_parameters())
        assert named["pos_embed"].ndim == 3 and where[id(named["pos_embed"])]["weight_decay"] == 0
    assert groups[0]["name"] == "backbone"  # group 0 is the one whose LR the run logs


def test_layer_decay_is_timms_grouping_with_the_head_at_the_full_lr():
    model = vision.build("timm/test_vit", 5, 32)
    groups = param_groups(model, 5, lr=0.1, backbone_scale=0.25, weight_decay=5e-4, layer_decay=0.5)
    where = groups_by_param(groups)
    named = dict(model.named_parameters())
    assert where[id(named["head.weight"])]["lr"] == pytest.approx(0.1)
    assert where[id(named["head.bias"])]["weight_decay"] == 0
    # the patch embedding is layer 0, each block one layer up: the rate falls by half per layer below the head
    rates = [where[id(named["patch_embed.proj.weight"])]["lr"]]
    rates += [where[id(named[f"blocks.{i}.mlp.fc1.weight"])]["lr"] for i in range(len(model.blocks))]
    assert all(b == pytest.approx(2 * a) for a, b in zip(rates, rates[1:])), rates
    assert sorted({round(g["lr"] / 0.1, 6) for g in groups})[-1] == 1.0
    assert len(where) == len(named)


def drop_rates(model: nn.Module) -> set[float]:
    """The drop rates of the model's residual branches: timm's DropPath, torchvision's StochasticDepth."""
    from torchvision.ops import StochasticDepth

    rates = set()
    for m in model.modules():
        if isinstance(m, timm.layers.DropPath):
            rates.add(round(m.drop_prob, 6))
        elif isinstance(m, StochasticDepth):
            rates.add(round(m.p, 6))
    return rates


def test_drop_path_reaches_timm_torchvision_and_transformers_models(tmp_path):
    assert drop_rates(vision.build("timm/test_convnext", 5)) == set()  # timm's own: none
    assert max(drop_rates(vision.build("timm/test_convnext", 5, drop_path=0.2))) == pytest.approx(0.2)
    with torch.device("meta"):
        assert max(drop_rates(vision.build("convnext_tiny", 5))) == pytest.approx(0.1)  # torchvision's own
        assert max(drop_rates(vision.build("convnext_tiny", 5, drop_path=0.3))) == pytest.approx(0.3)
        assert drop_rates(vision.build("convnext_tiny", 5, drop_path=0.0)) == {0.0}  # off, when asked
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(
        num_channels=3,
        num_stages=2,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_labels=5,
        image_size=32,
        drop_path_rate=0.0,
    )
    transformers.ConvNextForImageClassification(config).save_pretrained(tmp_path / "convnext")
    model = vision.build(str(tmp_path / "convnext"), 5, 32, drop_path=0.25)
    assert model.model.config.drop_path_rate == 0.25


def test_a_model_without_drop_path_or_timm_layers_is_refused_before_any_data(tmp_path, env):
    with pytest.raises(ConfigError) as err:
        vision.check_regularisers("resnet18", 0.1, 0.0)
    message = str(err.value)
    assert "--drop-path" in message and "resnet18" in message and "convnext" in message and "\n" not in message
    with pytest.raises(ConfigError, match="--layer-decay needs a timm model.*resnet18 is torchvision's"):
        vision.check_regularisers("resnet18", None, 0.75)
    vision.check_regularisers("timm/test_convnext", 0.1, 0.75)  # both taken: no error
    vision.check_regularisers("resnet18", None, 0.0)  # neither asked for: nothing built

    # through the recipe: one paragraph, exit 2, before the (missing) dataset is looked at
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", tmp_path / "nowhere", "--model", "resnet18", "--drop-path", 0.1, "--output-dir", tmp_path / "r"],
        env,
    )
    assert proc.returncode == 2 and "takes no drop path" in proc.stderr and "Traceback" not in proc.stderr
    assert "nowhere" not in proc.stderr and not (tmp_path / "r").exists()


def test_a_checkpoint_whose_optimizer_groups_differ_is_refused_in_one_paragraph(
    tmp_path, env, photos_like, monkeypatch
):
    """A photo-recipe checkpoint from a version whose optimizer had two groups (head, backbone; weight decay on all)
    does not resume into this one's four: one paragraph naming the checkpoint and what to do, and nothing in the run
    folder changed."""
    recipe = import_recipe("finetune_folder")

    def two_groups(model, num_classes, lr, backbone_scale, weight_decay, layer_decay=0):
        head_name, _ = vision.head(model, num_classes)
        named = list(model.named_parameters())
        head = [p for n, p in named if n.startswith(head_name + ".")]
        body = [p for n, p in named if not n.startswith(head_name + ".")]
        return [{"params": body, "lr": lr * backbone_scale}, {"params": head, "lr": lr}]

    args = ["--dataset", photos_like, *SMALL["finetune_folder"], "--batch-size", 32, "--output-dir", tmp_path / "run"]
    monkeypatch.setattr(recipe, "param_groups", two_groups)
    check_ok(run_in_process("finetune_folder", [*args, "--max-steps", 2, "--checkpoint-every", 2], env))
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    before = sorted((p, p.stat().st_mtime_ns) for p in checkpoints.rglob("*"))
    proc = run_in_process("finetune_folder", [*args, "--resume-from", "latest"], env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "parameter groups differ" in proc.stderr and "step-00000002" in proc.stderr, proc.stderr[-2000:]
    assert sorted((p, p.stat().st_mtime_ns) for p in checkpoints.rglob("*")) == before
