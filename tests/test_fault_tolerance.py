"""The reliability promises: exact resume, crash-safe checkpoints, preemption, failures, scale-out."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    ACCELERATE,
    REPO,
    check_ok,
    free_port,
    import_recipe,
    launch,
    read_jsonl,
    recipe_env,
    run_in_process,
    run_in_process_signalled,
    stopped_at,
)

MLP = ["--hidden", "32"]
CONV = ["--width", "8"]


def weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def losses(run: Path) -> list:
    return [(r["step"], r["train/loss"]) for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]


def checkpoints(run: Path) -> list[Path]:
    from common.train.checkpoint import complete_checkpoints

    return complete_checkpoints(run)


def run(recipe, args, env, nproc=1):
    """1 process in this process; 2 processes as real gloo processes through `accelerate launch`."""
    return run_in_process(recipe, args, env) if nproc == 1 else launch(recipe, args, env, nproc=nproc)


@pytest.mark.parametrize("nproc", [1, 2])
def test_mid_epoch_resume_is_exact(nproc, tmp_path, env, reference_run):
    """Stopped mid-epoch (step 5 of 9 in epoch 1) and resumed: same weights and per-step losses as the
    uninterrupted reference run (--checkpoint-every 5). LeanConvNet with BatchNorm, so data
    order, RNG and BN statistics all have to continue. 1 process: stopped by --max-steps 5, in this
    process, resumed to the end of epoch 1 (--max-steps 9), stopped there and resumed from the epoch
    boundary to the end. 2 processes (real gloo processes): resumed from the reference run's own step-5
    checkpoint, with metrics logged past it as after a crash."""
    ref = reference_run("mnist_convnet", nproc)
    args, full, part = ref.train_args, ref.run, tmp_path / "part"
    assert "--checkpoint-every" in args and "--dropout" not in args
    if nproc == 1:
        check_ok(run_in_process("mnist_convnet", [*args, "--output-dir", part, "--max-steps", 5], env))
        assert json.loads((part / "summary.json").read_text())["global_step"] == 5
    else:
        stopped_at(full, 5, part)
    state = json.loads((checkpoints(part)[-1] / "trainer_state.json").read_text())
    assert (state["epoch"], state["batches_in_epoch"], state["global_step"]) == (0, 5, 5)
    # step 5 evaluated before it checkpointed: the checkpoint's best is that evaluation's accuracy
    at_5 = [r["eval/accuracy"] for r in read_jsonl(full / "metrics.jsonl") if r["step"] == 5 and "eval/accuracy" in r]
    assert at_5 and state["best"] == at_5[0], (state["best"], at_5)
    if nproc == 1:  # 1 process goes on in two legs: to the end of epoch 1 (--max-steps 9), then to the end
        proc = check_ok(
            run("mnist_convnet", [*args, "--output-dir", part, "--resume-from", "latest", "--max-steps", 9], env, nproc)
        )
        assert "resumed from" in proc.stdout and "epoch 1, batch 5, step 5" in proc.stdout
        assert json.loads((part / "summary.json").read_text())["epochs_completed"] == 1
        proc = check_ok(run("mnist_convnet", [*args, "--output-dir", part, "--resume-from", "latest"], env, nproc))
        assert "resumed from" in proc.stdout and "step 9" in proc.stdout  # from the epoch boundary
    else:
        proc = check_ok(run("mnist_convnet", [*args, "--output-dir", part, "--resume-from", "latest"], env, nproc))
        assert "resumed from" in proc.stdout and "epoch 1, batch 5, step 5" in proc.stdout
    for folder in ("final", "best"):
        a = load_file(str(full / folder / "model.safetensors"))
        b = load_file(str(part / folder / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
    summaries = [json.loads((r / "summary.json").read_text()) for r in (full, part)]
    assert summaries[0]["best"] == summaries[1]["best"] and summaries[0]["final"] == summaries[1]["final"]
    assert losses(full) == losses(part) and len(losses(full)) == 18


def test_incomplete_checkpoints_are_ignored_and_retention_keeps_the_newest(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        2,
        "--batch-size",
        32,
        *MLP,
        "--checkpoint-every",
        2,
        "--keep-checkpoints",
        2,
        "--output-dir",
        run,
    ]
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--max-steps", 6], env))
    kept = checkpoints(run)
    assert [json.loads((p / "trainer_state.json").read_text())["global_step"] for p in kept] == [4, 6]
    # a crash during a write leaves a temp folder, or a renamed folder without the marker
    (run / "checkpoints" / ".tmp-step-00000008").mkdir()
    fake = run / "checkpoints" / "step-00000099"
    fake.mkdir()
    (fake / "trainer_state.json").write_text(json.dumps({"global_step": 99}))
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout and "step-00000006" in proc.stdout
    assert not fake.exists() and checkpoints(run)[-1].name == "step-00000018"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT])  # torchrun forwards QUIT too
def test_sigterm_checkpoints_exits_75_and_the_same_command_resumes(tmp_path, env, mnist_like, sig, foreground_signals):
    """SIGTERM to a running process: it finishes the step, writes a checkpoint, records "preempted", exits
    75 and says how to continue; the same command resumes. In this process (the signal handler and the
    stop path are the same code at any process count); a TERM reaching both ranks of a real 2-process
    launch through the launcher is tests/test_slurm.py::test_batch_script_checkpoints_requeues_and_resumes."""

    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        400,
        "--batch-size",
        32,
        *MLP,
        "--log-every",
        1,
        "--output-dir",
        run,
        "--resume-from",
        "latest",
    ]
    proc = run_in_process_signalled("fashion_mnist_mlp", args, env, run, "train/loss", 2, sig)  # once training
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"stopped by signal {sig.name} at step" in out and "--resume-from latest to continue" in out, out
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted"
    ckpts = checkpoints(run)
    assert ckpts, "no checkpoint written on SIGTERM"
    step = json.loads((ckpts[-1] / "trainer_state.json").read_text())["global_step"]
    assert 0 < step < 400 * 9
    again = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--max-steps", step + 3], env))
    assert "resumed from" in again.stdout and f"step {step}" in again.stdout


def test_a_stop_request_ends_the_phases_with_nothing_to_checkpoint_at_once(
    tmp_path, env, mnist_like, monkeypatch, foreground_signals
):
    """TERM while the data is decoded, and TERM during the final evaluation: each ends the process at once with
    exit 75 and "preempted" in summary.json (the data phase has trained nothing; the final evaluation follows
    the last checkpoint), and the same command then finishes the run. A second Ctrl-C during training ends the
    process at once, without waiting for the step."""
    import common.data.decoded as decoded_module
    from common.train.run import watching
    from common.train.stopping import StopFlag

    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        1,
        "--batch-size",
        32,
        *MLP,
        "--output-dir",
        run,
        "--resume-from",
        "latest",
        "--cache-dir",
        tmp_path / "cache",
    ]
    real_decode, t0 = decoded_module.decode_split, time.time()

    def decode_then_terminated(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # a long decode: the signal must end it, not the sleep
        return real_decode(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(decoded_module, "decode_split", decode_then_terminated)
        proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 75 and time.time() - t0 < 50, proc.stderr[-2000:]
    assert (
        "while reading the data" in proc.stdout
        and json.loads((run / "summary.json").read_text())["status"] == "preempted"
    )

    flags, real_evaluate = [], import_recipe("fashion_mnist_mlp").evaluate
    real_interruptible = StopFlag.interruptible

    def remember(self, phase):
        flags.append(self)
        return real_interruptible(self, phase)

    def evaluate_then_terminated(*a, **kw):
        if flags and flags[-1].phase == "running the final evaluation":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        return real_evaluate(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(StopFlag, "interruptible", remember)
        mp.setattr(import_recipe("fashion_mnist_mlp"), "evaluate", evaluate_then_terminated)
        proc = run_in_process("fashion_mnist_mlp", args, env)
    assert proc.returncode == 75 and "while running the final evaluation" in proc.stdout, proc.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted" and not (run / "final").exists()
    again = check_ok(run_in_process("fashion_mnist_mlp", args, env))
    assert "resumed from" in again.stdout and (run / "final" / "model.safetensors").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"

    def two_ctrl_c(run):
        if run.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    with watching(before_update=two_ctrl_c):
        with pytest.raises(KeyboardInterrupt):  # out of main(), as from `python recipe.py`: Python exits 130
            run_in_process("fashion_mnist_mlp", [*args[:8], "--output-dir", tmp_path / "run2"], env)
    assert not (tmp_path / "run2" / "checkpoints").exists()  # ended at once: no stop checkpoint


def test_best_and_final_are_restored_after_a_crash_between_their_two_renames(tmp_path):
    from common.train.checkpoint import restore_interrupted_swaps

    (tmp_path / ".old-best").mkdir()
    (tmp_path / ".old-best" / "model.json").write_text("{}")
    (tmp_path / "final").mkdir()
    (tmp_path / ".old-final").mkdir()  # final/ exists: the swap finished, the leftover is not restored
    assert restore_interrupted_swaps(tmp_path) == ["best"]
    assert (tmp_path / "best" / "model.json").exists() and (tmp_path / ".old-final").exists()


def test_sigkill_mid_run_resumes_from_last_complete_checkpoint(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        400,
        "--batch-size",
        32,
        *MLP,
        "--checkpoint-every",
        3,
        "--output-dir",
        run,
        "--resume-from",
        "latest",
    ]
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu.yaml"),
        str(REPO / "recipes" / "fashion_mnist_mlp.py"),
        *map(str, args),
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(checkpoints(run)) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    # killed outright: summary.json tells the truth, "running" from this start (written at its start)
    assert json.loads((run / "summary.json").read_text())["status"] == "running"
    last = json.loads((checkpoints(run)[-1] / "trainer_state.json").read_text())["global_step"]
    again = check_ok(run_in_process("fashion_mnist_mlp", [*args, "--max-steps", last + 3], env))
    assert "resumed from" in again.stdout and f"step {last}" in again.stdout


KILL_DURING_SAVE = """
import os, signal, sys
import safetensors.torch
from helpers import run_in_process

real, calls = safetensors.torch.save_file, []


def save_then_die(*args, **kwargs):  # the second checkpoint dies after its first file
    real(*args, **kwargs)
    calls.append(args[1] if len(args) > 1 else kwargs.get("filename"))
    if sum(".tmp-step-" in str(c) for c in calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)


safetensors.torch.save_file = save_then_die
run_in_process("fashion_mnist_mlp", sys.argv[1:], dict(os.environ))
"""


def test_a_kill_during_a_checkpoint_write_and_a_damaged_complete_checkpoint(tmp_path, env, mnist_like):
    """SIGKILL between two files of a checkpoint write: the half-written folder is never resumed from. Then
    the newest checkpoint, marked complete, loses the end of its weights (what a power loss can leave of
    files that were not fsynced): --resume-from latest says so, keeps it as damaged-step-N and resumes from
    the previous one. Both resumes end with the same weights as an uninterrupted run."""
    base = [
        "--dataset",
        mnist_like,
        "--epochs",
        2,
        "--batch-size",
        32,
        *MLP,
        "--checkpoint-every",
        2,
        "--keep-checkpoints",
        10,
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", full], env))
    killed = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, *map(str, base), "--output-dir", str(part)],
        env={
            **env,
            "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO / "benchmarks"), env.get("PYTHONPATH", "")]),
        },
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [c.name for c in checkpoints(part)] == ["step-00000002"]
    assert any(p.name.startswith(".tmp-step-") for p in (part / "checkpoints").iterdir())
    check_ok(
        run_in_process(
            "fashion_mnist_mlp", [*base, "--output-dir", part, "--resume-from", "latest", "--max-steps", 6], env
        )
    )
    newest = checkpoints(part)[-1]
    weights_file = next(newest.glob("model*.safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", part, "--resume-from", "latest"], env))
    assert f"the newest checkpoint {newest} is damaged" in proc.stdout, proc.stdout
    assert (newest.parent / f"damaged-{newest.name}").is_dir()
    a, b = weights(full), weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_loss_stops_every_rank_before_the_step(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    proc = launch(
        "fashion_mnist_mlp",
        [
            "--dataset",
            mnist_like,
            "--epochs",
            2,
            "--batch-size",
            32,
            *MLP,
            "--lr",
            "1e30",
            "--warmup-fraction",
            0,
            "--checkpoint-every",
            1,
            "--output-dir",
            run,
        ],
        env,
        nproc=2,
    )
    assert proc.returncode != 0
    assert "non-finite at optimizer step" in proc.stderr and "that update was skipped on every process" in proc.stderr
    assert "Last good checkpoint" in proc.stderr or "No checkpoint predates" in proc.stderr  # what to resume
    assert proc.stderr.count("non-finite at optimizer step") == 2  # both ranks stopped themselves
    bad_step = int(proc.stderr.split("non-finite at optimizer step ")[1].split()[0])
    assert all(json.loads((p / "trainer_state.json").read_text())["global_step"] < bad_step for p in checkpoints(run))
    from safetensors.torch import load_file

    # the update was masked on the device and the flags read a step late: no checkpoint holds a NaN weight
    assert checkpoints(run) and all(
        torch.isfinite(t).all() for p in checkpoints(run) for t in load_file(str(p / "model.safetensors")).values()
    )
    assert not (run / "final").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "nonfinite_loss"


def test_one_failing_rank_ends_the_job(tmp_path, env, mnist_like):
    """Rank 1 raises at its 3rd loss computation; the job ends non-zero with the error shown, because the
    launcher stops the other rank: the collective timeout (--timeout-s 600) is far longer than this test
    waits (150 s), so a job that hung in a collective would fail here with TimeoutExpired instead; and
    summary.json says how the run ended, not "running"."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch.nn.functional as F\n"
        "    _ce, _n = F.cross_entropy, [0]\n"
        "    def cross_entropy(*a, **k):\n"
        "        _n[0] += 1\n"
        "        if _n[0] == 3:\n"
        "            raise RuntimeError('injected failure on rank 1')\n"
        "        return _ce(*a, **k)\n"
        "    F.cross_entropy = cross_entropy\n"
    )
    env = {**env, "PYTHONPATH": str(inject)}
    t0 = time.time()
    proc = launch(
        "fashion_mnist_mlp",
        [
            "--dataset",
            mnist_like,
            "--epochs",
            50,
            "--batch-size",
            32,
            *MLP,
            "--timeout-s",
            600,
            "--output-dir",
            tmp_path / "run",
        ],
        env,
        nproc=2,
        timeout=150,
    )
    assert proc.returncode != 0 and time.time() - t0 < 150
    assert "injected failure on rank 1" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] in ("crashed", "preempted"), summary  # rank 0 stopped by the launcher, or its peer's loss


def test_resume_refuses_another_model(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    base = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--max-steps", 2, "--output-dir", run]
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--hidden", "32"], env))
    proc = run_in_process("fashion_mnist_mlp", [*base, "--hidden", "64", "--resume-from", "latest"], env)
    assert proc.returncode == 2
    assert "different model" in proc.stderr and "Traceback" not in proc.stderr
    assert "The run used --hidden '32' (this command: '64')" in proc.stderr, proc.stderr[-2000:]


def tree(run: Path) -> dict:
    """Every file of a run directory with its size and modification time."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def test_resume_refuses_settings_that_change_what_the_run_means(tmp_path, env, mnist_like):
    """--seed, --val-fraction, --grad-accum and --dataset decide the held-out images and the data position:
    a resume that gives another value is refused with the flag named and the run directory untouched; left
    out, the run's own value is used. Data that changed under the same path is refused too. A changed
    --epochs is accepted with a note saying how the LR schedule moves."""
    run = tmp_path / "run"
    base = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--output-dir", run]
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--seed", 3, "--val-fraction", 0.2, "--max-steps", 4], env))
    before = tree(run)
    other = tmp_path / "other"
    other.symlink_to(mnist_like, target_is_directory=True)
    for flag, value in [("--seed", 4), ("--val-fraction", 0.3), ("--grad-accum", 2), ("--dataset", other)]:
        proc = run_in_process(
            "fashion_mnist_mlp",
            [*base, "--seed", 3, "--val-fraction", 0.2, flag, value, "--resume-from", "latest"],
            env,
        )
        assert proc.returncode == 2 and "Refusing to resume" in proc.stderr and flag in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and tree(run) == before, flag
    proc = check_ok(
        run_in_process("fashion_mnist_mlp", [*base, "--epochs", 3, "--max-steps", 6, "--resume-from", "latest"], env)
    )
    assert "resuming with the run's own --val-fraction 0.2, --seed 3" in proc.stdout, proc.stdout
    assert "--epochs 3 differs from the run's 2: the LR schedule is recomputed" in proc.stdout
    # the same folder with other images: the held-out split would differ
    moved = tmp_path / "data"
    import shutil

    shutil.copytree(mnist_like, moved)
    run2 = tmp_path / "run2"
    args = ["--dataset", moved, "--epochs", 2, "--batch-size", 32, *MLP, "--output-dir", run2]
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--max-steps", 2], env))
    from helpers import write_parquet_dataset

    write_parquet_dataset(moved, {"train": 320}, seed=9)
    before = tree(run2)
    proc = run_in_process("fashion_mnist_mlp", [*args, "--resume-from", "latest"], env)
    assert proc.returncode == 2 and "The data differs from what the checkpoint" in proc.stderr, proc.stderr
    # found once the data is read, after the run directory was claimed: only the claim's lock token is new, and
    # summary.json says this launch's ending (a requeue script reads it), keeping the run's scores and earlier status
    kept = {k: v for k, v in tree(run2).items() if k not in (".lock", "summary.json")}
    assert kept == {k: v for k, v in before.items() if k not in (".lock", "summary.json")}
    said = json.loads((run2 / "summary.json").read_text())
    assert (said["status"], said["previous"]["status"], said["global_step"]) == ("bad_input", "completed", 2), said
    assert said["final"] and "The data differs" in said["error"]


def test_a_stop_on_the_last_step_still_evaluates_the_last_epoch_after_resume(tmp_path, env, mnist_like, monkeypatch):
    """A stop request that lands on the run's very last step: the checkpoint is written and the run exits 75;
    the resume has no batches left but still runs the last epoch's evaluation and end, so its summary
    (epochs completed, best, final) equals the uninterrupted run's."""
    from common.train.run import watching

    base = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", full], env))

    def stop_on_the_last_step(run):
        if run.step + 1 == run.ckpt.total_steps:
            run.stop.reason = "a test's stop request"

    with watching(before_update=stop_on_the_last_step):
        proc = run_in_process("fashion_mnist_mlp", [*base, "--output-dir", part], env)
    assert proc.returncode == 75, proc.stderr[-2000:]
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", part, "--resume-from", "latest"], env))
    a, b = (json.loads((r / "summary.json").read_text()) for r in (full, part))
    assert a["epochs_completed"] == b["epochs_completed"] == 2
    assert a["best"] == b["best"] and a["final"] == b["final"] and a["global_step"] == b["global_step"]


def test_resume_from_a_path_checks_the_run_directory_and_a_lock_error_is_named(tmp_path, env, mnist_like, monkeypatch):
    """--resume-from PATH of a checkpoint that someone sent you (in a downloads folder): without --output-dir it is
    refused (the folder above it is not a run, and must not become one); with a new --output-dir the run
    continues there and writes its config.json; a dataset folder as --output-dir is refused. A lock the
    filesystem cannot take is named as that, not as "in use"."""
    import shutil

    import common.train.rundir as rundir_module

    run = tmp_path / "run"
    base = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, *MLP]
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--output-dir", run, "--max-steps", 2], env))
    downloads = tmp_path / "downloads"
    received = shutil.copytree(checkpoints(run)[-1], downloads / checkpoints(run)[-1].name)
    before = sorted(p.name for p in downloads.iterdir())
    proc = run_in_process("fashion_mnist_mlp", [*base, "--resume-from", received], env)
    assert proc.returncode == 2 and "outside a run directory" in proc.stderr, proc.stderr
    assert sorted(p.name for p in downloads.iterdir()) == before
    proc = run_in_process("fashion_mnist_mlp", [*base, "--resume-from", received, "--output-dir", mnist_like], env)
    assert proc.returncode == 2 and "holds files that are not a run" in proc.stderr, proc.stderr
    new = tmp_path / "continued"
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*base, "--resume-from", received, "--output-dir", new], env))
    assert "resumed from" in proc.stdout and (new / "config.json").is_file() and (new / "final").is_dir()

    def no_lock_service(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(rundir_module.fcntl, "flock", no_lock_service)
    proc = run_in_process("fashion_mnist_mlp", [*base, "--output-dir", tmp_path / "nfs"], env)
    assert proc.returncode == 2 and "refused a file lock (No locks available)" in proc.stderr, proc.stderr
    assert "in use by another run" not in proc.stderr


def test_resume_on_another_world_size_keeps_global_batch(tmp_path, env, reference_run):
    """The 2-process MLP reference run's mid-epoch step-5 checkpoint resumed on 1 process: the global batch
    stays 32 (1 x 32 instead of 2 x 16), the change is said, and the run ends with the weights of the
    uninterrupted 2-process run (no dropout, no BatchNorm: 1 x 32 equals 2 x 16)."""
    ref = reference_run("fashion_mnist_mlp", 2)
    part = stopped_at(ref.run, 5, tmp_path / "part")
    proc = check_ok(
        run_in_process("fashion_mnist_mlp", [*ref.train_args, "--output-dir", part, "--resume-from", "latest"], env)
    )
    assert "written by 2 process(es), this run has 1" in proc.stdout
    assert "per_process_batch=32" in proc.stdout and "epoch 1, batch 5, step 5" in proc.stdout
    a, b = weights(ref.run), weights(part)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    (steps, values), (ref_steps, ref_values) = zip(*losses(part)), zip(*losses(ref.run))
    assert steps == ref_steps == tuple(range(1, 17)) and values == pytest.approx(ref_values, rel=1e-4)


# NCHW: in channels_last a 16-image and a 32-image batch do not round alike, and the weights drift past this
# comparison's 1e-4 within 4 AdamW steps (measured); BatchNorm alone is compared here
SYNC_BN = [
    "--epochs",
    1,
    "--batch-size",
    32,
    *CONV,
    "--dropout",
    0,
    "--translate",
    0,
    "--max-steps",
    4,
    "--sync-bn",
    "--channels-last",
    "false",
]


@pytest.fixture(scope="module")
def sync_bn_on_a_busy_port(tmp_path_factory, mnist_like):
    """One real 2-process --sync-bn run, read by two tests: launched on a port another socket holds, as
    happens on a shared machine. Returns (run dir, finished process, the busy port, env)."""
    root = tmp_path_factory.mktemp("sync_bn")
    env = recipe_env(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = launch(
            "mnist_convnet", ["--dataset", mnist_like, *SYNC_BN, "--output-dir", root / "two"], env, nproc=2, port=port
        )
    return root / "two", proc, port, env


def test_sync_bn_two_processes_equals_one_process_full_batch(tmp_path, env, mnist_like, sync_bn_on_a_busy_port):
    """Per-rank augmentation draws differ by design, so --translate 0: this compares BatchNorm alone."""
    two, proc, _, _ = sync_bn_on_a_busy_port
    check_ok(proc)
    assert "processes=2" in proc.stdout and "backend=gloo" in proc.stdout
    one = tmp_path / "one"
    check_ok(run_in_process("mnist_convnet", ["--dataset", mnist_like, *SYNC_BN, "--output-dir", one], env))
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5, msg=k)


def test_two_nodes_over_loopback_train_together(tmp_path, env, mnist_like):
    """Two 'machines' (node ranks 0 and 1, one process each) on this host, joined over 127.0.0.1."""
    port = free_port()
    run = tmp_path / "run"
    procs = []
    for rank in (0, 1):
        cmd = [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            str(REPO / "recipes" / "fashion_mnist_mlp.py"),
            "--dataset",
            str(mnist_like),
            "--epochs",
            "1",
            "--batch-size",
            "32",
            *MLP,
            "--max-steps",
            "3",
            "--output-dir",
            str(run),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
    assert "processes=2" in outs[0][0] and "backend=gloo" in outs[0][0]
    assert (run / "final" / "model.safetensors").exists()


def test_port_in_use(tmp_path, env, mnist_like, sync_bn_on_a_busy_port):
    """One machine: Accelerate moves to a free port, says so, and the run trains (the 2-process --sync-bn
    run above was launched on a busy port). Multi-node: a clear error, no hang."""
    two, single, port, _ = sync_bn_on_a_busy_port
    check_ok(single)
    assert f"Port `{port}` is already in use" in single.stderr
    assert (two / "final" / "model.safetensors").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        recipe = [
            str(REPO / "recipes" / "fashion_mnist_mlp.py"),
            "--dataset",
            str(mnist_like),
            *MLP,
            "--max-steps",
            "2",
        ]
        multi = subprocess.run(
            [
                ACCELERATE,
                "launch",
                "--multi_gpu",
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--machine_rank",
                "0",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                *recipe,
                "--output-dir",
                str(tmp_path / "b"),
            ],
            env=env,
            cwd=str(REPO),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert multi.returncode != 0
    assert "another process is utilizing it" in multi.stderr


def test_files_of_yours_in_a_checkpoint_are_left_alone_not_called_damaged(tmp_path, env, mnist_like):
    """An intact checkpoint that also holds an empty `.ipynb_checkpoints/` (Jupyter leaves one in any folder it
    browses) and a notes file: the resume reads only what Accelerate and the run wrote, resumes from that checkpoint
    (not an older one), names the extra entries in a NOTE and leaves them where they are."""
    run = tmp_path / "run"
    base = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--output-dir", run]
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--checkpoint-every", 2, "--max-steps", 4], env))
    newest = checkpoints(run)[-1]
    (newest / ".ipynb_checkpoints").mkdir()
    (newest / "notes.txt").write_text("lr looked high\n")
    proc = check_ok(run_in_process("fashion_mnist_mlp", [*base, "--max-steps", 6, "--resume-from", "latest"], env))
    assert f"resumed from {newest}: epoch 1, batch 4, step 4" in proc.stdout, proc.stdout
    assert ".ipynb_checkpoints/, notes.txt: not read by the resume, left as it is" in proc.stdout
    assert "damaged" not in proc.stdout + proc.stderr
    assert (newest / ".ipynb_checkpoints").is_dir() and (newest / "notes.txt").is_file()


def test_a_kill_between_the_two_renames_of_a_step_written_again_keeps_that_step(tmp_path, env, mnist_like):
    """A checkpoint of a step already written (a later position at the same step) is swapped in by two renames:
    step-N to .old-step-N, then the new one to step-N. Killed between them, the run has .old-step-N complete, a
    .tmp-step-N without its marker and no step-N: the resume takes .old-step-N (that step, not an older checkpoint)
    and ends with the uninterrupted run's weights; the next completion leaves no .old folder behind."""
    import shutil

    base = ["--dataset", mnist_like, "--epochs", 2, "--batch-size", 32, *MLP, "--checkpoint-every", 2]
    full, part = tmp_path / "full", tmp_path / "part"
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--max-steps", 8, "--output-dir", full], env))
    check_ok(run_in_process("fashion_mnist_mlp", [*base, "--max-steps", 4, "--output-dir", part], env))
    root = part / "checkpoints"
    assert [c.name for c in checkpoints(part)] == ["step-00000002", "step-00000004"]
    (root / "step-00000004").rename(root / ".old-step-00000004")  # the first rename of the swap
    shutil.copytree(root / ".old-step-00000004", root / ".tmp-step-00000004")
    (root / ".tmp-step-00000004" / "COMPLETE").unlink()  # the new copy, not yet marked: killed here
    proc = check_ok(
        run_in_process(
            "fashion_mnist_mlp", [*base, "--max-steps", 8, "--output-dir", part, "--resume-from", "latest"], env
        )
    )
    assert f"resumed from {root / '.old-step-00000004'}: epoch 1, batch 4, step 4" in proc.stdout, proc.stdout
    a, b = weights(full), weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], sorted(p.name for p in root.iterdir())
