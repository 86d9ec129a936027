"""slurm/train.sbatch: the warning signal reaches every rank (through the launcher, as a TERM), every rank
checkpoints, the job is requeued from the status in summary.json, and the next start resumes.

- ``test_batch_script_checkpoints_requeues_and_resumes`` always runs: the real batch script under bash,
  a real 2-process ``accelerate launch``, with stand-ins for ``srun`` (runs its task in a process group
  of its own and forwards USR1 to that whole group, as slurmstepd does) and ``scontrol``;
  ``test_requeue_decision_reads_summary_status`` checks the requeue decision for each recorded ending.
- ``test_real_slurm_requeue_and_resume`` runs the script under a real one-node SLURM (slurmctld, slurmd,
  munged started here and stopped after); it is skipped where those programs are not installed
  (Debian: ``apt-get install slurmctld slurmd slurm-client munge``) or when not run as root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import REPO, free_port, recipe_env, write_parquet_dataset

SCRIPT = REPO / "slurm" / "train.sbatch"
RECIPE = REPO / "recipes" / "fashion_mnist_mlp.py"
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
VENV_BIN = str(Path(sys.executable).parent)
# Long enough that the signal lands mid-run (it is sent after 2 logged steps), short enough to finish.
TRAIN = ["--epochs", "8", "--batch-size", "32", "--hidden", "32", "--log-every", "1", "--val-fraction", "0"]

FAKE_SRUN = f"""#!{sys.executable}
# srun stand-in: the task (srun's options dropped) in a process group of its own; USR1 goes to that whole
# group, as slurmstepd delivers a signal srun forwards; TERM kills the step, as srun does.
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
task = subprocess.Popen(args, start_new_session=True)
signal.signal(signal.SIGUSR1, lambda *_: os.killpg(task.pid, signal.SIGUSR1))
signal.signal(signal.SIGTERM, lambda *_: os.killpg(task.pid, signal.SIGKILL))
code = task.wait()
sys.exit(128 - code if code < 0 else code)
"""

FAKE_SCONTROL = """#!/bin/bash
# scontrol stand-in: hostnames of a node list, and requeue requests written to $FAKE_SCONTROL_LOG.
case "$1 ${2:-}" in
    "show hostnames") echo "$3" | tr ',' '\\n' ;;
    requeue*) echo "requeue $2" >> "$FAKE_SCONTROL_LOG" ;;
    *) echo "scontrol stand-in: unsupported: $*" >&2; exit 1 ;;
esac
"""


def wait_for(cond, timeout: float, what: str, poll: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum('"train/loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def status(run: Path) -> str | None:
    path = run / "summary.json"
    try:
        return json.loads(path.read_text())["status"] if path.exists() else None
    except ValueError:  # being written
        return None


def newest_checkpoint_step(run: Path) -> int:
    from common.train.checkpoint import find_latest

    latest = find_latest(run)
    assert latest is not None, f"no complete checkpoint in {run}"
    return json.loads((latest / "trainer_state.json").read_text())["global_step"]


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def test_batch_script_checkpoints_requeues_and_resumes(tmp_path):
    data = write_parquet_dataset(tmp_path / "data", {"train": 320, "test": 40})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    requeues = tmp_path / "requeues.log"
    env = recipe_env(tmp_path)
    env.update(
        PATH=f"{bin_dir}:{VENV_BIN}:{env['PATH']}",
        FAKE_SCONTROL_LOG=str(requeues),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="test",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODEID="0",
        ACCELERATE_CONFIG=str(CPU_2PROC),
        PROCS_PER_NODE="2",
        MAIN_PORT=str(free_port()),
    )
    env.pop("RUN_DIR", None)
    run = tmp_path / "runs" / "slurm-test-4242"  # the default run dir: the same for every start of job 4242
    cmd = ["bash", str(SCRIPT), str(RECIPE), "--dataset", str(data), *TRAIN]

    with open(tmp_path / "first.out", "w+") as out:
        first = subprocess.Popen(
            cmd, env=env, cwd=str(tmp_path), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_for(lambda: logged_steps(run) >= 2 or first.poll() is not None, 120, "training to log 2 steps")
            assert first.poll() is None, "the run ended before the warning could be sent"
            first.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1: the batch shell only
            first.wait(timeout=60)
        finally:
            kill_group(first)
        out.seek(0)
        log = out.read()
    assert first.returncode == 0, log
    assert "stopped by signal SIGTERM at step" in log, log  # the workers got a TERM through the launcher
    assert "--resume-from latest to continue" in log, log  # the stopped run says how to continue
    assert "step exit 0, run status: preempted" in log, log  # a stopped task exits 0: no --kill-on-bad-exit
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted", log
    step = newest_checkpoint_step(run)
    assert step == summary["global_step"] and 0 < step < 80, log
    from common.train.checkpoint import find_latest

    # every rank took part in the stop checkpoint: one RNG state per process
    assert {p.name for p in find_latest(run).glob("random_states_*.pkl")} == {
        "random_states_0.pkl",
        "random_states_1.pkl",
    }, log
    assert requeues.read_text() == "requeue 4242\n", log

    # The requeued start, here on one process to keep the test short (the global batch stays 32; the real
    # SLURM test below repeats the 2-process launch).
    env.update(
        SLURM_RESTART_COUNT="1",
        ACCELERATE_CONFIG=str(REPO / "accelerate_configs" / "cpu.yaml"),
        PROCS_PER_NODE="1",
        MAIN_PORT=str(free_port()),
    )
    again = subprocess.run(
        cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180
    )
    assert again.returncode == 0, again.stdout
    assert "resumed from" in again.stdout and f"step {step}" in again.stdout, again.stdout
    assert status(run) == "completed" and json.loads((run / "summary.json").read_text())["global_step"] == 80
    assert requeues.read_text() == "requeue 4242\n", "a completed run was requeued"


FAKE_ACCELERATE = """#!/bin/bash
# accelerate stand-in: records how the run ended ($FAKE_STATUS) in <--output-dir>/summary.json
while [ $# -gt 0 ] && [ "$1" != --output-dir ]; do shift; done
mkdir -p "$2"
STATUS="{\\"status\\": \\"$FAKE_STATUS\\", \\"start_id\\": \\"$RECIPES_START_ID\\"}"
[ "$FAKE_STATUS" = missing ] || echo "$STATUS" > "$2/summary.json"
[ "$FAKE_STATUS" = completed ]
"""


@pytest.mark.parametrize(
    "ending,code,requeued",
    [
        ("preempted", 0, True),
        ("completed", 0, False),
        ("target_missed", 4, False),
        ("nonfinite_loss", 1, False),
        ("crashed", 1, False),
        ("running", 1, False),
        ("missing", 1, False),
        ("stale", 1, False),
    ],
)
def test_requeue_decision_reads_summary_status(ending, code, requeued, tmp_path):
    """Only a run that recorded "preempted" in this start is requeued; "stale" is a summary.json left
    by an earlier start (here: preempted, written a moment ago, so no clock comparison could tell), which must
    not requeue forever; "running" is this start killed outright (OOM killer, node loss)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accelerate", FAKE_ACCELERATE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run"
    if ending == "stale":
        run.mkdir()
        (run / "summary.json").write_text('{"status": "preempted", "start_id": "job-7-start-0"}')
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SCONTROL_LOG=str(tmp_path / "requeues.log"),
        FAKE_STATUS="missing" if ending == "stale" else ending,
        RUN_DIR=str(run),
        SLURM_JOB_ID="7",
        SLURM_RESTART_COUNT="1",
        SLURM_JOB_NAME="t",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODEID="0",
        PROCS_PER_NODE="1",
    )
    proc = subprocess.run(["bash", str(SCRIPT), str(RECIPE)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"run status: {ending}" in proc.stdout, proc.stdout
    assert (tmp_path / "requeues.log").exists() == requeued, proc.stdout + proc.stderr


# --- a real one-node SLURM ------------------------------------------------------------------------

SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel", "munged")


def slurm_conf(root: Path, host: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""ClusterName=test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again once its credential expired: cred_expire s (default 120)
AuthInfo=socket={root}/munge/socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
# the main scheduling pass (default every 60 s) starts a requeued job once its begin time has passed
SchedulerParameters=sched_interval=2
MinJobAge=600
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def job_field(job_id: str, field: str, env) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(field + "=")), "")


@pytest.mark.skipif(
    any(shutil.which(p) is None for p in SLURM_PROGRAMS),
    reason="SLURM and munge are not installed (Debian: apt-get install slurmctld slurmd "
    "slurm-client munge); the batch script's logic is covered by the stand-in test",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs jobs as their user only when started as root")
def test_real_slurm_requeue_and_resume(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: munge's socket path must fit in 108 bytes
    host = socket.gethostname().split(".")[0]
    daemons: list[subprocess.Popen] = []
    logs, job, env = None, None, None
    try:
        for d in ("munge", "state", "spool"):
            (root / d).mkdir(mode=0o700)
        (root / "munge" / "munge.key").write_bytes(os.urandom(1024))
        (root / "munge" / "munge.key").chmod(0o400)
        (root / "slurm.conf").write_text(slurm_conf(root, host, free_port(), free_port()))
        env = recipe_env(tmp_path)
        env.update(
            PATH=f"{VENV_BIN}:{env['PATH']}",
            SLURM_CONF=str(root / "slurm.conf"),
            ACCELERATE_CONFIG=str(CPU_2PROC),
            PROCS_PER_NODE="2",
            MAIN_PORT=str(free_port()),
        )
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
            env.pop(key)
        env.pop("RUN_DIR", None)
        logs = open(root / "daemons.log", "w")
        daemons.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={root}/munge/munge.key",
                    f"--socket={root}/munge/socket",
                    f"--pid-file={root}/munge/munged.pid",
                    f"--log-file={root}/munge/munged.log",
                    f"--seed-file={root}/munge/seed",
                ],
                stdout=logs,
                stderr=subprocess.STDOUT,
            )
        )
        wait_for(lambda: (root / "munge" / "socket").exists(), 20, "munged")
        conf = str(root / "slurm.conf")
        daemons.append(
            subprocess.Popen(["slurmctld", "-D", "-i", "-f", conf], env=env, stdout=logs, stderr=subprocess.STDOUT)
        )
        daemons.append(
            subprocess.Popen(["slurmd", "-D", "-f", conf, "-N", host], env=env, stdout=logs, stderr=subprocess.STDOUT)
        )

        def node_idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            return out.strip() == "idle"

        wait_for(node_idle, 30, "the SLURM node to come up", poll=0.5)

        data = write_parquet_dataset(tmp_path / "data", {"train": 320, "test": 40})
        out_file = tmp_path / "slurm-%j.out"
        submit = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--job-name=req",
                "--nodes=1",
                "--gpus-per-node=0",
                "--cpus-per-task=2",
                "--time=10",
                f"--output={out_file}",
                str(SCRIPT),
                str(RECIPE),
                "--dataset",
                str(data),
                *TRAIN,
            ],
            env=env,
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
        )
        assert submit.returncode == 0, submit.stderr
        job = submit.stdout.strip().split(";")[0]
        run = tmp_path / "runs" / f"slurm-req-{job}"
        log = tmp_path / f"slurm-{job}.out"

        def show():
            return (
                f"job: {job_field(job, 'JobState', env)} restarts {job_field(job, 'Restarts', env)}\n"
                f"--- job log\n{log.read_text() if log.exists() else ''}\n--- slurmctld.log (tail)\n"
                + "\n".join((root / "slurmctld.log").read_text().splitlines()[-15:])
            )

        try:
            wait_for(lambda: logged_steps(run) >= 2, 90, "the job to train 2 steps")
        except AssertionError:
            raise AssertionError(show()) from None
        # the time-limit warning, delivered now: SLURM's own once-a-minute check would make the test slow
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
        try:
            wait_for(lambda: job_field(job, "Restarts", env) == "1", 60, "the job to be requeued", poll=0.5)
            wait_for(
                lambda: job_field(job, "JobState", env) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                120,
                "the requeued job to finish",
                poll=0.5,
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\n{show()}") from None
        text = log.read_text()
        assert job_field(job, "JobState", env) == "COMPLETED", show()
        # srun delivers the USR1 to every process of the step: the workers stop on it (or on the TERM the
        # launcher forwards, whichever comes first); the launcher, which ignores USR1, got the TERM
        assert "stopped by signal SIG" in text and "Received 15 death signal" in text, show()
        assert "step exit 0, run status: preempted" in text and "requeueing job" in text, show()
        assert f"job {job} start 2 on" in text and "resumed from" in text and "run status: completed" in text, show()
        assert text.count("requeueing job") == 1, show()
        assert status(run) == "completed", show()
        assert json.loads((run / "summary.json").read_text())["global_step"] == 80
    finally:
        if job is not None:  # a job outlives slurmd: end it first
            subprocess.run(["scancel", job], env=env)
            try:
                wait_for(
                    lambda: job_field(job, "JobState", env) not in ("RUNNING", "COMPLETING", "PENDING"),
                    30,
                    "the job to end",
                    poll=0.5,
                )
            except AssertionError:
                pass
        for proc in reversed(daemons):  # slurmd, slurmctld, munged: by PID, each started here
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        if logs is not None:
            logs.close()
        shutil.rmtree(root, ignore_errors=True)
