"""FSDP version 2, as the photo recipe uses it: the launcher's answer is checked and Accelerate shards the model
(``common.train.accelerator``); what the rest of the run needs of a sharded model lives here: the model's own class
behind FSDP's, the main process's buffers on every process (one model, as DDP), the startup line's description."""

from __future__ import annotations

import torch


def plain_class(module: torch.nn.Module) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps a sharded module's class for a subclass (FSDPResNet of
    ResNet), which predict and export could not rebuild."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6 has no FSDP2: no class was swapped
        return type(module)
    cls = type(module)
    return next(b for b in cls.__bases__ if b is not FSDPModule) if issubclass(cls, FSDPModule) else cls


def share_buffers(accelerator, model) -> None:
    """Under FSDP2 every process takes the main process's buffers (BatchNorm's running statistics, which FSDP does
    not shard and each process moves with its own batches), as DDP gives every forward pass: the model evaluated,
    checkpointed and saved is one model, and a resume continues it exactly. Called before each of those; nothing
    without FSDP2."""
    if not getattr(accelerator, "is_fsdp2", False) or accelerator.num_processes == 1:
        return
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for buffer in model.buffers():
        if not isinstance(buffer, DTensor):
            dist.broadcast(buffer, src=0)


def describe(accelerator, model) -> str:
    """How FSDP2 shards ``model`` (prepared), for the startup line; '' without FSDP."""
    if not accelerator.is_fsdp2:
        return ""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule

    units = Counter(plain_class(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model)
    plugin = accelerator.state.fsdp_plugin
    each = ", ".join(f"{n} {name}" for name, n in units.most_common())
    units = (
        f"units: {each} and the rest of {plain_class(model).__name__}"
        if each
        else f"one unit, the whole {plain_class(model).__name__} (no auto-wrap policy: fsdp_auto_wrap_policy "
        "TRANSFORMER_BASED_WRAP shards it block by block)"
    )
    return (
        f"sharded=FSDP2 over {accelerator.num_processes} process(es): parameters, gradients and optimizer state; "
        f"{units}; reshard_after_forward={plugin.reshard_after_forward}; "
        f"state_dict_type={plugin.state_dict_type.name}"
    )
