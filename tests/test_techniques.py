"""The accuracy techniques on small generated data: weight EMA, whitening init, LR schedule, flip TTA,
and an exact resume with the EMA switched on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from common.augment import BatchTransform
from common.ema import WeightEMA
from common.metrics import evaluate
from common.models import CifarCNN, init_whitening
from common.schedule import build_scheduler, lr_multiplier
from conftest import check_ok, launch, read_jsonl, run_in_process, stopped_at


class _Acc:
    """The two Accelerator methods WeightEMA uses, for a plain single-process model."""

    num_processes = 1

    def __init__(self):
        self.registered = []

    def unwrap_model(self, model):
        return model

    def register_for_checkpointing(self, obj):
        self.registered.append(obj)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


def test_ema_follows_the_formula_with_warmup_and_checkpoints():
    acc, model = _Acc(), _model()
    ema = WeightEMA(acc, model, decay=0.9)
    assert acc.registered == [ema] and ema.for_eval(model) is ema.module
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for n in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(4, 1, 6, 6))  # moves the BatchNorm running stats and counter
        ema.update(model)
        d = min(0.9, (1 + n) / (10 + n))  # warm-up: 0.2, 0.27, ... then 0.9
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                expected[k] = d * expected[k] + (1 - d) * v.float()
            else:
                expected[k] = v.clone()
    got = ema.module.state_dict()
    for k in expected:
        assert torch.allclose(got[k].to(expected[k].dtype), expected[k], rtol=1e-5, atol=1e-6), k
    assert ema.module[1].num_batches_tracked.item() == 29
    assert all(not p.requires_grad for p in ema.module.parameters())
    # round trip through the checkpoint state
    fresh = WeightEMA(_Acc(), _model(), decay=0.9)
    fresh.load_state_dict(ema.state_dict())
    assert fresh.updates == 29 and all(torch.equal(a, b) for a, b in
                                       zip(fresh.module.state_dict().values(), got.values()))


def test_ema_off_is_the_model_itself():
    acc, model = _Acc(), _model()
    ema = WeightEMA(acc, model, decay=0.0)
    ema.update(model)
    assert ema.module is None and ema.for_eval(model) is model and acc.registered == []


def test_whitening_init_decorrelates_patches():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 1, 16, 16, generator=g)
    images = torch.cat([base, 0.5 * base + 0.1 * torch.randn(64, 1, 16, 16, generator=g),
                        torch.randn(64, 1, 16, 16, generator=g)], 1)  # correlated channels
    images = nn.functional.avg_pool2d(images, 3, 1, 1)  # correlated neighbouring pixels
    conv = nn.Conv2d(3, 24, 3, bias=False)
    before = conv.weight.clone()
    n = init_whitening(conv, images, eps=1e-6)
    assert n == 24
    out = nn.functional.conv2d(images.double(), conv.weight[:12].double())  # the 12 whitening filters
    cov = torch.cov(out.permute(1, 0, 2, 3).reshape(12, -1))
    assert torch.allclose(cov, torch.eye(12, dtype=cov.dtype), atol=0.05)  # unit variance, uncorrelated
    assert torch.equal(conv.weight[12:], -conv.weight[:12])  # each filter paired with its negation
    wide = nn.Conv2d(3, 64, 3, bias=False)
    keep = wide.weight[54:].clone()
    assert init_whitening(wide, images) == 54 and torch.equal(wide.weight[54:], keep)  # 27-dim patches
    assert not torch.equal(before, conv.weight)


def test_whitening_init_on_the_cifar_model_trains_a_step():
    model = CifarCNN((3, 16, 16), 4, widths=(8, 16, 16))
    images = torch.rand(32, 3, 16, 16)
    init_whitening(model.features[0], images)
    loss = nn.functional.cross_entropy(model(images), torch.arange(32) % 4)
    loss.backward()
    assert math.isfinite(loss.item()) and model.features[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(kind):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)

    class Cfg:
        epochs, warmup_fraction, schedule = 2, 0.2, kind

    sched, total = build_scheduler(opt, Cfg, steps_per_epoch=10), 20
    trace = []
    for _ in range(total):
        trace.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert trace[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # 4 warm-up steps up to the peak
    assert max(trace) == pytest.approx(0.4)
    tail = trace[4:]
    if kind == "constant":
        assert tail == pytest.approx([0.4] * 16)
    else:
        assert all(a >= b for a, b in zip(tail, tail[1:])) and tail[-1] < 0.05
        assert lr_multiplier(total, total, 4, kind) == pytest.approx(0.0, abs=1e-12)
    if kind == "cosine":
        assert lr_multiplier(12, 20, 4, kind) == pytest.approx(0.5)  # halfway through the decay


class _Mirror(nn.Module):
    """Logits that depend on which half of the image is bright: a flip swaps classes 0 and 1."""

    def forward(self, x):
        left, right = x[..., : x.shape[-1] // 2].mean((1, 2, 3)), x[..., x.shape[-1] // 2:].mean((1, 2, 3))
        return torch.stack([left, right, 0.25 * (left + right)], 1) * 10


def test_flip_tta_averages_each_image_with_its_mirror():
    from accelerate import Accelerator

    from common.data import ImageSplit, make_loader

    imgs = torch.zeros(6, 1, 4, 4, dtype=torch.uint8)
    imgs[:3, :, :, :2] = 255  # bright left half: class 0 without TTA
    imgs[3:, :, :, 2:] = 255
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    acc = Accelerator(cpu=True)
    loader = acc.prepare(make_loader(ImageSplit(imgs, labels), 4, False))
    t = BatchTransform([0.0], [1.0])
    plain = evaluate(acc, _Mirror(), loader, t, 3)
    tta = evaluate(acc, _Mirror(), loader, t, 3, tta_flip=True)
    assert plain["accuracy"] == 1.0 and plain["count"] == 6
    # averaged with the mirror image, the left/right logits tie and the third class (their mean) ties too:
    # argmax picks class 0 for all, so exactly the three class-0 images stay right
    assert tta["accuracy"] == pytest.approx(0.5) and tta["count"] == 6
    x = t.eval(imgs).float()
    manual = 0.5 * (_Mirror()(x) + _Mirror()(x.flip(3)))
    expected_loss = nn.functional.cross_entropy(manual, labels).item()
    assert tta["loss"] == pytest.approx(expected_loss, rel=1e-6)


@pytest.mark.parametrize("nproc", [1, 2])
def test_cifar_resume_with_ema_and_whitening_is_exact(nproc, tmp_path, env, reference_run):
    """Stopped after 3 optimizer steps and resumed: the EMA weights (what final/ holds) and the per-step
    losses equal the uninterrupted reference run's (--ema-decay 0.9, --checkpoint-every 3), so the
    average is checkpointed and restored. 1 process: stopped by --max-steps 3, in this process.
    2 processes (real gloo processes): resumed from the reference run's own step-3 checkpoint."""
    ref = reference_run("cifar_cnn", nproc)
    args, full, part = ref.train_args, ref.run, tmp_path / "part"
    assert "--ema-decay" in args and "--checkpoint-every" in args
    if nproc == 1:
        check_ok(run_in_process("cifar_cnn", [*args, "--output-dir", part, "--max-steps", 3], env))
        resume = run_in_process("cifar_cnn", [*args, "--output-dir", part, "--resume-from", "latest"], env)
    else:
        stopped_at(full, 3, part)
        resume = launch("cifar_cnn", [*args, "--output-dir", part, "--resume-from", "latest"], env, nproc=nproc)
    assert "epoch 1, batch 3, step 3" in check_ok(resume).stdout
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(part / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loss = [(r["step"], r["train/loss"]) for r in read_jsonl(full / "metrics.jsonl") if "train/loss" in r]
    assert loss == [(r["step"], r["train/loss"]) for r in read_jsonl(part / "metrics.jsonl") if "train/loss" in r]
    summary = json.loads((full / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["global_step"] == loss[-1][0] > 3
    # final/ holds the average, not the last trained weights: they differ from the checkpoint's model
    from common.checkpoint import find_latest

    trained = load_file(str(find_latest(full) / "model.safetensors"))
    assert any(not torch.equal(trained[k], a[k]) for k in a if k in trained)


def test_cifar_recipe_takes_digits_made_cifar_shaped(tmp_path, env, mnist_like):
    """The check README describes on real MNIST, here on generated 1x28x28 images: --channels 3
    --image-size 32 turns them into CIFAR-shaped images and the CIFAR recipe learns them. (These classes
    differ only by where a bright block sits, which a global-max-pool model sees only through the image
    border, so the bar is well above chance rather than near 100%.)"""
    run = tmp_path / "run"
    check_ok(run_in_process("cifar_cnn", ["--dataset", mnist_like, "--channels", 3, "--image-size", 32, "--no-flip",
                                  "--no-tta", "--widths", "8,16,16", "--epochs", 6, "--batch-size", 32, "--lr", 0.05, "--ema-decay", 0.9,
                                  "--output-dir", run], env))
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["input_shape"] == [3, 32, 32]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["test/accuracy"] >= 0.6, summary["final"]  # chance: 0.25
