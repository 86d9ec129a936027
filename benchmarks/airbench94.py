"""airbench94 (Keller Jordan, arXiv 2404.00498) in plain PyTorch, written fresh from the paper: what the record
method reaches, beside recipes/cifar_cnn.py, which adopts it through Accelerate. A baseline for benchmarks, not a
recipe: one process, no checkpoints, data on the device. The data is the recipe's (its decoded cache, its seeded
hold-out, --val-fraction; 0 reports the test split).

The method, as the paper gives it: the whole set normalised, half of it pre-flipped and all of it reflect-padded
once; per epoch one random translation (up to 2 px) per image, the whole set mirrored in every other epoch (the
alternating flip), a random order, batches of 1024 (the last partial one dropped); a frozen 2x2 whitening conv
from the patch covariance of 5,000 training images (its bias trained 3 epochs); three conv groups 64-256-256 of
conv-pool-BN-GELU-conv-BN-GELU, dirac-initialised, BatchNorm scale frozen (eps 1e-12, momentum 0.4); max-pool 3
and a linear head x 1/9; SGD Nesterov 0.85 on the summed loss, lr 11.5 and weight decay 0.0153 per 1024 images in
the paper's decoupled units, BatchNorm biases at 64x the LR; warm-up from 0.2 over 23% of the steps, then linear
to 0.07; label smoothing 0.2; Lookahead every 5 steps (decay 0.95^5 (step/total)^3), the average copied back at
the end; 9.9 epochs; 6-view test-time augmentation. fp16 autocast on a GPU, channels_last; on a CPU bf16 autocast
where the CPU has it natively, else fp32. Timed as the paper times it: training, then one evaluation.

    python benchmarks/airbench94.py --dataset ../shared/data/cifar10 --seeds 1,2,3
    python benchmarks/time_to_accuracy.py --recipe cifar_cnn --dataset ../shared/data/cifar10 --target baseline \\
        --baseline-kind airbench94
"""

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import REPO, bad_input, machine_line, provenance, save, warn_if_busy  # first: the repo on sys.path
from launching import recipe_config
from torch import nn

from common.data.decoded import load_image_data
from common.errors import RecipeError
from common.train.accelerator import cpu_bf16_support

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's, as the paper uses
HYP = dict(
    epochs=9.9,
    batch_size=1024,
    lr=11.5,
    momentum=0.85,
    weight_decay=0.0153,
    bias_scaler=64.0,
    label_smoothing=0.2,
    whiten_bias_epochs=3,
    translate=2,
    widths=(64, 256, 256),
    bn_momentum=0.6,
    scale=1 / 9,
    lookahead_every=5,
    foreach=None,  # torch's default: the multi-tensor SGD on a GPU, a loop over the parameters on a CPU
)


class BatchNorm(nn.BatchNorm2d):
    def __init__(self, channels: int):
        super().__init__(channels, eps=1e-12, momentum=1 - HYP["bn_momentum"])
        self.weight.requires_grad = False  # scale frozen at 1; the bias learns


class Conv(nn.Conv2d):
    def __init__(self, cin: int, cout: int):
        super().__init__(cin, cout, kernel_size=3, padding="same", bias=False)

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.dirac_(self.weight.data[: self.weight.size(1)])  # the first cin filters pass their input through


class ConvGroup(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1, self.pool, self.norm1 = Conv(cin, cout), nn.MaxPool2d(2), BatchNorm(cout)
        self.conv2, self.norm2, self.activ = Conv(cout, cout), BatchNorm(cout), nn.GELU()

    def forward(self, x):
        x = self.activ(self.norm1(self.pool(self.conv1(x))))
        return self.activ(self.norm2(self.conv2(x)))


class Head(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.pool, self.linear = nn.MaxPool2d(3), nn.Linear(width, classes, bias=False)

    def forward(self, x):
        return self.linear(self.pool(x).flatten(1)) * HYP["scale"]


def make_net(classes: int) -> nn.Sequential:
    w1, w2, w3 = HYP["widths"]
    whiten = nn.Conv2d(3, 2 * 3 * 2 * 2, kernel_size=2, padding=0, bias=True)
    whiten.weight.requires_grad = False
    # The record's code zeroes every conv bias at init (its Conv.reset_parameters), this one included: torch's
    # random init would start the whitened channels off-centre before GELU, a difference from the method.
    nn.init.zeros_(whiten.bias)
    return nn.Sequential(whiten, nn.GELU(), ConvGroup(24, w1), ConvGroup(w1, w2), ConvGroup(w2, w3), Head(w3, classes))


@torch.no_grad()
def init_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Filters = eigenvectors of the 2x2 patch covariance scaled by 1/sqrt(eigenvalue + eps), and their negatives."""
    c, (h, w) = images.shape[1], conv.weight.shape[2:]
    patches = images.unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, c, h, w).float()
    flat = patches.view(len(patches), -1)
    eigenvalues, eigenvectors = torch.linalg.eigh(flat.T @ flat / len(flat), UPLO="U")
    eigenvalues, eigenvectors = (
        eigenvalues.flip(0).view(-1, 1, 1, 1),
        eigenvectors.T.reshape(c * h * w, c, h, w).flip(0),
    )
    scaled = eigenvectors / torch.sqrt(eigenvalues + eps)
    conv.weight.data[:] = torch.cat((scaled, -scaled)).to(conv.weight.dtype)


def normalize(images_uint8: torch.Tensor) -> torch.Tensor:
    mean, std = (torch.tensor(v, device=images_uint8.device).view(1, 3, 1, 1) for v in (MEAN, STD))
    return (images_uint8.float() / 255 - mean) / std


def batch_crop(padded: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """One random translation of up to r pixels per image (r = the padding), as a masked copy per shift."""
    r = (padded.size(-1) - size) // 2
    shifts = torch.randint(-r, r + 1, (len(padded), 2), device=padded.device, generator=gen)
    out = torch.empty((len(padded), padded.size(1), size, size), device=padded.device, dtype=padded.dtype)
    for sy in range(-r, r + 1):
        for sx in range(-r, r + 1):
            mask = (shifts[:, 0] == sy) & (shifts[:, 1] == sx)
            out[mask] = padded[mask, :, r + sy : r + sy + size, r + sx : r + sx + size]
    return out


def epoch_batches(padded, labels, size: int, epoch: int, gen: torch.Generator):
    images = batch_crop(padded, size, gen)
    if epoch % 2 == 1:  # the alternating flip: the pre-flipped set, all mirrored in every other epoch
        images = images.flip(-1)
    order = torch.randperm(len(images), device=images.device, generator=gen)
    for i in range(len(images) // HYP["batch_size"]):
        idx = order[i * HYP["batch_size"] : (i + 1) * HYP["batch_size"]]
        yield images[idx], labels[idx]


class Lookahead:
    def __init__(self, net: nn.Module):
        self.slow = {k: v.clone() for k, v in net.state_dict().items()}

    @torch.no_grad()
    def update(self, net: nn.Module, decay: float) -> None:
        for slow, live in zip(self.slow.values(), net.state_dict().values()):
            if live.dtype.is_floating_point:
                slow.lerp_(live, 1 - decay)
                live.copy_(slow)


@torch.no_grad()
def evaluate(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast) -> dict:
    """Accuracy without and with the 6-view TTA: mirror, and the mirrored pair shifted by one pixel both ways."""
    net.eval()

    def mirror(x):
        return 0.5 * net(x) + 0.5 * net(x.flip(-1))

    plain, tta = [], []
    with autocast():
        for x in images.split(1000):
            padded, n = F.pad(x, (1,) * 4, "reflect"), x.shape[-1]
            shifted = torch.stack([mirror(padded[:, :, :n, :n]), mirror(padded[:, :, 2:, 2:])]).mean(0)
            plain.append(net(x).float())
            tta.append((0.5 * mirror(x) + 0.5 * shifted).float())
    return {
        "accuracy": (torch.cat(plain).argmax(1) == labels).float().mean().item(),
        "accuracy_tta": (torch.cat(tta).argmax(1) == labels).float().mean().item(),
    }


def train_once(train_images, train_labels, val_images, val_labels, seed: int, device, classes: int) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    cuda = device.type == "cuda"  # fp16 autocast on a GPU (the paper keeps the weights in fp16 instead)
    half = torch.float16 if cuda else torch.bfloat16 if cpu_bf16_support() else None
    autocast_fn = (lambda: torch.autocast(device.type, dtype=half)) if half else contextlib.nullcontext

    net = make_net(classes).to(device).to(memory_format=torch.channels_last)
    train, val = normalize(train_images.to(device)), normalize(val_images.to(device))
    init_whitening(net[0], train[:5000])
    flip = torch.rand(len(train), device=device, generator=gen) < 0.5  # pre-flip half of the images, once
    train = torch.where(flip.view(-1, 1, 1, 1), train.flip(-1), train)
    padded = F.pad(train, (HYP["translate"],) * 4, "reflect")
    labels, size = train_labels.to(device), train.shape[-1]

    kilostep_scale = 1024 * (1 + 1 / (1 - HYP["momentum"]))
    lr = HYP["lr"] / kilostep_scale  # for the summed loss
    wd = HYP["weight_decay"] * HYP["batch_size"] / kilostep_scale
    lr_biases = lr * HYP["bias_scaler"]
    norm_biases = [p for k, p in net.named_parameters() if "norm" in k and p.requires_grad]
    others = [p for k, p in net.named_parameters() if "norm" not in k and p.requires_grad]
    optimizer = torch.optim.SGD(
        [
            dict(params=norm_biases, lr=lr_biases, weight_decay=wd / lr_biases),
            dict(params=others, lr=lr, weight_decay=wd / lr),
        ],
        momentum=HYP["momentum"],
        nesterov=True,
        foreach=HYP["foreach"],
    )
    steps_per_epoch = len(train) // HYP["batch_size"]
    if not steps_per_epoch:
        bad_input(f"{len(train)} training images make no batch of {HYP['batch_size']}: use a larger dataset.")
    total = math.ceil(steps_per_epoch * HYP["epochs"])
    warmup = int(total * 0.23)

    def lr_multiplier(step):
        if step < warmup:
            return 0.2 + 0.8 * step / warmup
        return 1.0 - 0.93 * (step - warmup) / (total - warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier)
    alpha = 0.95 ** HYP["lookahead_every"] * (torch.arange(total + 1) / total) ** 3
    lookahead = Lookahead(net)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0, step, curve = time.perf_counter(), 0, []
    for epoch in range(math.ceil(HYP["epochs"])):
        net[0].bias.requires_grad = epoch < HYP["whiten_bias_epochs"]
        net.train()
        for x, y in epoch_batches(padded, labels, size, epoch, gen):
            with autocast_fn():
                out = net(x)
            loss = F.cross_entropy(out.float(), y, label_smoothing=HYP["label_smoothing"], reduction="sum")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % HYP["lookahead_every"] == 0:
                lookahead.update(net, decay=alpha[step].item())
            if step >= total:
                lookahead.update(net, decay=1.0)  # the weights become the average
                break
        curve.append(round(time.perf_counter() - t0, 2))
    sync()
    train_s = time.perf_counter() - t0
    result = evaluate(net, val, val_labels.to(device), autocast_fn)
    sync()
    eval_s = time.perf_counter() - t0 - train_s
    return {
        "seed": seed,
        "train_s": round(train_s, 2),
        "eval_s": round(eval_s, 2),
        "steps": total,
        "epoch_end_s": curve,
        **result,
    }


def train_on(train, held, seed: int, device) -> dict:
    """train_once on two ImageSplits (the recipe's training and held-out data), the classes from their labels."""
    classes = int(max(train.labels.max(), held.labels.max())) + 1
    return train_once(train.images, train.labels, held.images, held.labels, seed, device, classes)


def load(dataset: str, seed: int, val_fraction: float):
    """The recipe's data for this seed: (train, held out) ImageSplits, held out = its validation split, or with
    --val-fraction 0 the dataset's test split."""
    cfg = recipe_config("cifar_cnn", ["--dataset", dataset, "--seed", str(seed), "--val-fraction", str(val_fraction)])
    try:
        data = load_image_data(cfg, cfg.dataset, True)
    except RecipeError as err:
        bad_input(str(err))
    held = data.val if data.val is not None else data.test
    if held is None:
        bad_input(
            f"{dataset} has no test split to report with --val-fraction 0. Hold out a validation part of the "
            "training split instead (--val-fraction 0.1)."
        )
    return data.train, held


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="uoft-cs/cifar10", help="a CIFAR-10 layout dataset (folder or Hub id)")
    p.add_argument("--seeds", default="1", help="comma-separated; each draws the hold-out as the recipe's --seed does")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out of the training split, as the recipe")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--epochs", type=float, default=HYP["epochs"], help="the paper's 9.9; fewer for a smoke test")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "airbench94.json")
    args = p.parse_args(argv)
    HYP["epochs"] = args.epochs
    device, rows, load_start = torch.device(args.device), [], warn_if_busy()
    for seed in [int(s) for s in args.seeds.split(",")]:
        train, held = load(args.dataset, seed, args.val_fraction)
        rows.append(r := train_on(train, held, seed, device))
        print(
            f"seed {seed}: {r['accuracy_tta']:.4f} with TTA ({r['accuracy']:.4f} without) on {len(held)} held-out "
            f"images; training {r['train_s']:.1f} s ({r['steps']} steps), evaluation {r['eval_s']:.1f} s",
            flush=True,
        )
    report = {
        **provenance("airbench94", argv, device, load_start),
        "dataset": args.dataset,
        "val_fraction": args.val_fraction,
        "rows": rows,
        "hyp": HYP,
    }
    tta = [r["accuracy_tta"] for r in rows]
    print(
        f"mean {statistics.mean(tta):.4f} over {len(tta)} seed(s), min {min(tta):.4f}, max {max(tta):.4f}\n"
        f"{machine_line(report['machine'])}"
    )
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
