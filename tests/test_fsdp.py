"""FSDP version 2 in the photo recipe, on CPU processes over gloo through the stand-in (tests/standins/fsdp_on_cpu.py,
GUIDE section 7): Accelerate sets FSDP up on GPUs only, torch's fully_shard runs on CPUs. What a GPU user gets: the
model sharded block by block (said on the startup line), the same training as DDP, Accelerate's sharded checkpoints
resumed exactly, best/ and final/ gathered into one file that predict and export load, a crafted or damaged sharded
checkpoint refused; and each FSDP answer the recipes cannot honour refused before any data is read."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import re
import shutil
import subprocess

import pytest
import torch

from helpers import (
    ACCELERATE,
    REPO,
    SMALL,
    check_ok,
    free_port,
    launch,
    read_jsonl,
    recipe_env,
    run_in_process,
    stopped_at,
)

STANDIN = REPO / "tests" / "standins" / "fsdp_on_cpu.py"
# `accelerate config`'s FSDP answers with their defaults (version 2), for two processes
FSDP2_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
TRAIN = [*SMALL["finetune_folder"], "--epochs", 2, "--max-steps", 8, "--batch-size", 16, "--log-every", 1]
TRAIN += ["--checkpoint-every", 3, "--keep-checkpoints", 10]


def fsdp_launch(tmp_path, args, env=None):
    """The photo recipe under `accelerate launch` with the FSDP2 config, through the CPU stand-in."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(FSDP2_CONFIG)
    cmd = [ACCELERATE, "launch", "--config_file", str(config), "--main_process_port", str(free_port()), str(STANDIN)]
    cmd += [str(REPO / "recipes" / "finetune_folder.py"), *map(str, args)]
    env = env or recipe_env(tmp_path)
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, photos_like):
    """One FSDP2 run of the photo recipe on 2 processes: 8 steps, a checkpoint every 3."""
    root = tmp_path_factory.mktemp("fsdp")
    proc = check_ok(fsdp_launch(root, ["--dataset", photos_like, *TRAIN, "--output-dir", root / "run"]))
    return root, proc


def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.integration  # 4 launches of 2 processes: about 100 s
def test_fsdp2_shards_trains_as_ddp_resumes_exactly_and_its_files_load_everywhere(fsdp_run, photos_like, tmp_path):
    root, proc = fsdp_run
    run_dir = root / "run"
    startup = next(line for line in proc.stdout.splitlines() if line.startswith("startup:"))
    assert "processes=2 distributed=FSDP" in startup, startup
    assert "sharded=FSDP2 over 2 process(es)" in startup and "8 BasicBlock" in startup, startup
    checkpoint = run_dir / "checkpoints" / "step-00000006"
    assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()  # Accelerate's sharded model files
    assert json.loads((checkpoint / "trainer_state.json").read_text())["sharded"] == "FSDP2"

    # the same training as DDP: a plain 2-process run's losses, step by step (reduction order: rounding only)
    ddp = tmp_path / "ddp"
    check_ok(
        launch("finetune_folder", ["--dataset", photos_like, *TRAIN, "--output-dir", ddp], recipe_env(tmp_path), 2)
    )
    ours = [r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    theirs = [r["train/loss"] for r in read_jsonl(ddp / "metrics.jsonl") if "train/loss" in r]
    assert len(ours) == len(theirs) == 8
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-3, atol=2e-4)

    # best/ and final/: one whole state_dict of the model's own class and keys, as DDP's
    final = weights(run_dir / "final")
    assert final.keys() == weights(ddp / "final").keys()
    for folder in (run_dir / "best", run_dir / "final"):
        assert json.loads((folder / "model.json").read_text())["model"] == "ResNet"

    # stopped mid-epoch at step 6 and resumed on 2 processes: the uninterrupted run's weights, bit for bit
    resumed = stopped_at(run_dir, 6, tmp_path / "resumed")
    proc = check_ok(
        fsdp_launch(tmp_path, ["--dataset", photos_like, *TRAIN, "--output-dir", resumed, "--resume-from", "latest"])
    )
    assert "resumed from" in proc.stdout
    again = weights(resumed / "final")
    assert not [k for k in final if not torch.equal(final[k], again[k])]

    # predict and export load final/; --eval-only scores it (launched without FSDP)
    from common.tools.export import main as export_main
    from common.tools.predict import load_predictor, predict_files

    photos = sorted((photos_like / "test").rglob("*.jpg"))[:3]
    assert len(predict_files(load_predictor(run_dir / "final"), photos)) == 3
    assert export_main([str(run_dir / "final"), "--onnx", str(tmp_path / "model.onnx")]) == 0
    scored = run_in_process(
        "finetune_folder",
        ["--dataset", photos_like, *SMALL["finetune_folder"], "--eval-only", "--checkpoint", run_dir / "final"],
        recipe_env(tmp_path),
    )
    check_ok(scored)


def test_a_sharded_checkpoint_is_resumed_only_sharded(fsdp_run, photos_like, tmp_path):
    """Its files cannot load into a whole model: a launch without FSDP is refused in one paragraph, before
    Accelerate reads them."""
    root, _ = fsdp_run
    resumed = stopped_at(root / "run", 6, tmp_path / "resumed")
    args = ["--dataset", photos_like, *TRAIN, "--output-dir", resumed, "--resume-from", "latest"]
    proc = run_in_process("finetune_folder", args, recipe_env(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "sharded by FSDP version 2" in proc.stderr and "--use_fsdp --fsdp_version 2" in proc.stderr


class Payload:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-target",))


class Touch:
    """Pickled, it creates ``path`` when it is loaded: code that ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


# an optimizer's param group as torch.optim keeps it (SGD's and AdamW's fields): torch.distributed.checkpoint stores
# each value as a byte item of a .distcp file (param_groups.0.lr, ...), pickled
OPTIMIZER_GROUP = {
    "lr": 0.1,
    "initial_lr": 0.1,
    "momentum": 0.9,
    "dampening": 0,
    "weight_decay": 1e-4,
    "nesterov": False,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "params": ["0"],
}


def sharded_checkpoint(folder):
    """A checkpoint folder as Accelerate's FSDP2 save_state lays it out: torch.distributed.checkpoint's files (written
    here by one process) in pytorch_model_fsdp_0/ and optimizer_0/."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"conv.weight": torch.randn(8, 3, 3, 3), "fc.bias": torch.randn(5)},
        checkpoint_id=folder / "pytorch_model_fsdp_0",
    )
    optimizer = {"state": {"0": {"momentum_buffer": torch.randn(5)}}, "param_groups": [OPTIMIZER_GROUP]}
    dcp.save(optimizer, checkpoint_id=folder / "optimizer_0")  # the group's values: byte items, pickled
    return folder


def test_a_crafted_or_damaged_sharded_checkpoint_is_refused_before_torch_reads_it(tmp_path):
    """torch.distributed.checkpoint reads a sharded folder's .metadata with plain pickle: a crafted index would run
    code. It is read first with only the records such an index holds; a file shorter than the index says is
    damage (--resume-from latest then falls back)."""
    from common.errors import RecipeError
    from common.train import checkpoint as ckpt

    good = sharded_checkpoint(tmp_path / "good")
    ckpt.verify_files(good)  # a real one passes

    crafted = tmp_path / "crafted"
    shutil.copytree(good, crafted)
    index = crafted / "pytorch_model_fsdp_0" / ".metadata"
    index.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(RecipeError, match="shutil.rmtree"):
        ckpt.verify_files(crafted)

    outside = tmp_path / "outside"
    shutil.copytree(good, outside)
    index = outside / "optimizer_0" / ".metadata"
    meta = pickle.loads(index.read_bytes())
    key = next(iter(meta.storage_data))
    meta.storage_data[key].relative_path = "../../secret"
    index.write_bytes(pickle.dumps(meta))
    with pytest.raises(RecipeError, match="outside its folder"):
        ckpt.verify_files(outside)

    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    shard = sorted((cut / "pytorch_model_fsdp_0").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ckpt.DamagedCheckpoint, match="shorter than its index says"):
        ckpt.verify_files(cut)


def test_a_sharded_optimizer_value_that_would_run_code_is_refused_before_torch_unpickles_it(tmp_path):
    """torch.distributed.checkpoint unpickles each byte item of a .distcp file (an optimizer's lr, betas, ...) without
    weights_only: one crafted item would run code on every rank. Each is read first with weights_only, as torch
    reads it (its bytes at the index's offset and length): the resume is refused, naming the file, and nothing ran."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from common.errors import RecipeError
    from common.train import checkpoint as ckpt

    crafted = sharded_checkpoint(tmp_path / "crafted")
    folder = crafted / "optimizer_0"
    index = folder / ".metadata"
    meta = pickle.loads(index.read_bytes())
    fqn = "param_groups.0.lr"
    assert isinstance(meta.state_dict_metadata[fqn], BytesStorageMetadata)
    [item] = [info for key, info in meta.storage_data.items() if key.fqn == fqn]
    shard = folder / item.relative_path
    marker = tmp_path / "the-code-ran"
    payload = io.BytesIO()
    torch.save(Touch(marker), payload)  # as torch writes a byte item, with the payload in it
    item.offset, item.length = shard.stat().st_size, len(payload.getvalue())  # appended, the index saying so
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    index.write_bytes(pickle.dumps(meta))

    with pytest.raises(RecipeError, match=re.escape(str(shard))) as refused:
        ckpt.verify_files(crafted)
    assert fqn in str(refused.value) and "not an allowed global" in str(refused.value), refused.value
    assert "nothing was loaded" in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()

    # what the check stands in front of: torch's own read of the folder runs the payload
    state = {"state": {"0": {"momentum_buffer": torch.zeros(5)}}, "param_groups": [dict(OPTIMIZER_GROUP)]}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    assert marker.exists()

    # a byte item cut short (its index says fewer bytes than torch wrote) cannot be read: damage, not a refusal
    cut = sharded_checkpoint(tmp_path / "cut")
    index = cut / "optimizer_0" / ".metadata"
    meta = pickle.loads(index.read_bytes())
    [item] = [info for key, info in meta.storage_data.items() if key.fqn == "param_groups.0.betas"]
    item.length //= 2
    index.write_bytes(pickle.dumps(meta))
    with pytest.raises(ckpt.DamagedCheckpoint, match="param_groups.0.betas"):
        ckpt.verify_files(cut)


REFUSED = {  # the photo recipe's FSDP answers that are refused, before any data is read -> words of the paragraph
    "on a CPU": ({}, [], "Accelerate shards with FSDP on GPUs only"),
    "version 1": ({"FSDP_VERSION": "1"}, [], "version 2 only"),
    "with an EMA": ({}, ["--ema-decay", 0.99], "--ema-decay"),
    "with fp16": ({"ACCELERATE_MIXED_PRECISION": "fp16"}, [], "fp16"),
    "with --eval-only": ({}, ["--eval-only", "--checkpoint", "/nonexistent/run"], "--eval-only"),
}


@pytest.mark.parametrize("answer", list(REFUSED))
def test_an_fsdp_answer_the_photo_recipe_cannot_honour_stops_before_the_data(answer, tmp_path, photos_like):
    env_vars, flags, words = REFUSED[answer]
    env = {**recipe_env(tmp_path), "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **env_vars}
    if answer != "on a CPU":  # the checks after the device's, as on a GPU
        pytest.importorskip("torch.distributed.fsdp")
        from common.train import accelerator as accelerator_module

        checks = accelerator_module.fsdp_asked
        mp = pytest.MonkeyPatch()
        mp.setattr(accelerator_module, "fsdp_asked", lambda cfg, cpu, precision: checks(cfg, False, precision))
    else:
        mp = None
    try:
        args = ["--dataset", photos_like, *SMALL["finetune_folder"], *flags, "--output-dir", tmp_path / "run"]
        proc = run_in_process("finetune_folder", args, env)
    finally:
        if mp is not None:
            mp.undo()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert words in paragraph, paragraph
    assert not (tmp_path / "run").exists()


def test_the_units_fsdp_shards_are_each_models_repeated_block():
    from common import vision

    expected = {"resnet18": "BasicBlock", "vit_b_16": "EncoderBlock", "convnext_tiny": "CNBlock"}
    expected["mobilenet_v3_large"] = "InvertedResidual"
    expected["resnet10t"] = "BasicBlock"  # timm's
    for name, block in expected.items():
        assert vision.build(name, 5, 224)._no_split_modules == [block], name
