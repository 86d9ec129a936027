"""Optimizers with per-group learning rates, and the one setting every recipe wants on any device.

``sgd_with_bias_groups`` is airbench's SGD (arXiv 2404.00498): Nesterov momentum, and the BatchNorm
biases in a group of their own whose learning rate is ``bias_lr_scale`` times larger while their weight
decay per step stays the same (torch's SGD couples decay to the LR, so their ``weight_decay`` is divided
by the same factor). In the paper's ablation the larger bias LR cuts the epochs to 94% by about 25%.
An optional group of ``early_params`` (airbench: the whitening bias) is trained for the first
``early_epochs`` epochs only, then held still by a zero LR in the schedule (``common.schedules`` reads
the group's ``train_epochs``); unlike ``requires_grad_(False)`` mid-run, that keeps DDP's set of
gradients fixed.

``fused=True`` everywhere: one multi-tensor kernel per step on a GPU and on a CPU (the CPU kernels exist
since torch 2.4; without the flag the CPU runs a per-parameter Python loop). A fused optimizer also
accepts a device-side ``found_inf`` flag, which ``common.train.guard`` uses to skip a step after a non-finite
loss without waiting for the device (and GradScaler uses for an fp16 overflow). ``zero_momentum_before_first_step``
keeps such a skipped first step from leaving garbage momentum behind.
"""

from __future__ import annotations

import torch
from torch import nn

from common.vision import head


def sgd_with_bias_groups(
    model: nn.Module,
    lr: float,
    momentum: float,
    weight_decay: float,
    bias_lr_scale: float = 1.0,
    early_params=(),
    early_epochs: int = 0,
):
    frozen_ids = {id(p) for p in early_params}
    norm_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p in m.parameters(recurse=False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {
            "name": "weights",
            "params": [p for p in trainable if id(p) not in norm_ids | frozen_ids],
            "lr": lr,
            "weight_decay": weight_decay,
        },
        {
            "name": "norm_biases",
            "params": [p for p in trainable if id(p) in norm_ids and id(p) not in frozen_ids],
            "lr": lr * bias_lr_scale,
            "weight_decay": weight_decay / bias_lr_scale,
        },
        {
            "name": "early",
            "params": [p for p in trainable if id(p) in frozen_ids],
            "lr": lr,
            "weight_decay": weight_decay,
            "train_epochs": early_epochs,
        },
    ]
    return torch.optim.SGD(
        [g for g in groups if g["params"]], lr=lr, momentum=momentum, nesterov=momentum > 0, fused=True
    )


def decays(name: str, p: torch.Tensor, exempt=()) -> bool:
    """Whether weight decay applies: not to norms' weights, biases and other 1-d parameters, nor to what the model
    names in ``no_weight_decay()`` (timm's: position embeddings, class tokens), as timm's and transformers' trainers
    do."""
    return p.ndim > 1 and not name.endswith(".bias") and name not in exempt


def param_groups(
    model: nn.Module, num_classes: int, lr: float, backbone_scale: float, weight_decay: float, layer_decay: float = 0
) -> list[dict]:
    """The head at ``lr``, every other parameter at ``lr * backbone_scale``; weight decay only where ``decays``.
    ``layer_decay`` (a timm model): instead of the backbone scale, timm's layer-wise decay
    (``timm.optim.param_groups_layer_decay``): the head at ``lr``, each layer below it at ``layer_decay`` times the
    layer above."""
    exempt = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    if layer_decay:
        from timm.optim import param_groups_layer_decay

        groups = param_groups_layer_decay(model, weight_decay, exempt, layer_decay=layer_decay)
        return [{**g, "lr": lr * g["lr_scale"]} for g in groups]
    head_name, _ = head(model, num_classes)
    groups = {}
    for name, p in model.named_parameters():
        part = "head" if name.startswith(head_name + ".") else "backbone"
        decay = decays(name, p, exempt)
        group = groups.setdefault(
            (part, decay),
            {
                "name": part if decay else f"{part}_no_decay",
                "params": [],
                "lr": lr if part == "head" else lr * backbone_scale,
                "weight_decay": weight_decay if decay else 0.0,
            },
        )
        group["params"].append(p)
    order = [("backbone", True), ("backbone", False), ("head", True), ("head", False)]  # group 0: the logged LR
    return [groups[k] for k in order if k in groups]


def zero_momentum_before_first_step(optimizer) -> None:
    """A fused SGD's first step makes its momentum buffers with ``torch.empty_like`` and fills them in the kernel;
    when that step is skipped on the device (``found_inf``: an fp16 overflow, or the guard's non-finite loss) they
    keep whatever memory held, and the next step builds on it (parameters off by 1e30 were seen). Zero buffers
    given before the first step make that step's update the same as torch's (with ``dampening`` 0, ``0 * momentum
    + grad`` is the first step's ``grad``) and a skipped first step leave the state a stock SGD that never ran
    would have. A step pre-hook, removed once it has run; a no-op for other optimizers."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    if not isinstance(inner, torch.optim.SGD) or not inner.defaults.get("fused"):
        return

    def before_first_step(opt, args, kwargs):
        for group in opt.param_groups:
            if group["momentum"] == 0 or group["dampening"] != 0:  # dampening scales the first step differently
                continue
            for p in group["params"]:
                if p.grad is not None and opt.state[p].get("momentum_buffer") is None:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        hook.remove()

    hook = inner.register_step_pre_hook(before_first_step)
