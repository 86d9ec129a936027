"""Each answer `accelerate config` gives does what it says or stops before any data is read, in one paragraph naming
what to choose instead. The config file, the launcher's flags and ACCELERATE_* variables all reach a recipe as its
environment: the variables are tried in this process (fast), the flags and config files through the real launcher
(integration)."""

from __future__ import annotations

import subprocess

import pytest

from helpers import ACCELERATE, REPO, free_port, recipe_env, run_in_process

MLP = ["--hidden", 16, "--batch-size", 32, "--max-steps", 2, "--epochs", 1]

REFUSED = {  # the environment an answer gives -> words of the paragraph
    "fsdp": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "FSDP"),
    "fsdp v1": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP"),
    "deepspeed": ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed"),
    "fp8": ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "fp8"),
    "unknown precision": ({"ACCELERATE_MIXED_PRECISION": "half"}, "is not a precision Accelerate knows"),
    "accumulation against --grad-accum": ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, "cannot do both"),
}


def data_read(tmp_path) -> bool:
    return (tmp_path / "decoded-cache").exists() or (tmp_path / "run").exists()


@pytest.mark.parametrize("answer", list(REFUSED))
def test_an_answer_the_recipes_cannot_honour_stops_before_the_data(answer, tmp_path, mnist_like):
    """Before: FSDP (v2) and DeepSpeed trained plain DDP unsaid, FSDP v1 died in Accelerator() with a traceback,
    fp8 was a label on a bf16 run (or a 19-line traceback without its package)."""
    env_vars, words = REFUSED[answer]
    env = {**recipe_env(tmp_path), **env_vars}
    extra = ["--grad-accum", 2] if "grad-accum" in answer else []
    proc = run_in_process(
        "fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, *extra, "--output-dir", tmp_path / "run"], env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert words in paragraph, paragraph
    assert not data_read(tmp_path)


@pytest.mark.parametrize(
    "env_vars,expect",
    [
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"}, "grad_accum=2"),
        ({"ACCELERATE_MIXED_PRECISION": "BF16"}, "precision="),  # any letter case, as a SLURM script may write it
        ({"ACCELERATE_MIXED_PRECISION": "FP16"}, "fp16 was asked for but this is a CPU"),
    ],
)
def test_an_answer_the_recipes_honour_is_said_on_the_startup_line(env_vars, expect, tmp_path, mnist_like):
    """Before, Accelerate's gradient accumulation trained with grad_accum=1 unsaid, and BF16 ended in a traceback."""
    env = {**recipe_env(tmp_path), **env_vars}
    proc = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, "--output-dir", tmp_path / "run"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    startup = next(line for line in proc.stdout.splitlines() if line.startswith("startup:"))
    assert expect in startup, startup
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in env_vars:
        assert "from the launcher (ACCELERATE_GRADIENT_ACCUMULATION_STEPS), as --grad-accum 2" in startup


CONFIG_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: false
"""
CONFIG_FP8 = CONFIG_FSDP.replace("distributed_type: FSDP", "distributed_type: 'NO'").replace("'no'", "fp8")


@pytest.mark.integration
def test_the_launchers_spellings_of_the_same_answers(tmp_path, mnist_like):
    """The same answers through `accelerate launch`: its flags and a config file as `accelerate config` writes it."""
    (tmp_path / "fsdp.yaml").write_text(CONFIG_FSDP)
    (tmp_path / "fp8.yaml").write_text(CONFIG_FP8)
    cases = [
        (["--use_fsdp", "--fsdp_version", "2"], "FSDP"),
        (["--use_fsdp"], "FSDP"),
        (["--config_file", tmp_path / "fsdp.yaml"], "FSDP"),
        (["--mixed_precision", "fp8"], "fp8"),
        (["--config_file", tmp_path / "fp8.yaml"], "fp8"),
        (["--gradient_accumulation_steps", "2"], "grad_accum=2"),
    ]
    for i, (launch_args, words) in enumerate(cases):
        out = tmp_path / f"case{i}"
        cmd = [ACCELERATE, "launch", *map(str, launch_args), "--num_processes", "1", "--main_process_port"]
        cmd += [str(free_port()), str(REPO / "recipes" / "fashion_mnist_mlp.py")]
        cmd += [str(a) for a in ["--dataset", mnist_like, *MLP, "--output-dir", out / "run"]]
        proc = subprocess.run(cmd, env=recipe_env(out), cwd=str(REPO), capture_output=True, text=True, timeout=180)
        if words == "grad_accum=2":
            assert proc.returncode == 0 and words in proc.stdout, proc.stderr[-3000:]
            continue
        assert proc.returncode != 0, launch_args
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        # fp8 without torchao, Transformer Engine or MS-AMP: the launcher itself refuses before the recipe starts
        launcher_refused = words == "fp8" and "FP8 is not available on this machine" in proc.stderr
        assert launcher_refused or (errors and words in errors[0]), (launch_args, proc.stderr[-3000:])
        assert not data_read(out), launch_args


def test_bf16_on_a_cpu_without_native_bf16_is_said_once_in_the_startup_line(tmp_path, mnist_like, monkeypatch):
    """The CPU configs ask for bf16; a CPU without AMX or AVX512-BF16 trains fp32 and says so once, in the startup
    line (precision=no, "no native bf16"), with no Python warning and its file path; --eval-only says it in one NOTE
    line of its own."""
    import warnings

    import common.train.accelerator as accelerator_module

    monkeypatch.setattr(accelerator_module, "cpu_bf16_support", lambda: "")
    env = {**recipe_env(tmp_path), "ACCELERATE_MIXED_PRECISION": "bf16"}
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proc = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, *MLP, "--output-dir", run], env)
    assert proc.returncode == 0, proc.stderr
    said = (proc.stdout + proc.stderr).count("has no native bf16")
    [startup] = [line for line in proc.stdout.splitlines() if line.startswith("startup:")]
    assert said == 1 and "precision=no" in startup and "no native bf16 (no AMX or AVX512-BF16)" in startup, startup
    assert "emulated" not in startup and "(cpu x" in startup and "threads, no native bf16)" in startup
    assert not [w for w in caught if "bf16" in str(w.message)] and "UserWarning" not in proc.stderr
    scored = run_in_process("fashion_mnist_mlp", ["--dataset", mnist_like, "--eval-only", "--checkpoint", run], env)
    assert scored.returncode == 0, scored.stderr
    assert [line for line in scored.stdout.splitlines() if "has no native bf16" in line][0].startswith("NOTE: ")
