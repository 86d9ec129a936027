"""The accuracy techniques on small generated data: Lookahead averaging, bias LR groups, whitening init,
LR schedule, test-time augmentation, the alternating flip, and an exact resume with averaging on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from common.averaging import Lookahead
from common.data.augment import BatchTransform
from common.models import CifarCNN, init_whitening
from common.optimizers import sgd_with_bias_groups
from common.schedules import build_scheduler, lr_multiplier
from common.train.metrics import evaluate, tta_logits

from helpers import check_ok, import_recipe, launch, read_jsonl, run_in_process, stopped_at


class _Acc:
    """What Lookahead uses of an Accelerator, for a plain single-process model."""

    num_processes, is_main_process, optimizer_step_was_skipped = 1, True, False

    def __init__(self):
        self.save_hooks, self.load_hooks = [], []

    def unwrap_model(self, model, keep_torch_compile=True):
        return model

    def register_save_state_pre_hook(self, hook):
        self.save_hooks.append(hook)

    def register_load_state_pre_hook(self, hook):
        self.load_hooks.append(hook)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


def test_lookahead_follows_the_formula_and_checkpoints(tmp_path):
    """Every 5 steps slow <- lerp(slow, weights, 1 - 0.95**5 * (t/T)**3) and weights <- slow, BatchNorm
    statistics included; at the last planned step the weights become the average; the state round-trips
    through a safetensors file in the checkpoint folder (no pickle)."""
    acc, model, total = _Acc(), _model(), 23
    avg = Lookahead(acc, model, total_steps=total)
    assert len(acc.save_hooks) == len(acc.load_hooks) == 1
    slow = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    for t in range(1, total + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(4, 1, 6, 6))  # moves the BatchNorm running stats
        before = {k: v.clone() for k, v in model.state_dict().items()}
        avg.step()
        after = model.state_dict()
        if t % 5 == 0:
            d = 0.95**5 * (t / total) ** 3
            for k in slow:
                slow[k] = d * slow[k] + (1 - d) * before[k]
                assert torch.allclose(after[k], slow[k], rtol=1e-5, atol=1e-6), (t, k)
        elif t == total:  # the end: the weights become the average
            assert all(torch.allclose(after[k], slow[k], rtol=1e-5, atol=1e-6) for k in slow)
            assert all(torch.equal(a, b) for a, b in zip(avg.slow, avg.live))
        else:
            assert all(torch.equal(after[k], before[k]) for k in before)  # nothing between updates
    acc.save_hooks[0]([model], None, str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["lookahead.safetensors"]
    fresh_acc = _Acc()
    fresh = Lookahead(fresh_acc, _model(), total_steps=total)
    fresh_acc.load_hooks[0]([model], str(tmp_path))
    assert fresh.steps == total and all(torch.equal(a, b) for a, b in zip(fresh.slow, avg.slow))


def test_lookahead_off_changes_nothing():
    acc, model = _Acc(), _model()
    avg = Lookahead(acc, model, total_steps=10, every=0)
    before = [t.clone() for t in model.state_dict().values()]
    for _ in range(10):
        avg.step()
    assert acc.save_hooks == acc.load_hooks == [] and all(
        torch.equal(a, b) for a, b in zip(before, model.state_dict().values())
    )


def test_bias_groups_scale_the_lr_keep_the_decay_and_freeze_early_params():
    """BatchNorm biases learn 64x faster with the same decay per step; the whitening bias trains for its
    epochs only (a zero LR afterwards: the parameter stays still although it has a gradient); the frozen
    scale and whitening weights are not in the optimizer."""
    model = CifarCNN((3, 16, 16), 4, widths=(8, 16, 16))
    opt = sgd_with_bias_groups(model, 0.5, 0.85, 0.01, 64.0, early_params=[model.whiten.bias], early_epochs=1)
    groups = {g["name"]: g for g in opt.param_groups}
    bn = groups["norm_biases"]
    assert bn["lr"] == 0.5 * 64 and bn["lr"] * bn["weight_decay"] == pytest.approx(0.5 * 0.01)
    assert all(p.ndim == 1 for p in bn["params"]) and opt.defaults["fused"]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.whiten.weight) not in in_opt and id(model.groups[0].norm1.weight) not in in_opt

    class Cfg:
        epochs, warmup_fraction, warmup_start, schedule, final_lr = 3, 0.0, 0.0, "constant", 0.0

    sched = build_scheduler(opt, Cfg, steps_per_epoch=2)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    for step in range(6):
        before = model.whiten.bias.detach().clone()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        assert torch.equal(before, model.whiten.bias) == (step >= 2), step  # moves in epoch 1 only


def test_whitening_init_decorrelates_patches():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 1, 16, 16, generator=g)
    images = torch.cat(  # correlated channels
        [base, 0.5 * base + 0.1 * torch.randn(64, 1, 16, 16, generator=g), torch.randn(64, 1, 16, 16, generator=g)], 1
    )
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
    assert init_whitening(model.whiten, images) == 24  # every eigenvector of the 12-dim 2x2 patches, +-
    loss = nn.functional.cross_entropy(model(images), torch.arange(32) % 4)
    loss.backward()
    assert math.isfinite(loss.item()) and model.whiten.bias.grad.abs().sum() > 0
    assert model.whiten.weight.grad is None  # frozen
    conv = model.groups[0].conv2.weight  # dirac init: the identity on its first filters
    assert torch.equal(conv[:, :, 1, 1][:8, :8], torch.eye(8)) and conv[:, :, 0].abs().sum() == 0


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(kind):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)

    class Cfg:
        epochs, warmup_fraction, warmup_start, schedule, final_lr = 2, 0.2, 0.0, kind, 0.0

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
    # airbench's shape: warm-up from 0.2, decay to 0.07
    assert lr_multiplier(0, 20, 4, kind, start=0.2, end=0.07) == pytest.approx(0.4)
    if kind != "constant":
        assert lr_multiplier(20, 20, 4, kind, start=0.2, end=0.07) == pytest.approx(0.07)


class _Mirror(nn.Module):
    """Logits that depend on which half of the image is bright: a flip swaps classes 0 and 1."""

    def forward(self, x):
        left, right = x[..., : x.shape[-1] // 2].mean((1, 2, 3)), x[..., x.shape[-1] // 2 :].mean((1, 2, 3))
        return torch.stack([left, right, 0.25 * (left + right)], 1) * 10


def test_flip_tta_averages_each_image_with_its_mirror():
    from accelerate import Accelerator

    from common.data.decoded import ImageSplit, make_loader

    imgs = torch.zeros(6, 1, 4, 4, dtype=torch.uint8)
    imgs[:3, :, :, :2] = 255  # bright left half: class 0 without TTA
    imgs[3:, :, :, 2:] = 255
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    acc = Accelerator(cpu=True)
    loader = acc.prepare(make_loader(ImageSplit(imgs, labels), 4, False))
    t = BatchTransform([0.0], [1.0])
    plain = evaluate(acc, _Mirror(), loader, t, 3)
    tta = evaluate(acc, _Mirror(), loader, t, 3, tta=1)
    assert plain["accuracy"] == 1.0 and plain["count"] == 6
    # averaged with the mirror image, the left/right logits tie and the third class (their mean) ties too:
    # argmax picks class 0 for all, so exactly the three class-0 images stay right
    assert tta["accuracy"] == pytest.approx(0.5) and tta["count"] == 6
    x = t.eval(imgs).float()
    manual = 0.5 * (_Mirror()(x) + _Mirror()(x.flip(3)))
    expected_loss = nn.functional.cross_entropy(manual, labels).item()
    assert tta["loss"] == pytest.approx(expected_loss, rel=1e-6)


def test_six_view_tta_weights_the_views_as_airbench():
    """Level 2: 1/4 each for the image and its mirror, 1/8 each for the two 1-pixel shifts (reflected
    edges) and their mirrors; written out here view by view."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    x = torch.randn(2, 1, 6, 6)
    pad = nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    views = [(x, 0.25), (x.flip(3), 0.25)]
    for shifted in (pad[..., :6, :6], pad[..., 2:, 2:]):
        views += [(shifted, 0.125), (shifted.flip(3), 0.125)]
    with torch.no_grad():
        want = sum(w * model(v) for v, w in views)
        assert torch.allclose(tta_logits(model, x, 2), want, atol=1e-6)
        assert torch.allclose(tta_logits(model, x, 1), 0.5 * (model(x) + model(x.flip(3))), atol=1e-6)
        assert torch.equal(tta_logits(model, x, 0), model(x))


def test_alternating_flip_shows_each_image_both_ways_and_resumes_exactly():
    from common.data.decoded import ImageSplit, TensorImages

    g = torch.Generator().manual_seed(0)
    split = ImageSplit(torch.randint(0, 256, (40, 1, 4, 4), dtype=torch.uint8, generator=g), torch.arange(40))
    data = TensorImages(split, flip_seed=3)
    idx = list(range(40))
    seen = []
    for epoch in range(3):
        data.set_epoch(epoch)
        images, _ = data.__getitems__(idx)
        flipped = torch.tensor(
            [torch.equal(a, b.flip(2)) and not torch.equal(a, b) for a, b in zip(images, split.images)]
        )
        assert all(torch.equal(a, b) or torch.equal(a, b.flip(2)) for a, b in zip(images, split.images))
        seen.append(flipped)
    assert 10 < int(seen[0].sum()) < 30  # a random half in epoch 1
    assert torch.equal(seen[1], ~seen[0]) and torch.equal(seen[2], seen[0])  # the other way, then back
    again = TensorImages(split, flip_seed=3)  # a resumed run: same seed, same epoch, same pixels
    again.set_epoch(1)
    assert torch.equal(again.__getitems__([5, 7])[0], TensorImages(split, 3).__getitems__([5, 7])[0].flip(3))


def test_each_part_of_the_method_can_be_switched_off_for_an_ablation(tmp_path, capsys):
    """--dirac-init false gives torch's own conv init; --flip takes alternating, random or none (a bool, as an
    older run's config.json holds, is refused by name, not read as a flip mode)."""
    from launching import recipe_config

    recipe = import_recipe("cifar_cnn")
    for dirac in (True, False):
        cfg = recipe_config("cifar_cnn", ["--dirac-init", str(dirac).lower()])
        torch.manual_seed(0)
        conv = recipe.build_model(cfg, (3, 32, 32), 10).groups[0].conv2.weight
        identity = torch.zeros_like(conv)
        nn.init.dirac_(identity)
        assert torch.equal(conv, identity) is dirac
    assert {recipe_config("cifar_cnn", ["--flip", f]).flip for f in ("random", "none")} == {"random", "none"}
    assert recipe_config("cifar_cnn", []).flip == "alternating"
    with pytest.raises(SystemExit):
        recipe_config("cifar_cnn", ["--flip", "true"])
    old = tmp_path / "config.json"
    old.write_text(json.dumps({"flip": True, "seed": 1}))
    with pytest.raises(SystemExit):
        recipe_config("cifar_cnn", ["--config", old])
    err = capsys.readouterr().err
    assert "flip = 'True' is not one of alternating, random, none" in err and "Set it to one of them" in err


@pytest.mark.parametrize("nproc", [1, 2])
def test_cifar_resume_with_lookahead_and_whitening_is_exact(nproc, tmp_path, env, reference_run):
    """Stopped after 3 optimizer steps and resumed: the final weights (the Lookahead average) and the
    per-step losses equal the uninterrupted reference run's (--checkpoint-every 3), so the average is
    checkpointed and restored. 1 process: stopped by --max-steps 3, in this process.
    2 processes (real gloo processes): resumed from the reference run's own step-3 checkpoint."""
    ref = reference_run("cifar_cnn", nproc)
    args, full, part = ref.train_args, ref.run, tmp_path / "part"
    assert "--checkpoint-every" in args
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
    # final/ holds the average: the slow weights of the last checkpoint, in Lookahead's order (parameters,
    # then floating-point buffers)
    from common.train.checkpoint import find_latest

    state = load_file(str(find_latest(full) / "lookahead.safetensors"))
    model = CifarCNN((3, 32, 32), 4, widths=(8, 16, 16))
    names = [n for n, _ in model.named_parameters()] + [n for n, b in model.named_buffers() if b.is_floating_point()]
    assert int(state["steps"][0]) == summary["global_step"] and len(state) == len(names) + 1
    assert all(torch.equal(a[n], state[f"slow.{i}"]) for i, n in enumerate(names))
    # every pickle of a checkpoint loads under weights_only (Accelerate's loader: tensors and numpy arrays only)
    from accelerate.utils.other import load as weights_only_load

    for f in find_latest(full).iterdir():
        if f.suffix in (".pkl", ".bin", ".pt"):
            weights_only_load(f)


def test_cifar_recipe_takes_digits_made_cifar_shaped(tmp_path, env, mnist_like):
    """The check README describes on real MNIST, here on generated 1x28x28 images: --channels 3
    --image-size 32 turns them into CIFAR-shaped images and the CIFAR recipe learns them. (These classes
    differ only by where a bright block sits, which a global-max-pool model sees only through the image
    border, so the bar is well above chance rather than near 100%.)"""
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "cifar_cnn",
            [
                "--dataset",
                mnist_like,
                "--channels",
                3,
                "--image-size",
                32,
                "--flip",
                "none",
                "--tta",
                0,
                "--widths",
                "8,16,16",
                "--epochs",
                6,
                "--batch-size",
                32,
                "--lr",
                0.05,
                "--output-dir",
                run,
            ],
            env,
        )
    )
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["input_shape"] == [3, 32, 32]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["test/accuracy"] >= 0.6, summary["final"]  # chance: 0.25


class _Planted:
    """A pickle that, when loaded without weights_only, creates a file: what a received checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resuming_a_received_checkpoint_runs_none_of_its_pickles(tmp_path, env, reference_run):
    """A checkpoint someone sent you with a code-running pickle planted where Accelerate keeps registered
    objects' state (custom_checkpoint_0.pkl, which it loads without weights_only), or in its RNG state: the
    resume refuses each with a one-paragraph error naming the file, and the code never runs. (The Lookahead
    average lives in lookahead.safetensors; a clean checkpoint resumes, see the test above.)"""
    ref = reference_run("cifar_cnn", 1)
    part = stopped_at(ref.run, 3, tmp_path / "part")
    checkpoint = next((part / "checkpoints").iterdir())
    marker = tmp_path / "code-ran"
    args = [*ref.train_args, "--output-dir", part, "--resume-from", "latest"]
    planted = checkpoint / "custom_checkpoint_0.pkl"
    torch.save({"steps": 3, "slow": _Planted(marker)}, planted)
    proc = run_in_process("cifar_cnn", args, env)
    assert proc.returncode == 2 and not marker.exists()
    assert "Traceback" not in proc.stderr and str(planted) in proc.stderr, proc.stderr[-2000:]
    planted.unlink()
    rng = checkpoint / "random_states_0.pkl"
    torch.save({"random_state": _Planted(marker)}, rng)
    proc = run_in_process("cifar_cnn", args, env)
    assert proc.returncode == 2 and not marker.exists()
    assert "Traceback" not in proc.stderr and str(rng) in proc.stderr, proc.stderr[-2000:]


def fp16_on_this_cpu(monkeypatch, overflow_at):
    """The recipes' Accelerator with fp16 loss scaling on the CPU (Accelerate offers fp16 on accelerators only):
    torch's CPU GradScaler as its scaler, and the gradients of the optimizer steps in ``overflow_at`` made
    infinite after the loss (what an fp16 overflow is: a finite loss whose scaled gradients overflow)."""
    from accelerate.state import AcceleratorState

    import common.train.run

    real_make, calls = common.train.run.make_accelerator, [0]

    def make(cfg, *launch):
        accelerator, note = real_make(cfg, *launch)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        AcceleratorState()._mixed_precision = "fp16"
        real_backward = accelerator.backward

        def backward(loss, **kwargs):
            calls[0] += 1
            return real_backward(loss * math.inf if calls[0] in overflow_at else loss, **kwargs)

        accelerator.backward = backward
        return accelerator, note

    monkeypatch.setattr(common.train.run, "make_accelerator", make)


def test_fp16_skipped_steps_through_a_recipe_leave_the_schedule_and_the_average_where_they_were(
    tmp_path, env, cifar_like, monkeypatch
):
    """cifar_cnn (Lookahead on, fused SGD) with fp16 loss scaling, overflows at optimizer steps 3 and 4: both updates
    are skipped, and Accelerate sees it (the guard gives the fused optimizer GradScaler's own path), so the weights,
    Accelerate's LR scheduler and the weight average stay where they were. The steps count (run.step, the logs,
    --max-steps: one per optimizer step, as HF Trainer counts them), summary.json counts the skips beside them;
    training goes on; 25 overflows in a row stop the run with its own message."""
    from common.train.checkpoint import find_latest

    fp16_on_this_cpu(monkeypatch, overflow_at={3, 4})
    run = tmp_path / "run"
    args = [
        "--dataset",
        cifar_like,
        "--widths",
        "8,16,16",
        "--tta",
        0,
        "--epochs",
        1,
        "--batch-size",
        32,
        "--lr",
        1.5,
        "--log-every",
        1,
        "--lookahead-every",
        1,
        "--output-dir",
        run,
    ]
    proc = check_ok(run_in_process("cifar_cnn", args, env))
    batches = int(proc.stdout.split("steps_per_epoch=", 1)[1].split()[0])  # the schedule's length: 1 epoch
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["skipped_steps"] == 2 and summary["status"] == "completed"
    steps = summary["global_step"]
    assert steps == batches  # optimizer steps, the two skipped ones among them
    logged = [(r["step"], r["train/lr"]) for r in read_jsonl(run / "metrics.jsonl") if "train/lr" in r]
    assert [step for step, _ in logged] == list(range(1, steps + 1))
    # the schedule moves at every update taken and at no skip: step s runs at the LR of the updates taken before it
    taken_before = [s - 1 - len({3, 4} & set(range(1, s))) for s in range(1, steps + 1)]
    warmup = int(round(0.23 * batches))
    expected = [1.5 * lr_multiplier(p, batches, warmup, "linear", 0.2, 0.07) for p in taken_before]
    assert [lr for _, lr in logged] == pytest.approx(expected)
    latest = find_latest(run)
    assert int(load_file(str(latest / "lookahead.safetensors"))["steps"][0]) == steps - 2  # nor an average
    optimizer_state = torch.load(latest / "optimizer.bin", weights_only=True)["state"]
    assert {int(s["momentum_buffer"].ne(0).any()) for s in optimizer_state.values()} == {1}
    scaler = torch.load(latest / "scaler.pt", weights_only=True)
    assert scaler["scale"] == 2.0**10  # halved at each skipped step

    # --max-steps counts optimizer steps: 6 steps take 6 batches, two of them skipped; the checkpoint says so
    fp16_on_this_cpu(monkeypatch, overflow_at={3, 4})
    check_ok(run_in_process("cifar_cnn", [*args[:-1], tmp_path / "capped", "--epochs", 2, "--max-steps", 6], env))
    summary = json.loads((tmp_path / "capped" / "summary.json").read_text())
    assert (summary["global_step"], summary["skipped_steps"]) == (6, 2), summary
    state = json.loads((find_latest(tmp_path / "capped") / "trainer_state.json").read_text())
    consumed = state["epoch"] * batches + state["batches_in_epoch"]
    assert (state["global_step"], consumed, state["skipped_steps"]) == (6, 6, 2), state

    fp16_on_this_cpu(monkeypatch, overflow_at=set(range(3, 1000)))
    proc = run_in_process("cifar_cnn", [*args[:-1], tmp_path / "diverged", "--epochs", 5], env)
    assert proc.returncode != 0 and "skipped the last 25 optimizer steps in a row" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "diverged" / "summary.json").read_text())["status"] == "nonfinite_loss"
