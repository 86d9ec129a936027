"""Weight averaging, two ways a recipe picks from, each a class whose ``step()``/``update()`` the loop calls once per
update (after ``if not accelerator.sync_gradients: continue``: a --grad-accum micro-batch moves neither, nor does an
update fp16 loss scaling skipped) and whose state goes into every checkpoint as safetensors through Accelerate's
save/load hooks (tensors only: loading a checkpoint someone sent you runs no pickle).

``EMA``: an exponential moving average of the weights, evaluated and saved instead of them
(the arithmetic and checkpoint file of ``torch.optim.swa_utils.AveragedModel``).

``Lookahead``, as airbench94 uses it (arXiv 2404.00498).

Every ``every`` optimizer steps the slow copy moves toward the trained weights,
``slow <- decay * slow + (1 - decay) * weights``, and the trained weights are reset to it
(``weights <- slow``). The decay grows with the cube of the run's progress,
``decay = 0.95 ** every * (step / total) ** 3``: near 0 early (the average just follows the weights),
about 0.77 at the end, where averaging pays most. At the last planned step the weights become the slow
copy, so the evaluated and saved model is the average. In the paper's ablation this replaced an
evaluation-only EMA and cut the epochs to 94% by about 12%; it also keeps no second model for evaluation.

Parameters and floating-point buffers (BatchNorm running statistics) are averaged. The tensor lists are
built once; a step is two multi-tensor kernels every ``every`` steps and nothing in between, with no
device sync. The slow copy and the step count go into every checkpoint as ``lookahead.safetensors``
(through Accelerate's save/load-state hooks; tensors only, so loading a checkpoint someone sent you runs no
code), and a resumed run averages exactly as the uninterrupted one. Under DDP every rank holds equal parameters; the
BatchNorm buffers that reach the model's forward are rank 0's (DDP broadcasts them), so evaluation and the
saved weights are the same model on every rank.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from common.errors import RecipeError

STATE_FILE = "lookahead.safetensors"
EMA_FILE = "ema.safetensors"


def save_tensors(is_main: bool, tensors: dict, path: Path) -> None:
    """A weight average's state into a checkpoint, from the main process (every rank resumes from rank 0's)."""
    from safetensors.torch import save_file

    if is_main:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


def load_tensors(checkpoint_dir: Path, name: str, missing: str) -> dict:
    """A weight average's state from a checkpoint; ``missing``: why the file may be absent and the flag that fits."""
    from safetensors.torch import load_file

    path = checkpoint_dir / name
    if not path.is_file():
        raise RecipeError(
            f"The checkpoint {checkpoint_dir} has no {name} {missing}, or start a new run with a new --output-dir."
        )
    return load_file(str(path))


class EMA:
    """An exponential moving average of ``model``'s weights and buffers with ``decay`` per update (off when 0).
    ``module``: the averaged copy, which the recipe evaluates and saves; ``update()`` after each update taken.

    The arithmetic and the checkpoint file are ``torch.optim.swa_utils.AveragedModel``'s with
    ``get_ema_multi_avg_fn`` and ``use_buffers=True`` (the first update copies the weights; then one
    ``_foreach_lerp_`` over the floating-point tensors; integer buffers by the same formula), but the update count is
    a Python int: AveragedModel keeps it in a host tensor and copies it to the device at every update, a stream
    synchronisation per step on a GPU."""

    def __init__(self, accelerator, model: nn.Module, decay: float):
        self.accelerator, self.model, self.decay, self.module = accelerator, model, decay, None
        if not decay:
            return
        live = accelerator.unwrap_model(model, keep_torch_compile=False)
        self.module = copy.deepcopy(live)  # the model's copy that holds the average
        self.updates = 0
        pairs = list(zip([*self.module.parameters(), *self.module.buffers()], [*live.parameters(), *live.buffers()]))
        self.floats = [(a.detach(), b.detach()) for a, b in pairs if a.is_floating_point()]
        self.others = [(a.detach(), b.detach()) for a, b in pairs if not a.is_floating_point()]
        accelerator.register_save_state_pre_hook(lambda models, weights, out_dir: self.save(Path(out_dir)))
        accelerator.register_load_state_pre_hook(lambda models, in_dir: self.load(Path(in_dir)))

    @torch.no_grad()
    def update(self) -> None:
        """After each update: device kernels only, no sync. An update fp16 loss scaling skipped is not averaged."""
        if self.module is None or self.accelerator.optimizer_step_was_skipped:
            return
        if self.updates == 0:
            torch._foreach_copy_([a for a, _ in self.floats + self.others], [b for _, b in self.floats + self.others])
        else:
            if self.floats:
                torch._foreach_lerp_([a for a, _ in self.floats], [b for _, b in self.floats], 1 - self.decay)
            for averaged, current in self.others:  # num_batches_tracked: AveragedModel's formula, truncated
                averaged.copy_(averaged * self.decay + current * (1 - self.decay))
        self.updates += 1

    def state_dict(self) -> dict:
        """AveragedModel's layout: the copy's tensors under ``module.``, the update count as ``n_averaged``."""
        state = {f"module.{k}": v for k, v in self.module.state_dict().items()}
        return {**state, "n_averaged": torch.tensor(self.updates)}

    @torch.no_grad()
    def sync(self) -> None:
        """Before the average is read (evaluated, saved): every rank takes rank 0's BatchNorm statistics. DDP keeps
        the parameters equal on every rank, but each rank's forward updates its own running statistics, so each
        rank's average of them drifts apart; rank 0's are the ones a checkpoint holds, so a resumed run evaluates
        exactly what the uninterrupted one did. One broadcast of the buffers (kilobytes) per evaluation."""
        if self.module is None or self.accelerator.num_processes == 1:
            return
        import torch.distributed as dist

        for buffer in self.module.buffers():
            dist.broadcast(buffer, src=0)

    def save(self, checkpoint_dir: Path) -> None:
        """Rank 0's copy, as every rank starts from rank 0's model."""
        save_tensors(self.accelerator.is_main_process, self.state_dict(), checkpoint_dir / EMA_FILE)

    def load(self, checkpoint_dir: Path) -> None:
        state = load_tensors(
            checkpoint_dir,
            EMA_FILE,
            "(the weight average): it was written without --ema-decay. Resume it with --ema-decay 0",
        )
        self.updates = int(state.pop("n_averaged"))
        prefix = len("module.")
        self.module.load_state_dict({k[prefix:]: v for k, v in state.items()})  # copied onto the model's device


class Lookahead:
    def __init__(self, accelerator, model: nn.Module, total_steps: int, every: int = 5, base: float = 0.95):
        self.every, self.base, self.total, self.steps = every, base, max(1, total_steps), 0
        self.accelerator = accelerator
        live = accelerator.unwrap_model(model, keep_torch_compile=False)
        self.live = [t for t in (*live.parameters(), *live.buffers()) if t.is_floating_point()]
        self.slow = [t.detach().clone() for t in self.live] if every else []
        if every:
            self.is_main = accelerator.is_main_process
            accelerator.register_save_state_pre_hook(lambda models, weights, out_dir: self.save(Path(out_dir)))
            accelerator.register_load_state_pre_hook(lambda models, in_dir: self.load(Path(in_dir)))

    def decay(self, step: int) -> float:
        return self.base**self.every * (step / self.total) ** 3

    @torch.no_grad()
    def step(self) -> None:
        """After each update; an update fp16 loss scaling skipped is not counted."""
        if not self.every or self.accelerator.optimizer_step_was_skipped:
            return
        self.steps += 1
        if self.steps % self.every == 0:
            torch._foreach_lerp_(self.slow, self.live, 1.0 - self.decay(self.steps))
            torch._foreach_copy_(self.live, self.slow)
        elif self.steps == self.total:  # the end of the run: the weights become the average
            torch._foreach_copy_(self.live, self.slow)

    def save(self, checkpoint_dir: Path) -> None:
        """Rank 0's slow copy (every rank resumes from it, as every rank starts from rank 0's model)."""
        tensors = {f"slow.{i}": t for i, t in enumerate(self.slow)}
        save_tensors(self.is_main, {**tensors, "steps": torch.tensor([self.steps])}, checkpoint_dir / STATE_FILE)

    def load(self, checkpoint_dir: Path) -> None:
        path = checkpoint_dir / STATE_FILE
        state = load_tensors(
            checkpoint_dir,
            STATE_FILE,
            "(the Lookahead weight average), so it was written without "
            "averaging or by an older version. Resume it with --lookahead-every 0",
        )
        if len(state) != len(self.slow) + 1:
            raise RecipeError(
                f"{path} holds {len(state) - 1} averaged tensors, this model has {len(self.slow)}: "
                "the checkpoint belongs to another model. Resume with the run's own settings."
            )
        self.steps = int(state["steps"][0])
        torch._foreach_copy_(self.slow, [state[f"slow.{i}"].to(s.device, s.dtype) for i, s in enumerate(self.slow)])
