"""Promises that must hold under the real launcher: a killed launcher leaves no orphans, one writer per
run directory, the outcome recorded in summary.json, no hang without a shared filesystem, saves that never
keep an abandoned run's state, hyperparameters applied on resume, fp16 skipped steps detected, the weight
average equal on every rank, one metrics.jsonl line per step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ACCELERATE, REPO, check_ok, free_port, read_jsonl, run_in_process

MLP = ["--hidden", "32", "--lr", "4e-3"]  # the default LR given: at --batch-size 32 the LR rule would scale it


def status(run: Path) -> str:
    return json.loads((run / "summary.json").read_text())["status"]


def pids_running(needle: str) -> list[int]:
    """Python processes whose command line mentions ``needle`` (the test's unique run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if needle in cmd and "recipes/" in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def start(recipe: str, args, env, config: str, cwd=REPO) -> subprocess.Popen:
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(REPO / "accelerate_configs" / config),
        "--main_process_port",
        str(free_port()),
        str(REPO / "recipes" / f"{recipe}.py"),
        *map(str, args),
    ]
    # A session of its own, as a terminal or a batch system would give it; we signal only the launcher.
    return subprocess.Popen(
        cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def signal_the_launcher_only(launcher: subprocess.Popen, sig: int, run: Path) -> None:
    """``sig`` to the launcher alone, not its process group; then every process of ``run`` (the test's
    unique run directory) must exit on its own within seconds."""
    os.kill(launcher.pid, sig)
    launcher.communicate(timeout=30)
    wait_for(lambda: not pids_running(str(run)), 20, "the orphaned workers to exit")


def kill_leftovers(run: Path) -> None:
    for pid in pids_running(str(run)):
        os.kill(pid, signal.SIGKILL)


def test_killed_launcher_leaves_no_orphans(tmp_path, env, mnist_like):
    """kill -9 of torchrun with 2 workers: its workers notice within seconds, write a checkpoint, record
    'preempted' and exit; a rerun resumes. (The single-process launcher, which does not forward a TERM, is
    the next test.)"""
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
    proc = start("fashion_mnist_mlp", args, env, "cpu_2proc.yaml")
    try:
        wait_for(lambda: logged_steps(run) >= 3, 120, "the run to train a few steps")
        assert len(pids_running(str(run))) == 3  # the launcher and its 2 workers
        signal_the_launcher_only(proc, signal.SIGKILL, run)
    finally:
        kill_leftovers(run)
    assert status(run) == "preempted"
    from common.train.checkpoint import find_latest

    assert find_latest(run) is not None
    again = check_ok(
        run_in_process(
            "fashion_mnist_mlp", [*args[:-4], "--epochs", 1, "--output-dir", run, "--resume-from", "latest"], env
        )
    )
    assert "resumed from" in again.stdout


def test_a_nohup_run_survives_the_logout_of_its_shell(tmp_path, env, mnist_like):
    """README's `nohup python recipes/x.py ... > log &` from a login shell (a session of its own): the shell
    exits (the run is re-parented) and the logout's HUP reaches the run; it keeps training and completes.
    The same run under a launcher still stops when its launcher dies (test above)."""
    run, log = tmp_path / "run", tmp_path / "log"
    args = " ".join(
        [
            "--dataset",
            str(mnist_like),
            "--epochs",
            "10",
            "--batch-size",
            "32",
            *MLP,
            "--log-every",
            "1",
            "--output-dir",
            str(run),
        ]
    )
    shell = subprocess.run(
        ["bash", "-c", f"nohup {sys.executable} recipes/fashion_mnist_mlp.py {args} > {log} 2>&1 & echo $!"],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=30,
        start_new_session=True,
    )
    pid = int(shell.stdout.split()[-1])  # the shell has exited: the run's parent is gone
    try:
        wait_for(lambda: logged_steps(run) >= 3, 120, "the run to train a few steps")
        os.kill(pid, signal.SIGHUP)  # what the logout delivers
        wait_for(lambda: (run / "summary.json").exists() and status(run) != "running", 240, "the run to finish")
    finally:
        kill_leftovers(run)
    assert status(run) == "completed", log.read_text()[-2000:]
    assert "stopped by" not in log.read_text()


def test_one_writer_per_run_directory_and_a_terminated_launcher(tmp_path, env, mnist_like):
    """A second start on a directory a live (launched) run holds is refused, naming the holder's PID. Then
    a TERM to the single-process launcher alone (which does not forward it): the worker notices within
    seconds, checkpoints, records 'preempted', exits and so frees the directory; the same command resumes.
    (The lock also dies with a holder killed by -9: test_fault_tolerance's SIGKILL test resumes in place.)"""
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
        "--checkpoint-every",
        2,
    ]
    first = start("fashion_mnist_mlp", args, env, "cpu.yaml")
    try:
        wait_for(lambda: logged_steps(run) >= 3, 120, "the first run to train a few steps")
        assert len(pids_running(str(run))) == 2  # the launcher and its worker
        # the second start in this process: the refusal is the recipe's own, whatever launched it
        second = run_in_process("fashion_mnist_mlp", args, env)
        assert second.returncode != 0
        holder = (run / ".lock").read_text().split()[0]
        assert f"in use by another run (PID {holder}" in second.stderr
        assert int(holder) in pids_running(str(run))
        signal_the_launcher_only(first, signal.SIGTERM, run)
    finally:
        kill_leftovers(run)
    assert status(run) == "preempted"
    again = check_ok(run_in_process("fashion_mnist_mlp", [*args[:2], "--epochs", 1, *args[4:]], env))
    assert "resumed from" in again.stdout


def test_default_run_names_never_collide(tmp_path, monkeypatch):
    from common.train.rundir import new_default_dir

    monkeypatch.chdir(tmp_path)
    names = {new_default_dir("mlp") for _ in range(5)}  # the same second
    assert len(names) == 5 and all(p.is_dir() for p in names)


def test_no_shared_filesystem_is_refused_on_every_node(tmp_path, env, mnist_like):
    """Two loopback 'nodes' whose relative --output-dir resolves to different folders: both refuse at
    startup with the reason, instead of hanging in a collective until the timeout."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        node.mkdir()
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
            *MLP,
            "--max-steps",
            "3",
            "--output-dir",
            "runs/shared",
            "--timeout-s",
            "60",
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=str(node), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode != 0
        assert "not one folder shared by every process" in err, err[-2000:]
    assert not (tmp_path / "node1" / "runs" / "shared" / "config.json").exists()


def test_resume_from_an_older_checkpoint_with_new_hyperparameters(tmp_path, env, mnist_like):
    """Resuming from step 3 while steps 6 and 9 of the first continuation exist: the new run's saves are
    written (not skipped because a folder of that step exists), the abandoned ones are set aside, and the
    --lr given on the resuming command is applied, and said so."""
    run = tmp_path / "run"
    base = [
        "--dataset",
        mnist_like,
        "--epochs",
        2,
        "--batch-size",
        32,
        *MLP,
        "--log-every",
        1,
        "--checkpoint-every",
        3,
        "--keep-checkpoints",
        5,
        "--output-dir",
        run,
        "--max-steps",
        9,
    ]
    check_ok(run_in_process("fashion_mnist_mlp", base, env))
    again = check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [*base, "--resume-from", run / "checkpoints" / "step-00000003", "--lr", "1e-5", "--betas", "0.8,0.99"],
            env,
        )
    )
    # every field in common.config.RESUME_APPLIED, the recipe's own --betas too
    assert (
        "applied from the command line over the checkpoint's values: betas 0.9,0.999 -> 0.8,0.99, lr 0.004 -> 1e-05"
    ) in again.stdout
    from common.train.checkpoint import complete_checkpoints, read_state

    latest = complete_checkpoints(run)
    assert [read_state(p)["global_step"] for p in latest] == [3, 6, 9]
    assert all(read_state(p)["config"]["lr"] == 1e-5 for p in latest[1:])  # this run's saves, not the old ones
    assert len(list((run / "checkpoints").glob("superseded-*-step-00000006"))) == 1
    lrs = {r["step"]: r["train/lr"] for r in read_jsonl(run / "metrics.jsonl") if "train/lr" in r}
    assert lrs[3] > 1e-4 and 0 < lrs[4] <= 1e-5  # the step after the resume uses the new peak LR's schedule
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
    assert steps == sorted(set(steps))  # one line per step


def test_nonfinite_advice_works_when_followed(tmp_path, env, mnist_like):
    """A run diverges after a resume with a far too high --lr. The message names the checkpoint to resume
    and says to lower --lr; doing exactly that finishes the run (the lower --lr really applies)."""
    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        1,
        "--batch-size",
        32,
        *MLP,
        "--warmup-fraction",
        0,
        "--checkpoint-every",
        3,
        "--keep-checkpoints",
        5,
        "--log-every",
        1,
        "--output-dir",
        run,
    ]
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--max-steps", 3], env))
    bad = run_in_process("fashion_mnist_mlp", [*args, "--lr", "1e30", "--resume-from", "latest"], env)
    assert "lr 0.004 -> 1e+30" in bad.stdout  # the resuming command's --lr applies (it used to be ignored)
    assert bad.returncode != 0 and "lower --lr" in bad.stderr and status(run) == "nonfinite_loss"
    named = bad.stderr.split("--resume-from ")[1].split(";")[0]
    assert named.endswith("step-00000003")
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--lr", "1e-3", "--resume-from", named], env))
    assert status(run) == "completed"
    assert all(
        torch.isfinite(torch.tensor(r["train/loss"])) for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r
    )


def test_metrics_one_line_per_step_across_fresh_starts_and_finished_resumes(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    args = [
        "--dataset",
        mnist_like,
        "--epochs",
        1,
        "--batch-size",
        32,
        *MLP,
        "--log-every",
        2,
        "--output-dir",
        run,
        "--resume-from",
        "latest",
    ]
    first = check_ok(run_in_process("fashion_mnist_mlp", args, env))
    assert "nothing to resume in" in first.stdout and "starting fresh" in first.stdout
    rows = read_jsonl(run / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and "test/accuracy" in rows[-1] and "train/loss" in rows[-1]
    check_ok(run_in_process("fashion_mnist_mlp", args, env))  # resuming the finished run
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == steps
    import shutil

    shutil.rmtree(run / "checkpoints")  # no complete checkpoint left: the next start is a fresh one
    check_ok(run_in_process("fashion_mnist_mlp", args, env))
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == steps


def test_averaged_model_is_the_same_on_every_rank(tmp_path, env, reference_run):
    """2 processes, BatchNorm, Lookahead weight averaging (the 2-process cifar_cnn reference run): the
    final evaluation on 2 processes equals --eval-only of the saved final/ weights on 1 process, so every
    rank evaluated the model that was saved."""
    import shutil

    ref = reference_run("cifar_cnn", 2)
    run = tmp_path / "run"  # a copy: --eval-only writes its result next to the weights
    shutil.copytree(ref.run, run, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    final = json.loads((run / "summary.json").read_text())["final"]
    assert json.loads((run / "summary.json").read_text())["processes"] == 2
    check_ok(run_in_process("cifar_cnn", ["--eval-only", "--checkpoint", run / "final"], env))
    result = json.loads((run / "final" / "eval-test.json").read_text())
    assert result["count"] == final["test/count"] == 64 and result["processes"] == 1
    assert result["accuracy"] == final["test/accuracy"]
    assert result["loss"] == pytest.approx(final["test/loss"], rel=1e-5)


def test_fp16_skipped_steps_are_detected_with_a_fused_optimizer():
    """GradScaler('cpu') and fused AdamW: an overflowing step is skipped by the scaler while
    optimizer_step_was_skipped-style checks see nothing; the scale tells, and a run of skips stops."""
    from common.errors import NonFiniteLoss
    from common.train.guard import MAX_CONSECUTIVE_SKIPS, LossScaleWatch

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    watch = LossScaleWatch(scaler)

    def step(overflow: bool) -> bool:
        loss = model(torch.ones(3, 4)).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        taken = watch.step_taken()
        assert taken == (not torch.equal(before, model.weight))  # what really happened to the weights
        return taken

    assert step(False) and not step(True) and step(False)
    assert watch.skipped == 1
    with pytest.raises(NonFiniteLoss, match="skipped the last"):
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            step(True)


def test_step_guard_never_logs_a_nonfinite_loss_as_zero():
    """fp16: a non-finite loss is left out of the logged mean (the scaler skips the step); the sums start
    again per step."""
    from common.train.guard import StepGuard

    class OneProcess:
        device = torch.device("cpu")
        mixed_precision, num_processes = "fp16", 1

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    guard = StepGuard(OneProcess(), opt)
    guard.track(torch.tensor(2.0))
    guard.track(torch.tensor(float("nan")))
    guard.track(torch.tensor(4.0))
    # fp16: the loss scaler skips a non-finite step itself, so the flags are read a step late (no wait on a GPU)
    assert guard.check(stop_requested=True, step=1) is None
    assert StepGuard.read(guard.window) == (6.0, 2.0)  # the mean is 3.0: the NaN is left out
    flags = guard.check(stop_requested=False, step=2)
    assert (flags.step, flags.nonfinite, flags.stop) == (1, True, True)  # step 1's, read at step 2
    flags = guard.collect()  # read now (a log step, the end)
    assert (flags.step, flags.nonfinite, flags.stop) == (2, False, False)  # sums start again per step


CONFIG_OF_ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


@pytest.mark.parametrize(
    "launch_args,needle",
    [
        (
            ["--num_processes", "2"],
            "`accelerate launch` with --num_processes 2 starts one process on a machine without a GPU",
        ),
        (  # Accelerate's hyphen spelling: before, the note said the run used 1 core of 2 instead
            ["--num-processes=2"],
            "`accelerate launch` with --num_processes 2 starts one process on a machine without a GPU",
        ),
        ([], "this process runs on 1 of the"),
        (
            ["--config_file", "{home}/my_config.yaml"],
            "`accelerate launch` with a config file with num_processes: 2 starts one process on a machine without a "
            "GPU",
        ),
        (
            ["default config"],
            "`accelerate launch` with a config file with num_processes: 2 starts one process on a machine without a "
            "GPU",
        ),
    ],
)
def test_a_cpu_launch_that_leaves_cores_idle_says_what_to_run(launch_args, needle, tmp_path, mnist_like):
    """Without a GPU, `accelerate launch --num_processes 2` (or a config of `accelerate config` asking for 2 processes,
    given with --config_file or found where `accelerate config` writes it) starts one process, and plain
    `accelerate launch` sets OMP_NUM_THREADS=1: either trained on one core of two, unsaid. The startup line now says
    what to run instead. (Through the real launcher.)"""
    from common.train.accelerator import CPU_2PROC_CONFIG as CPU_2PROC

    from helpers import recipe_env

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing is left idle")
    env = {k: v for k, v in recipe_env(tmp_path).items() if k != "OMP_NUM_THREADS"}
    home = tmp_path / "home"
    env["HOME"] = str(home)  # no `accelerate config` default config, unless this case writes one
    env.pop("HF_HOME", None)
    if launch_args == ["default config"]:
        launch_args = []
        (home / ".cache" / "huggingface" / "accelerate").mkdir(parents=True)
        (home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml").write_text(CONFIG_OF_ACCELERATE_CONFIG)
    elif launch_args[:1] == ["--config_file"]:
        home.mkdir()
        (home / "my_config.yaml").write_text(CONFIG_OF_ACCELERATE_CONFIG)
        launch_args = ["--config_file", str(home / "my_config.yaml")]
    proc = subprocess.run(
        [
            ACCELERATE,
            "launch",
            *launch_args,
            "--main_process_port",
            str(free_port()),
            str(REPO / "recipes" / "fashion_mnist_mlp.py"),
            "--dataset",
            str(mnist_like),
            "--hidden",
            "8",
            "--max-steps",
            "1",
            "--batch-size",
            "32",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    startup = next(line for line in proc.stdout.splitlines() if line.startswith("startup:"))
    assert "processes=1" in startup and needle in startup and CPU_2PROC in startup, startup


@pytest.mark.integration
def test_ctrl_c_of_a_test_run_leaves_no_recipe_process(tmp_path, mnist_like):
    """Ctrl-C in a terminal sends SIGINT to the foreground process group: pytest, the launcher it waits on (the ranks
    run in sessions of their own). A pytest run whose test launches two processes ends, and within 60 s no process
    of that run is left: the ranks see their launcher gone, checkpoint and exit."""
    import textwrap

    run = tmp_path / "run"
    test = tmp_path / "test_long_launch.py"
    test.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path[:0] = [{str(REPO / "tests")!r}, {str(REPO / "benchmarks")!r}]
            from helpers import launch, recipe_env

            def test_long(tmp_path):
                args = ["--dataset", {str(mnist_like)!r}, "--epochs", 400, "--batch-size", 32, "--hidden", 8]
                launch("fashion_mnist_mlp", [*args, "--output-dir", {str(run)!r}], recipe_env(tmp_path), nproc=2,
                       timeout=600)
            """
        )
    )

    def as_in_a_terminal():  # a shell without job control would start it with SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path,
        start_new_session=True,
        preexec_fn=as_in_a_terminal,
        stdout=(tmp_path / "pytest.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    logged = run / "metrics.jsonl"
    deadline = time.time() + 180
    while not (logged.exists() and read_jsonl(logged)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert logged.exists() and read_jsonl(logged), (tmp_path / "pytest.log").read_text()[-3000:]
    assert len(pids_running(str(run))) >= 3  # the launcher and its two ranks
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    deadline = time.time() + 60
    while pids_running(str(run)) and time.time() < deadline:
        time.sleep(0.5)
    assert pids_running(str(run)) == []
