"""Batch preprocessing and augmentation on the device, on whole uint8 batches; MixUp and CutMix on the normalised
batch (``batch_mix``, ``mixed``).

Randomness is stateless: each batch's draws come from a generator seeded with
(seed, epoch, step, rank), on the device the batch is on (a GPU draws its own numbers: no host-to-device
copy, no sync). The same run gives the same pixels; every epoch and every rank differ; and a run
resumed mid-epoch draws exactly what the uninterrupted run drew, with no RNG state to save.

The alternating flip (airbench) is not here but in the loader (``common.data.decoded.TensorImages``): it needs
each image's index in the dataset.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def batch_generator(seed: int, epoch: int, step: int, rank: int, device="cpu") -> torch.Generator:
    # Mix the four numbers into one 63-bit seed (splitmix-style odd multipliers keep them apart).
    mixed = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB + rank * 0x2545F4914F6CDD1D
    ) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(mixed)


def normalize(images: torch.Tensor, mean, std, channels_last: bool = False) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 normalized, on whatever device ``images`` is. ``mean``/``std``:
    lists, or tensors already on that device (a list costs a host-to-device copy, which syncs a GPU:
    ``BatchTransform`` keeps them as device tensors)."""
    x = images.float().div_(255.0)
    mean_t, std_t = (torch.as_tensor(v, dtype=x.dtype, device=x.device) for v in (mean, std))
    if mean_t.dim() != 4:  # BatchTransform's are shaped (1, C, 1, 1) once: a view is an op dispatched per batch
        mean_t, std_t = mean_t.view(1, -1, 1, 1), std_t.view(1, -1, 1, 1)
    x = (x - mean_t) / std_t
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def random_translate(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Each image shifted by its own (dy, dx) in [-pad, pad], edges filled by reflection
    (the same as a random crop of the reflect-padded image)."""
    if pad <= 0:
        return x
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    offs = torch.randint(0, 2 * pad + 1, (2, n, 1, 1, 1), generator=gen, device=gen.device).to(x.device)
    batch, chans, down, across = _grid(n, c, h, w, x.device)
    return padded[batch, chans, offs[0] + down, offs[1] + across]


@functools.lru_cache(maxsize=16)
def _grid(n: int, c: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The index grids of ``random_translate``, shaped to broadcast to (n, c, h, w), made once per batch shape: an
    arange and a view are ops dispatched at every batch otherwise (on a GPU, launches the host pays for)."""
    return (
        torch.arange(n, device=device).view(n, 1, 1, 1),
        torch.arange(c, device=device).view(1, c, 1, 1),
        torch.arange(h, device=device).view(1, 1, h, 1),
        torch.arange(w, device=device).view(1, 1, 1, w),
    )


def random_flip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image mirrored left-right with probability 1/2."""
    flip = (torch.rand(x.shape[0], generator=gen, device=gen.device) < 0.5).to(x.device)
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)


class BatchTransform:
    """What happens to a uint8 batch on the device before the model sees it."""

    def __init__(self, mean, std, translate: int = 0, flip: bool = False, channels_last: bool = False):
        self.mean, self.std = mean, std  # lists: what model.json records
        self.translate, self.flip, self.channels_last = translate, flip, channels_last
        self._on_device = {}

    def _stats(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and std as (1, C, 1, 1) tensors on ``device``, copied there once (not at every batch)."""
        if device not in self._on_device:
            self._on_device[device] = tuple(
                torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (self.mean, self.std)
            )
        return self._on_device[device]

    def eval(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, *self._stats(images.device), self.channels_last)

    def train(self, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        x = normalize(images, *self._stats(images.device))
        if self.translate:
            x = random_translate(x, self.translate, gen)
        if self.flip:
            x = random_flip(x, gen)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


def channel_stats(split, max_images: int = 10000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (in [0, 1] units) of the first ``max_images`` uint8 images of a split
    (``common.data.decoded.ImageSplit``, read without copying the rest) or of an image tensor."""
    images = split.images_at(slice(0, max_images)) if hasattr(split, "images_at") else split[:max_images]
    x = images.float().div_(255.0)
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return mean.tolist(), std.tolist()


def batch_mix(mixup: float, cutmix: float, num_classes: int):
    """torchvision's MixUp and/or CutMix (one of the two per batch when both are on); None when both are off."""
    from torchvision.transforms import v2

    mixes = ([v2.MixUp(alpha=mixup, num_classes=num_classes)] if mixup else []) + (
        [v2.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix else []
    )
    return None if not mixes else mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


def mixed(mix, images: torch.Tensor, labels: torch.Tensor, gen: torch.Generator):
    """``mix`` applied to a batch, its draws seeded from the batch's generator (torchvision draws from torch's
    global generator: forked here, so the run's own stream is untouched and a resumed run draws the same)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(gen.initial_seed())  # the CPU one only (no lazy CUDA seeding)
        return mix(images, labels)
