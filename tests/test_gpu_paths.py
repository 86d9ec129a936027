"""The paths every GPU user takes, run on CPU stand-ins (GUIDE section 7): fp16 as Accelerate gives it on a GPU
(native AMP and a GradScaler: torch's CPU one), a compiled model (Accelerate's dynamo_backend), torch's CPU fused
optimizer kernels (the same driver as the CUDA ones) with a skipped first step, and the precision a GPU without
native bf16 gets (its capability mocked)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import common.train.run as run_module
from common.train import accelerator as accelerator_module

from helpers import SMALL, check_ok, recipe_env, run_in_process

DATA = {"mnist_convnet": "mnist_like", "fashion_mnist_mlp": "mnist_like", "cifar_cnn": "cifar_like"}
DATA["finetune_folder"] = "photos_like"


@pytest.fixture
def cpu_fp16(monkeypatch):
    """Every Accelerator the recipes make trains in fp16 the way Accelerate sets it up on a GPU: autocast to float16
    and a GradScaler (loss scaled in backward, unscale_ before clipping, steps skipped on overflow). Returns the
    scalers made, to read their scale after the run."""
    made = []
    original = run_module.make_accelerator

    def make(cfg, *launch):
        accelerator, note = original(cfg, *launch)
        accelerator.state._mixed_precision = "fp16"
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu")
        made.append(accelerator.scaler)
        return accelerator, note

    monkeypatch.setattr(run_module, "make_accelerator", make)
    return made


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


CLIP, ACCUM = ["--max-grad-norm", 1], ["--max-grad-norm", 1, "--grad-accum", 2]
FP16_CASES = [("mnist_convnet", []), ("mnist_convnet", CLIP), ("mnist_convnet", ACCUM), ("cifar_cnn", CLIP)]
FP16_CASES += [("fashion_mnist_mlp", ACCUM), ("finetune_folder", CLIP)]


@pytest.mark.parametrize("recipe,extra", FP16_CASES)
def test_fp16_with_and_without_clipping(recipe, extra, cpu_fp16, request, tmp_path):
    """fp16 with --max-grad-norm: the gradient norm logged at log steps and the recipe's clip each need the unscaled
    gradients; GradScaler's unscale_ may run once per step (a second call raises). Before, the first log step
    crashed. The run completes, logs a finite norm and took its steps through the scaler."""
    dataset = request.getfixturevalue(DATA[recipe])
    args = ["--dataset", dataset, *SMALL[recipe], "--epochs", 1, "--batch-size", 16, "--max-steps", 6]
    args += ["--log-every", 3, "--output-dir", tmp_path / "run", *extra]
    check_ok(run_in_process(recipe, args, recipe_env(tmp_path)))
    assert cpu_fp16 and cpu_fp16[0]._scale is not None  # the scaler was used
    done = summary(tmp_path / "run")
    assert done["status"] == "completed", done
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["train/grad_norm"] for r in rows if "train/grad_norm" in r]
    assert norms and all(0 < n < float("inf") for n in norms), rows


def test_fp16_gradient_norm_is_the_unscaled_one():
    """The norm the recipes log is what their clip returns (``accelerator.clip_grad_norm_``, at infinity when not
    clipping): with fp16's scaled gradients, the unscaled norm (its one ``unscale_``), the same as fp32's, and the
    gradients left as they were."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    x, reference = torch.randn(8, 4), torch.nn.Linear(4, 3)
    reference(x).float().pow(2).mean().backward()
    plain = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        accelerator.state._mixed_precision, accelerator.native_amp = "fp16", True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(reference.state_dict())
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.backward(model(x).float().pow(2).mean())
        measured = accelerator.clip_grad_norm_(model.parameters(), math.inf)  # unscale_ here, once
        # fp16's forward rounds: equal to fp32's within its precision, not the scaled norm (1024x larger)
        assert float(measured) == pytest.approx(float(plain), rel=1e-3)
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(mine.grad, theirs.grad, rtol=1e-2, atol=1e-3)  # unscaled, not clipped
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def compiled_env(tmp_path, backend):
    """`accelerate launch --dynamo_backend BACKEND` sets this; the recipes' Accelerator reads it. ``eager``: dynamo's
    real wrapper (OptimizedModule, `_orig_mod.` state keys) without code generation, so it costs seconds on CPU."""
    return {**recipe_env(tmp_path), "ACCELERATE_DYNAMO_BACKEND": backend}


def check_compiled_run_loads_everywhere(recipe, dataset, tmp_path, backend, steps=8):
    """A compiled run's best/, final/, checkpoints and model.json: plain keys and the model's own class; predict,
    export, --eval-only, and a resume with and without the compile flag all take them."""
    from safetensors.torch import load_file

    from common.tools.export import main as export_main
    from common.tools.predict import load_predictor, predict_files

    run_dir = tmp_path / "run"
    args = ["--dataset", dataset, *SMALL[recipe], "--epochs", 2, "--batch-size", 32, "--max-steps", steps]
    args += ["--checkpoint-every", steps // 2, "--keep-checkpoints", 5, "--output-dir", run_dir]
    proc = check_ok(run_in_process(recipe, args, compiled_env(tmp_path, backend)))
    assert "distributed=" in proc.stdout
    for folder in (run_dir / "best", run_dir / "final", *sorted((run_dir / "checkpoints").glob("step*"))):
        keys = [k for f in folder.glob("model*.safetensors") for k in load_file(str(f))]
        assert keys and not [k for k in keys if "_orig_mod" in k], folder
    for folder in (run_dir / "best", run_dir / "final"):
        card = json.loads((folder / "model.json").read_text())
        assert card["model"] != "OptimizedModule", card["model"]
    predictor = load_predictor(run_dir / "final")
    images = sorted(p for p in tmp_path.rglob("*.png"))[:3] or None
    if images:
        assert len(predict_files(predictor, images)) == len(images)
    assert export_main([str(run_dir / "final"), "--onnx", str(tmp_path / "model.onnx")]) == 0
    evaluated = run_in_process(
        recipe, ["--dataset", dataset, *SMALL[recipe], "--eval-only", "--checkpoint", run_dir], recipe_env(tmp_path)
    )
    check_ok(evaluated)
    # resume from the first checkpoint, without the flag and with it: both continue the compiled run exactly
    first = sorted((run_dir / "checkpoints").glob("step*"))[0]
    for name, env in (("plain", recipe_env(tmp_path)), ("compiled", compiled_env(tmp_path, backend))):
        again = tmp_path / f"resumed-{name}"
        resume = [*args[:-1], again, "--resume-from", first]
        check_ok(run_in_process(recipe, resume, env))
        assert json.loads((again / "summary.json").read_text())["status"] == "completed"
        a, b = (
            load_file(str(run_dir / "final" / "model.safetensors")),
            load_file(str(again / "final" / "model.safetensors")),
        )
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)  # compiled vs eager kernels: rounding only


@pytest.mark.parametrize("recipe", ["mnist_convnet", "finetune_folder"])
def test_compiled_run_files_load_everywhere(recipe, request, tmp_path):
    """Before, best/ and final/ of a compiled run held `_orig_mod.` keys and model.json named OptimizedModule:
    predict and --eval-only refused them and a resume without the flag was "a different model"."""
    check_compiled_run_loads_everywhere(recipe, request.getfixturevalue(DATA[recipe]), tmp_path, "eager")


@pytest.mark.integration
def test_inductor_compiled_run_loads_everywhere(mnist_like, tmp_path):
    """One real compile (inductor, CPU code generation) through the same checks."""
    check_compiled_run_loads_everywhere("mnist_convnet", mnist_like, tmp_path, "inductor")


def test_ema_matches_averaged_model_and_keeps_no_host_counter():
    """The EMA computes what torch's AveragedModel (get_ema_multi_avg_fn, use_buffers=True) computes, bit for bit,
    writes its checkpoint layout, and updates with no tensor on the host (AveragedModel copies a host counter to the
    device at every update: a stream sync on a GPU)."""
    from types import SimpleNamespace

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from common.averaging import EMA

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    )
    model(torch.randn(2, 3, 8, 8))
    accelerator = SimpleNamespace(
        unwrap_model=lambda m, keep_torch_compile=True: m,
        register_save_state_pre_hook=lambda hook: None,
        register_load_state_pre_hook=lambda hook: None,
        optimizer_step_was_skipped=False,
    )
    ours = EMA(accelerator, model, 0.9)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(4, 3, 8, 8))  # BatchNorm statistics (and num_batches_tracked) move
        ours.update()
        reference.update_parameters(model)
    theirs = reference.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    assert not [a for a, _ in ours.floats + ours.others if a.device != next(model.parameters()).device]


def test_fused_sgd_skipped_first_step_leaves_the_state_of_a_stock_sgd():
    """torch's CPU fused SGD kernels (the CUDA ones' driver): a first step skipped on the device (found_inf, as an
    fp16 overflow sets it) left empty_like momentum, and the next step built on it. Now the weights and momentum
    after a skipped first step and a real one equal a stock SGD's that only took the real one; a first step
    taken matches torch's own fused first step bit for bit."""
    from common.optimizers import zero_momentum_before_first_step

    def model_and_grads(seed=0):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(64, 33)), torch.nn.Parameter(torch.randn(17))]
        grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
        return params, grads

    def step(opt, params, grads, skip=False):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.found_inf = torch.tensor(1.0 if skip else 0.0)  # read by the fused kernel (GradScaler's API)
        opt.step()

    settings = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    params, grads = model_and_grads()
    fused = torch.optim.SGD(params, fused=True, **settings)
    zero_momentum_before_first_step(fused)
    torch.manual_seed(1)
    with torch.no_grad():  # what empty_like hands out is whatever the allocator holds: make it garbage
        [torch.full((64, 33), 3e30) for _ in range(8)]
    step(fused, params, grads[0], skip=True)
    step(fused, params, grads[1])
    stock_params, _ = model_and_grads()
    stock = torch.optim.SGD(stock_params, **settings)
    for p, g in zip(stock_params, grads[1]):
        p.grad = g.clone()
    stock.step()
    for p, q in zip(params, stock_params):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(fused.state[p]["momentum_buffer"], stock.state[q]["momentum_buffer"])

    # a first step that is taken: bit-identical to torch's fused SGD without the zero buffers
    a, grads = model_and_grads(2)
    b, _ = model_and_grads(2)
    ours, torchs = torch.optim.SGD(a, fused=True, **settings), torch.optim.SGD(b, fused=True, **settings)
    zero_momentum_before_first_step(ours)
    for g in grads:
        step(ours, a, g)
        step(torchs, b, g)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("capability,expected", [((7, 0), "no"), ((7, 5), "no"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_bf16_on_a_gpu_without_native_bf16_falls_back_with_a_note(capability, expected, monkeypatch):
    """A V100 (7.0) or T4 (7.5), where torch.cuda.is_bf16_supported() still says yes (emulation) and cuDNN has no
    bf16 convolutions: fp32 with a NOTE naming the GPU and the fp16 config. Before, bf16 was taken without a word.
    cudnn.benchmark follows --cudnn-benchmark for a GPU run (on by default)."""
    import accelerate

    made = {}
    monkeypatch.setattr(accelerator_module, "has_accelerator_device", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(accelerate, "Accelerator", lambda **kwargs: made.update(kwargs) or object())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    fields = {"grad_accum": 1, "seed": 0, "report_to": "tensorboard", "timeout_s": 60, "cudnn_benchmark": True}
    cfg = type("Cfg", (), fields)()
    _, note = accelerator_module.make_accelerator(cfg)
    assert made["mixed_precision"] == expected
    if expected == "no":
        assert "no native bf16" in note and "Tesla V100" in note and "multi_gpu_fp16.yaml" in note
    else:
        assert "bf16" not in note
    assert torch.backends.cudnn.benchmark is True
    cfg.cudnn_benchmark = False  # --cudnn-benchmark false: cuDNN's default kernels, no search
    accelerator_module.make_accelerator(cfg)
    assert torch.backends.cudnn.benchmark is False


@pytest.mark.parametrize("macos_14", [True, False])
def test_a_macs_gpu_is_used_as_accelerate_would_with_the_precision_it_takes(macos_14, monkeypatch):
    """On a Mac with MPS (mocked here: torch built with it, available, macOS 14 or not), the run goes to the GPU
    (Accelerate's device, not cpu=True), bf16 is kept where MPS takes it (macOS 14+) and otherwise falls back to fp32
    with a NOTE naming fp16, and the startup line names the Apple GPU. Before, MPS was not counted as a GPU: a Mac
    trained on its CPU."""
    import accelerate

    made = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos_14)
    monkeypatch.setattr(accelerate, "Accelerator", lambda **kwargs: made.update(kwargs) or object())
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert accelerator_module.has_accelerator_device()
    fields = {"grad_accum": 1, "seed": 0, "report_to": "tensorboard", "timeout_s": 60, "cudnn_benchmark": True}
    _, note = accelerator_module.make_accelerator(type("Cfg", (), fields)())
    assert made["cpu"] is False
    if macos_14:
        assert made["mixed_precision"] == "bf16" and "bf16" not in note
    else:
        assert made["mixed_precision"] == "no" and "macOS 14" in note and "fp16" in note
    accelerator = type("A", (), {"device": torch.device("mps"), "num_processes": 1, "mixed_precision": "bf16"})()
    accelerator.distributed_type, accelerator.state = type("D", (), {"value": "NO"})(), object()
    cfg = type("Cfg", (), {"batch_size": 32, "grad_accum": 1, "lr": 0.1})()
    assert "device=mps (Apple GPU, Metal Performance Shaders)" in accelerator_module.startup_line(accelerator, cfg, 10)


def test_sync_batchnorm_builds_nothing_from_host_data(monkeypatch):
    """--sync-bn on CPU processes (CPUSyncBatchNorm, 2 ranks mocked): its per-forward count was a tensor made from a
    Python float on the device (a host-to-device copy each BatchNorm layer each step); now a fill on the device.
    (torch's SyncBatchNorm, used on GPUs, waits for the device once per layer and step at 2+ GPUs: its README note.)"""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_functional

    from common.models import CPUSyncBatchNorm

    made_from_python = []
    original_tensor = torch.tensor
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist_functional, "all_reduce", lambda t, *a, **k: t * 2)  # two equal ranks
    monkeypatch.setattr(
        torch, "tensor", lambda *a, **k: (k.get("device") and made_from_python.append(k)) or original_tensor(*a, **k)
    )
    torch.manual_seed(0)
    bn, reference = CPUSyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    x = torch.randn(8, 4, 5, 5)
    torch.testing.assert_close(bn.train()(x), reference.train()(x), rtol=1e-4, atol=1e-5)  # same statistics
    assert made_from_python == []


@pytest.mark.parametrize("where", ["training", "evaluation"])
def test_a_gpu_out_of_memory_ends_in_one_paragraph_naming_the_setting_that_keeps_the_run(
    where, tmp_path, env, mnist_like, monkeypatch
):
    """A CUDA out-of-memory error (raised here by a stand-in for the loss, in the third training step or in the first
    evaluation) ends the run with one paragraph, no traceback, exit 1 and summary.json's out_of_memory: in training it
    names the micro-batch that did not fit and the --grad-accum that keeps the global batch (32 over 1 process: 16 per
    micro-batch with --grad-accum 2); in evaluation, the --eval-batch-size to resume with."""
    import torch.nn.functional as F

    real, calls = F.cross_entropy, []

    def cross_entropy(*args, **kwargs):
        training = torch.is_grad_enabled()
        calls.append(training)
        if (where == "training" and training and calls.count(True) == 3) or (where == "evaluation" and not training):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.77 GiB total)")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", cross_entropy)
    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--hidden", 32, "--output-dir", run]
    args += ["--eval-batch-size", 64]
    proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "The GPU ran out of memory in " + where in paragraph and "CUDA out of memory" in paragraph, paragraph
    if where == "training":
        assert "at step 2" in paragraph and "micro-batch of 32 images per process did not fit" in paragraph, paragraph
        assert (
            "start it again in a new --output-dir with --grad-accum 2" in paragraph
            and "micro-batches of 16" in paragraph
        ), paragraph
    else:
        assert "evaluation batch of 64 images per process" in paragraph, paragraph
        assert "--resume-from latest" in paragraph and "--eval-batch-size 32" in paragraph, paragraph
    assert json.loads((run / "summary.json").read_text())["status"] == "out_of_memory"
    monkeypatch.setattr(F, "cross_entropy", real)  # the false positive: any other RuntimeError is still a crash
    monkeypatch.setattr(
        F, "cross_entropy", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shape mismatch in the loss"))
    )
    crashed = run_in_process("fashion_mnist_mlp", [*args[:-2], "--output-dir", tmp_path / "other"], env)
    assert crashed.returncode == 1 and "Traceback" in crashed.stderr and "out of memory" not in crashed.stderr
