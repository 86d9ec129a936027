"""The three models, each built from the data's shape (channels, height, width) and class count."""

from __future__ import annotations

import torch
from torch import nn

from common.errors import ConfigError, DataError

RESIZE_HINT = (
    "Pass --image-size N to resize the images (and --channels 1 or 3), or pick the recipe whose model fits the data."
)


def need_side(model: str, side: int, h: int, w: int) -> None:
    """Images smaller than ``side`` pixels would be pooled away before the head: one paragraph instead."""
    if h < side or w < side:
        raise DataError(
            f"The data can't feed this model: {model} needs images of at least {side}x{side} pixels, got {h}x{w}. "
            f"{RESIZE_HINT}"
        )


class MLP(nn.Module):
    """Flatten -> hidden layers (Linear, ReLU, Dropout) -> Linear. hidden=(512,) is the classic one-layer MLP."""

    def __init__(self, in_shape, num_classes: int, hidden=(512,), dropout: float = 0.0):
        super().__init__()
        layers, width = [nn.Flatten()], in_shape[0] * in_shape[1] * in_shape[2]
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def conv_bn(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class ConvNet(nn.Module):
    """Two blocks of ``depth`` conv-BN-ReLU layers, each block ending in a 2x2 maxpool, then a linear
    head (depth 1 is the classic two-conv MNIST net). The second block has twice the channels of the first."""

    def __init__(self, in_shape, num_classes: int, width: int = 32, dropout: float = 0.0, depth: int = 1):
        super().__init__()
        c, h, w = in_shape
        need_side("ConvNet", 4, h, w)
        layers, c_in = [], c
        for c_out in (width, 2 * width):
            for _ in range(depth):
                layers += conv_bn(c_in, c_out)
                c_in = c_out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * (h // 4) * (w // 4), num_classes)
        )

    def forward(self, x):
        return self.head(self.features(x))


class LeanConvNet(nn.Module):
    """A fast MNIST net: a 5x5 conv and a 3x3 conv (no padding), each followed at once by a 2x2 maxpool, then
    BatchNorm and ReLU on the pooled map, then a hidden linear layer and the head. Pooling straight after
    each conv keeps the work on small maps: at width 24 it costs about 10 MFLOP per 28x28 training image
    (forward + backward), 1/24 of ConvNet(width 48, depth 2)."""

    def __init__(self, in_shape, num_classes: int, width: int = 24, hidden: int = 256, dropout: float = 0.0):
        super().__init__()
        c, h, w = in_shape
        need_side("LeanConvNet", 14, h, w)
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 5, bias=False),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, bias=False),
            nn.MaxPool2d(2),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
        )
        size = (((h - 4) // 2 - 2) // 2) * (((w - 4) // 2 - 2) // 2)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * size, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.head(self.features(x))


class FrozenScaleBatchNorm(nn.BatchNorm2d):
    """BatchNorm with its scale fixed at 1 and only the bias trained (airbench): the following conv is
    scale-invariant anyway, so the scale only slows learning. eps 1e-12 and momentum 0.4 (torch's
    convention: the weight of the new batch) track the fast-moving weights of a short run."""

    def __init__(self, num_features: int, momentum: float = 0.4, eps: float = 1e-12):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.weight.requires_grad_(False)


class DiracConv(nn.Conv2d):
    """3x3 'same' conv whose first ``in_channels`` filters start as the identity (dirac init), so each
    block starts close to passing its input through: fewer epochs to the same accuracy (airbench's
    ablation: about -15% time)."""

    def __init__(self, c_in: int, c_out: int, dirac: bool = True):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)
        if dirac:  # else torch's default (Kaiming uniform) init
            with torch.no_grad():
                nn.init.dirac_(self.weight[: min(c_in, c_out)])


class ConvGroup(nn.Module):
    """conv -> 2x2 maxpool -> BN -> GELU -> conv -> BN -> GELU (BN and GELU after the pool: 4x less work)."""

    def __init__(self, c_in: int, c_out: int, bn_momentum: float, dirac: bool = True):
        super().__init__()
        self.conv1, self.pool = DiracConv(c_in, c_out, dirac), nn.MaxPool2d(2)
        self.norm1, self.conv2 = FrozenScaleBatchNorm(c_out, bn_momentum), DiracConv(c_out, c_out, dirac)
        self.norm2, self.act = FrozenScaleBatchNorm(c_out, bn_momentum), nn.GELU()

    def forward(self, x):
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class CifarCNN(nn.Module):
    """The network of airbench94 (Keller Jordan, arXiv 2404.00498), the fastest known CIFAR-10 trainer:
    a 2x2 'whitening' conv (frozen weights set from the data by ``init_whitening``, a trained bias), GELU,
    three ConvGroups, a global max pool and a linear head scaled by 1/9. 0.71 GFLOP per 32x32 training
    image (forward + backward)."""

    def __init__(
        self,
        in_shape,
        num_classes: int,
        widths=(64, 256, 256),
        bn_momentum: float = 0.4,
        head_scale: float = 1 / 9,
        dirac: bool = True,
    ):
        super().__init__()
        c, h, w = in_shape
        need_side("CifarCNN", 16, h, w)
        self.whiten = nn.Conv2d(c, 2 * c * 2 * 2, 2, padding=0, bias=True)  # every eigenvector of 2x2 patches, +-
        self.whiten.weight.requires_grad_(False)  # set by init_whitening; the bias trains
        self.act = nn.GELU()
        groups, c_in = [], self.whiten.out_channels
        for width in widths:
            groups.append(ConvGroup(c_in, width, bn_momentum, dirac))
            c_in = width
        self.groups = nn.Sequential(*groups)
        self.head = nn.Linear(c_in, num_classes, bias=False)
        self.head_scale = head_scale

    def forward(self, x):
        x = self.groups(self.act(self.whiten(x)))
        return self.head(x.amax(dim=(2, 3))) * self.head_scale  # global max pool


def parse_ints(text: str, flag: str = "") -> tuple[int, ...]:
    """'64,256,256' -> (64, 256, 256); config fields stay scalar so they log as hparams. ``flag`` names
    the option in the error."""
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(
            f"{flag or 'the value'} {text!r} is not a comma-separated list of positive integers; pass e.g. 64,256,256."
        )
    return values


def parse_floats(text: str, flag: str = "", count: int = 0) -> tuple[float, ...]:
    """'0.9,0.999' -> (0.9, 0.999); ``count`` > 0 demands exactly that many values."""
    try:
        values = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or (count and len(values) != count):
        raise ConfigError(
            f"{flag or 'the value'} {text!r} is not a comma-separated list of "
            f"{count or 'some'} numbers; pass e.g. {','.join(['0.9', '0.999'][: count or 2])}."
        )
    return values


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> int:
    """Whitening init of the first conv, as in the fast CIFAR-10 trainers: its filters become the
    eigenvectors of the (uncentred) covariance of the k x k patches of ``images`` (a normalized float
    batch N, C, H, W), each scaled by 1/sqrt(eigenvalue + eps) and paired with its negation, so a GELU
    after it keeps both signs. Filters beyond 2 x (patch dimension) keep their init. Returns the number
    of filters set."""
    k = conv.kernel_size[0]
    c = images.shape[1]
    patches = nn.functional.unfold(images.float(), k)  # torch's im2col: N, C*k*k, H'*W' (channel, row, column)
    patches = patches.transpose(1, 2).reshape(-1, c * k * k).double()
    eigvals, eigvecs = torch.linalg.eigh(patches.T @ patches / len(patches))  # ascending
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    n = min(conv.out_channels // 2, eigvecs.shape[1])
    filters = (eigvecs[:, :n].T / torch.sqrt(eigvals[:n].clamp_min(0) + eps)[:, None]).reshape(n, c, k, k)
    conv.weight[: 2 * n].copy_(torch.cat([filters, -filters]).to(conv.weight.dtype))
    if conv.bias is not None:
        conv.bias[: 2 * n].zero_()
    return 2 * n


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose batch statistics span all processes, for gloo/CPU where torch's SyncBatchNorm
    refuses to run. Statistics are all-reduced with the differentiable all_reduce, so gradients
    match BatchNorm over the global batch."""

    def forward(self, x):
        import torch.distributed as dist

        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        c = x.shape[1]
        xf = x.float()
        count = torch.full((1,), xf.numel() / c, device=x.device, dtype=xf.dtype)  # a fill: no copy from the host
        stats = all_reduce(torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count]))
        total = stats[-1]
        mean = stats[:c] / total
        var = stats[c : 2 * c] / total - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * total / (total - 1), alpha=m)
        y = (xf - mean.view(1, c, 1, 1)) * torch.rsqrt(var.view(1, c, 1, 1) + self.eps)
        if self.affine:
            y = y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)
        return y.to(x.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Before ``accelerator.prepare``: torch's SyncBatchNorm on GPUs, CPUSyncBatchNorm on CPU."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, CPUSyncBatchNorm):
            new = CPUSyncBatchNorm(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            new.load_state_dict(child.state_dict())
            if child.affine:  # a frozen scale stays frozen
                new.weight.requires_grad_(child.weight.requires_grad)
                new.bias.requires_grad_(child.bias.requires_grad)
            setattr(model, name, new)
        else:
            convert_sync_batchnorm(child, device)
    return model
