"""--report-to: the same scalars and hyperparameters reach every tracker asked for, read back with each
tracker's own reader (TensorBoard's EventAccumulator, MLflow's client on a local file store: no account, no
network); 'none' writes metrics.jsonl and the PNGs only; a tracker that is unknown or not installed is a
one-paragraph error before anything runs, with nothing written."""

from __future__ import annotations

import json

import pytest

from helpers import check_ok, read_jsonl, read_scalars, run_in_process

MLP = ["--hidden", "32"]


def test_tensorboard_and_mlflow_get_the_same_scalars_and_hparams(tmp_path, env, mnist_like):
    pytest.importorskip("mlflow", reason="MLflow is in the [test] extra (pip install -e .[test])")
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    env.update(MLFLOW_TRACKING_URI=store, MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_EXPERIMENT_NAME="digits")
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                "--epochs",
                2,
                "--batch-size",
                32,
                *MLP,
                "--log-every",
                2,
                "--output-dir",
                run,
                "--report-to",
                "tensorboard,mlflow",
            ],
            env,
        )
    )
    rows = read_jsonl(run / "metrics.jsonl")
    client = MlflowClient(store)
    [experiment] = [e for e in client.search_experiments() if e.name == "digits"]
    [mlflow_run] = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_name == run.name and mlflow_run.info.status == "FINISHED"
    tensorboard = read_scalars(run)
    for key in ("train/loss", "train/lr", "eval/accuracy", "eval/loss", "test/accuracy"):
        expected = [(r["step"], r[key]) for r in rows if key in r]
        assert expected, key
        logged = [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key)]
        assert logged == expected, key  # MLflow keeps the float the run logged
        assert [s for s, _ in tensorboard[key]] == [s for s, _ in expected], key
        assert [v for _, v in tensorboard[key]] == pytest.approx([v for _, v in expected], rel=1e-6), key  # float32
    params = mlflow_run.data.params
    config = json.loads((run / "config.json").read_text())
    assert params["lr"] == str(config["lr"]) and params["report_to"] == "tensorboard,mlflow"
    assert params["dataset"] == str(mnist_like) and int(params["epochs"]) == 2


def test_report_to_none_writes_the_run_files_only(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                "--epochs",
                1,
                "--batch-size",
                32,
                *MLP,
                "--output-dir",
                run,
                "--report-to",
                "none",
            ],
            env,
        )
    )
    assert not (run / "tensorboard").exists() and not list(run.rglob("events.out.tfevents.*"))
    assert any("test/accuracy" in r for r in read_jsonl(run / "metrics.jsonl"))
    assert (run / "curves.png").is_file() and (run / "confusion_matrix.png").is_file()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_an_unknown_or_missing_tracker_is_refused_before_anything_runs(tmp_path, env, mnist_like):
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    installed = {str(t) for t in get_available_trackers()}
    missing = next(name for name in LOGGER_TYPE_TO_CLASS if name not in installed)
    for value, needles in (
        (f"tensorboard,{missing}", [f"pip install {missing}", "not installed", "tensorboard"]),
        ("tensorbord", ["not one of Accelerate's trackers", "wandb", "mlflow"]),
        ("all,none", ["stand alone"]),
    ):
        run = tmp_path / value.replace(",", "-")
        proc = run_in_process(
            "fashion_mnist_mlp", ["--dataset", mnist_like, "--output-dir", run, "--report-to", value], env
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        message = proc.stderr.strip().splitlines()[-1]
        assert all(n in message for n in needles), message
        assert not run.exists()


def test_the_eta_counts_the_evaluations_the_loop_made():
    """The progress line's ETA keeps no copy of the recipes' evaluation rule: training left at the training-only rate,
    plus as many evaluations per step as the loop has made so far and the final one, each as long as they took."""
    from types import SimpleNamespace

    from common.train.tracking import Progress, format_duration

    accelerator = SimpleNamespace(is_local_main_process=False, is_main_process=True)
    progress = Progress(accelerator, SimpleNamespace(progress_every_s=60, epochs=1), total_steps=100)
    progress.begin(0)
    t0 = progress.t_start
    assert progress.eta(10, 0, t0 + 10) == "1m30s + evaluations"  # 1 step/s, no evaluation yet
    progress.note_eval(2.0)
    progress.note_eval(2.0)
    # 10 steps in 10 s of training (14 s with the two evaluations): 90 s left, then 2 per 10 steps for the 90 steps
    # left (18) and the final one, 2 s each
    assert progress.eta(10, 0, t0 + 14) == format_duration(90 + 19 * 2.0)


def test_a_resumed_run_reports_to_the_same_wandb_run(tmp_path):
    """W&B gets a run id kept in the run directory: a fresh start makes one, every resume passes the same id with
    resume="allow", so the curves of a run stopped and resumed stay one W&B run (before, each restart opened a new
    run). A file that holds no id is not used. (wandb itself is not installed here: what Accelerate is asked for is
    what is checked.)"""
    from common.train.tracking import WANDB_ID_FILE, MetricsLog

    class Accelerator:
        is_main_process = True

        def __init__(self, trackers):
            self.log_with, self.trackers, self.asked = [type("T", (), {"name": n})() for n in trackers], [], []

        def init_trackers(self, project, init_kwargs):
            self.asked.append(init_kwargs["wandb"])

    run = tmp_path / "run"
    run.mkdir()
    first = Accelerator(["wandb"])
    MetricsLog(first, run, None)
    (kwargs,) = first.asked
    assert kwargs["resume"] == "allow" and kwargs["name"] == "run" and len(kwargs["id"]) == 8
    assert (run / WANDB_ID_FILE).read_text().strip() == kwargs["id"]
    again = Accelerator(["wandb"])
    MetricsLog(again, run, 40)  # resumed at step 40
    assert again.asked[0]["id"] == kwargs["id"]
    fresh = Accelerator(["wandb"])
    MetricsLog(fresh, run, None)  # a fresh start in the folder: a new W&B run
    assert fresh.asked[0]["id"] != kwargs["id"]
    (run / WANDB_ID_FILE).write_text("../../etc\n")
    damaged = Accelerator(["wandb"])
    MetricsLog(damaged, run, 40)
    assert damaged.asked[0]["id"] not in ("../../etc", kwargs["id"]) and len(damaged.asked[0]["id"]) == 8
    other = tmp_path / "other"
    other.mkdir()
    MetricsLog(Accelerator(["tensorboard"]), other, None)
    assert not (other / WANDB_ID_FILE).exists()  # only a run that reports to W&B keeps an id
