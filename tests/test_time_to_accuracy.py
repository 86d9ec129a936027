"""benchmarks/time_to_accuracy.py, mechanics only, on tiny generated data: the first-crossing logic, the
reading of a recipe run, the baseline trained in-process, and the whole CLI end to end. No timing is
ever asserted: the times are whatever this machine gives."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from helpers import REPO, recipe_env, write_parquet_dataset

sys.path.insert(0, str(REPO / "benchmarks"))
import time_to_accuracy as tta  # noqa: E402


def points(*accs):
    return [{"time_s": float(i + 1), "step": 10 * (i + 1), "accuracy": a} for i, a in enumerate(accs)]


@pytest.mark.parametrize(
    "accs, target, expected",
    [
        ((), 0.9, None),  # no evaluation at all
        ((0.5, 0.8, 0.89), 0.9, None),  # never reached
        ((0.5, 0.9, 0.95), 0.9, 1),  # exact equality counts
        ((0.5, 0.92, 0.85, 0.95), 0.9, 1),  # non-monotonic: the first crossing, not the last
        ((0.95, 0.5), 0.9, 0),  # reached at the first evaluation
        ((float("nan"), None, 0.91), 0.9, 2),  # missing and NaN accuracies never count
    ],
)
def test_first_crossing(accs, target, expected):
    rep = tta.crossing_report(points(*accs), target)
    assert rep["reached"] == (expected is not None)
    assert rep["step"] == (None if expected is None else 10 * (expected + 1))


def test_crossing_report_never_reached_keeps_best():
    rep = tta.crossing_report(points(0.5, 0.8, 0.7), 0.9)
    assert rep["reached"] is False and rep["time_to_target_s"] is None and rep["step"] is None
    assert rep["best_accuracy"] == 0.8 and rep["evals"] == 3


def metrics_rows(start: float):
    """Training takes 0.1 s per step, each evaluation 3 s, and the recipe spends 2 s after logging the
    first evaluation (images, best/ weights); evaluations at steps 30 and 60."""
    return [
        {"step": 10, "time": start + 1, "train/loss": 1.0},
        {"step": 20, "time": start + 2, "train/loss": 0.9},
        {"step": 30, "time": start + 6, "train/loss": 0.8, "eval/accuracy": 0.85, "eval/loss": 0.5},
        {"step": 40, "time": start + 9, "train/loss": 0.7},
        {"step": 50, "time": start + 10, "train/loss": 0.6},
        {"step": 60, "time": start + 14, "train/loss": 0.5, "eval/accuracy": 0.95, "eval/loss": 0.2},
    ]


def test_recipe_points_time_from_train_start():
    pts = tta.recipe_eval_points(metrics_rows(100.0), train_start=100.5)
    assert [p["step"] for p in pts] == [30, 60]
    assert [p["time_s"] for p in pts] == pytest.approx([5.5, 13.5])
    assert [p["eval_s"] for p in pts] == pytest.approx([3.0, 3.0])
    assert [p["post_eval_s"] for p in pts] == pytest.approx([2.0, 0.0])
    rep = tta.crossing_report(pts, 0.9)
    assert rep["reached"] and rep["step"] == 60 and rep["time_to_target_s"] == pytest.approx(13.5)
    assert rep["evals"] == 2 and rep["eval_s_included"] == pytest.approx(3.0 + 2.0 + 3.0)
    first = tta.crossing_report(pts, 0.8)  # the crossing's own after-work comes after its time stamp
    assert first["step"] == 30 and first["eval_s_included"] == pytest.approx(3.0)


def test_recipe_points_take_the_recorded_evaluation_time_and_seconds():
    rows = metrics_rows(100.0)
    # the recipes record when each evaluation finished and how long it took; the row's own time is later (its
    # line also holds what was logged after the evaluation, e.g. the final evaluation merged into it)
    rows[-1] = {**rows[-1], "time": 120.0, "eval_time": 113.0, "eval_seconds": 2.5, "val/accuracy": 0.95}
    pts = tta.recipe_eval_points(rows, train_start=101.0)
    assert [p["time_s"] for p in pts] == pytest.approx([5.0, 12.0]) and pts[1]["eval_s"] == 2.5


def write_run(run, summary, rows, tail=""):
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    (run / "config.json").write_text(json.dumps({"batch_size": 128, "val_fraction": 0.1, "seed": 1}))


def test_read_recipe_run(tmp_path):
    ok = {"status": "completed", "timing": {"train_start": 100.0}}
    write_run(tmp_path / "ok", ok, metrics_rows(100.0), tail='{"step": 70, "ti')  # cut short by a kill
    run = tta.read_recipe_run(tmp_path / "ok")
    assert len(run["rows"]) == 6 and run["train_start"] == 100.0 and run["config"]["batch_size"] == 128

    write_run(tmp_path / "missed", {**ok, "status": "target_missed"}, metrics_rows(100.0))  # trained to the end
    assert tta.read_recipe_run(tmp_path / "missed")["train_start"] == 100.0
    write_run(tmp_path / "preempted", {**ok, "status": "preempted"}, metrics_rows(100.0))
    with pytest.raises(RuntimeError, match="preempted"):
        tta.read_recipe_run(tmp_path / "preempted")
    write_run(tmp_path / "no_timing", {"status": "completed"}, metrics_rows(100.0))
    with pytest.raises(RuntimeError, match="train_start"):
        tta.read_recipe_run(tmp_path / "no_timing")


def test_ratio_and_spread():
    reached = {"reached": True, "time_to_target_s": 10.0}
    assert tta.ratio_of(reached, {"reached": True, "time_to_target_s": 80.0}) == (8.0, False)
    assert tta.ratio_of(reached, {"reached": False, "train_wall_s": 50.0}) == (5.0, True)  # a lower bound
    assert tta.ratio_of({"reached": False}, {"reached": True, "time_to_target_s": 1.0}) == (None, False)
    assert tta.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "mean": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert tta.spread([]) is None


def test_bad_input_exits_2(capsys):
    for argv in (
        ["--target", "99.3"],
        ["--target", "0.99", "--seeds", "a,b"],
        ["--target", "0.99", "--recipe-args", "--seed 3"],
    ):
        with pytest.raises(SystemExit) as exc:
            tta.parse_args(["--recipe", "mnist_convnet", "--dataset", "x", *argv])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "percentage" in err and "Pass --target 0.993" in err and "sets itself" in err


def test_the_baseline_reads_the_data_as_the_recipes_own_parser_does(tmp_path):
    args = tta.parse_args(
        [
            "--recipe",
            "mnist_convnet",
            "--dataset",
            "d",
            "--target",
            "0.9",
            "--recipe-args",
            "--val-fraction=0.2 --channels 3 --width 8",
        ]
    )
    cfg = tta.data_config(args, 7, tmp_path)
    assert (cfg.val_fraction, cfg.channels, cfg.image_size, cfg.seed, cfg.dataset) == (0.2, 3, 0, 7, "d")
    assert cfg.cache_dir == str(tmp_path)
    with pytest.raises(SystemExit) as exc:  # a flag the recipe does not know: its own message, exit 2
        tta.parse_args(["--recipe", "mnist_convnet", "--dataset", "d", "--target", "0.9", "--recipe-args", "--nope 1"])
    assert exc.value.code == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Hub-layout parquet, 4 learnable classes, train only (the validation split is held out). 16x16, not
    28x28: the baseline's fc layer (64 x 6 x 6 inputs instead of 9216) keeps its steps cheap."""
    return write_parquet_dataset(tmp_path_factory.mktemp("tta_data"), {"train": 200}, shape=(1, 16, 16))


def test_baseline_trains_and_evaluates_in_process(tiny, tmp_path):
    import torch

    torch.set_num_threads(1)
    args = tta.parse_args(
        ["--recipe", "mnist_convnet", "--dataset", str(tiny), "--target", "0.5", "--recipe-args", "--val-fraction 0.2"]
    )
    train, val = tta.load_split(args, 1, tmp_path / "cache")
    assert (len(train), len(val)) == (160, 40)  # the recipes' hold-out: round(0.2 x 200)

    # 160 images at batch 64: 3 steps per epoch. Every 2 steps mid-epoch, and at each epoch end.
    never = tta.run_baseline(train, val, 1.5, seed=1, max_epochs=2, eval_every_steps=2)
    assert [p["step"] for p in never["curve"]] == [2, 3, 4, 6]
    assert [p["epoch"] for p in never["curve"]] == pytest.approx([2 / 3, 1, 1 + 1 / 3, 2], abs=1e-3)
    assert not never["reached"] and never["time_to_target_s"] is None and never["steps"] == 6
    assert all(0 <= p["accuracy"] <= 1 and math.isfinite(p["loss"]) for p in never["curve"])
    times = [p["time_s"] for p in never["curve"]]
    assert times == sorted(times)

    # A target the first evaluation meets: it stops there.
    low = tta.run_baseline(train, val, 0.01, seed=1, max_epochs=2, eval_every_steps=2)
    assert low["reached"] and low["step"] == 2 and len(low["curve"]) == 1 and low["evals"] == 1
    assert low["time_to_target_s"] == low["curve"][0]["time_s"]


def run_main(argv, tmp_path, monkeypatch, capsys) -> str:
    """main() of the CLI in this process, with the environment the recipe subprocess inherits and torch's
    thread count restored after; asserts exit 0 and returns stdout."""
    import torch

    for key, value in recipe_env(tmp_path).items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main() sets it; restored after the test
    threads = torch.get_num_threads()
    try:
        code = tta.main(argv)
    finally:
        torch.set_num_threads(threads)
    stdout, stderr = capsys.readouterr()
    assert code == 0, f"exit {code}\nSTDOUT:\n{stdout[-4000:]}\nSTDERR:\n{stderr[-6000:]}"
    return stdout


def test_cli_end_to_end(tiny, tmp_path, monkeypatch, capsys):
    """Both sides on tiny data, one seed, a low target: main() of the CLI in this process, which runs the
    real recipe as a subprocess and the baseline in-process; the table printed and the JSON written."""

    out = tmp_path / "tta.json"
    argv = [
        "--recipe",
        "mnist_convnet",
        "--dataset",
        str(tiny),
        "--target",
        "0.05",
        "--seeds",
        "1",
        "--threads",
        "1",
        "--recipe-args",
        "--epochs 1 --batch-size 32 --width 8 --log-every 1 --val-fraction 0.2",
        "--eval-every-steps",
        "2",
        "--max-baseline-epochs",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    stdout = run_main(argv, tmp_path, monkeypatch, capsys)
    assert "ratio" in stdout and "median" in stdout

    report = json.loads(out.read_text())
    (seed,) = report["seeds"]
    assert seed["seed"] == 1 and seed["recipe"]["reached"] and seed["baseline"]["reached"]
    assert seed["recipe"]["curve"] and seed["recipe"]["step"] == seed["recipe"]["curve"][0]["step"]
    assert seed["recipe"]["global_batch"] == 32
    assert seed["baseline"]["eval_every_steps"] == 1  # 2 recipe steps x 32 images = 1 baseline step of 64
    assert seed["ratio"] is not None and not seed["ratio_is_lower_bound"]
    assert report["decode_s"] >= 0 and report["summary"]["recipe_time_s"]["n"] == 1
    assert report["settings"]["recipe"] == "mnist_convnet" and report["machine"]["cpu_count"] >= 1
    assert (tmp_path / "work" / "run-seed1" / "metrics.jsonl").is_file()
    # the baseline reached the target at its first mid-epoch evaluation: no whole first epoch, so no E
    assert seed["e_s"] is None and seed["wall_in_e"] is None


def test_goal_e_times_the_whole_command_in_the_baseline_first_epochs(tiny, tmp_path, monkeypatch, capsys):
    """--goal-e: per seed the recipe's launch-to-exit wall and final accuracy against E, the MNIST script's first
    epoch with its evaluation measured in the same run; every seed must meet both or the goal is missed."""
    out = tmp_path / "e.json"
    argv = [
        "--recipe",
        "mnist_convnet",
        "--dataset",
        str(tiny),
        "--target",
        "0.3",
        "--baseline-target",
        "0.999",
        "--seeds",
        "1",
        "--threads",
        "1",
        "--max-baseline-epochs",
        "1",
        "--goal-e",
        "1000",
        "--recipe-args",
        "--epochs 2 --batch-size 32 --width 8 --val-fraction 0.2",
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    stdout = run_main(argv, tmp_path, monkeypatch, capsys)
    report = json.loads(out.read_text())
    (seed,) = report["seeds"]
    (epoch_end,) = seed["baseline"]["curve"]  # its one whole epoch (the target out of its reach)
    assert epoch_end["epoch"] == 1 and seed["e_s"] == epoch_end["time_s"] > 0
    assert seed["wall_in_e"] == pytest.approx(seed["recipe"]["process_wall_s"] / seed["e_s"])
    assert seed["recipe"]["process_wall_s"] > seed["recipe"]["time_to_target_s"]  # launch to exit, setup included
    acc = seed["recipe"]["final_accuracy"]
    assert f"final {acc:.2%} in" in stdout and f"= {seed['wall_in_e']:.2f} E (E = {seed['e_s']:.1f} s)" in stdout
    assert ("PASS (1 of 1 seeds)" if acc >= 0.3 else "MISS (0 of 1 seeds)") in stdout
    report["settings"]["goal_e"] = seed["wall_in_e"] / 2  # the same seed against half its time: missed
    report["settings"]["target"] = 0.0
    tta.print_report(report)
    assert "MISS (0 of 1 seeds)" in capsys.readouterr().out
    report["settings"]["goal_e"] = seed["wall_in_e"] * 2
    tta.print_report(report)
    assert "goal every seed >= 0.00% within" in (text := capsys.readouterr().out) and "PASS (1 of 1 seeds)" in text


def test_target_baseline_needs_the_baseline():
    with pytest.raises(SystemExit) as exit_:
        tta.parse_args(["--recipe", "cifar_cnn", "--dataset", "x", "--target", "baseline", "--baseline", "off"])
    assert exit_.value.code == 2
    args = tta.parse_args(["--recipe", "cifar_cnn", "--dataset", "x", "--target", "baseline"])
    assert args.target_from_baseline and args.baseline_kind == "airbench94"  # cifar_cnn's default baseline


def test_airbench_baseline_on_the_recipes_split_and_the_recipe_timed_to_its_accuracy(
    cifar_like, tmp_path, monkeypatch, capsys
):
    """airbench94, cifar_cnn's default baseline: the record's method (benchmarks/airbench94.py) trains on the split
    the recipe trains on and is evaluated once, at its end; the recipe is timed to the accuracy it reached. A small
    network and batch stand in for the paper's (the same code path)."""
    import airbench94

    for key, value in (("batch_size", 32), ("widths", (8, 16, 16)), ("epochs", 2)):
        monkeypatch.setitem(airbench94.HYP, key, value)
    out = tmp_path / "tta.json"
    argv = [
        "--recipe",
        "cifar_cnn",
        "--dataset",
        str(cifar_like),
        "--target",
        "baseline",
        "--seeds",
        "1",
        "--threads",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--recipe-args",
        "--epochs 2 --batch-size 32 --widths 8,16,16 --log-every 1",
        "--eval-every-steps",
        "2",
    ]
    run_main(argv, tmp_path, monkeypatch, capsys)
    report = json.loads(out.read_text())
    assert report["settings"]["baseline_recipe"]["kind"] == "airbench94"
    (seed,) = report["seeds"]
    (point,) = seed["baseline"]["curve"]  # one evaluation, at the end, as the paper times it
    assert seed["baseline"]["reached"] and seed["baseline"]["target"] == point["accuracy"] == seed["recipe"]["target"]
    train, _ = airbench94.load(str(cifar_like), 1, 0.1)  # the recipe's split
    assert point["step"] == 2 * (len(train) // 32) and 0 <= point["accuracy_without_tta"] <= 1
    assert point["time_s"] >= point["eval_s"] > 0


def test_airbench_baseline_cli(cifar_like, tmp_path, monkeypatch, capsys):
    import airbench94

    for key, value in recipe_env(tmp_path).items():  # a private decoded cache
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(airbench94.HYP, "widths", (8, 16, 16))
    train, _ = airbench94.load(str(cifar_like), 1, 0.1)
    with pytest.raises(SystemExit) as exit_:  # a few hundred training images make no batch of the paper's 1024
        airbench94.main(["--dataset", str(cifar_like), "--device", "cpu", "--out", str(tmp_path / "a.json")])
    assert exit_.value.code == 2 and "no batch of 1024" in capsys.readouterr().err
    monkeypatch.setitem(airbench94.HYP, "batch_size", 64)
    assert (
        airbench94.main(
            [
                "--dataset",
                str(cifar_like),
                "--device",
                "cpu",
                "--epochs",
                "1",
                "--seeds",
                "1,2",
                "--out",
                str(tmp_path / "a.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "a.json").read_text())
    assert [r["seed"] for r in report["rows"]] == [1, 2] and all(r["steps"] == len(train) // 64 for r in report["rows"])
    assert "mean" in capsys.readouterr().out and report["machine"]["cpu_count"] >= 1


def test_seeds_in_one_process_train_what_launches_one_by_one_train(tiny, tmp_path, monkeypatch, capsys):
    """--recipe-seeds-in-one-process: one launch runs the recipe's main once per seed (Accelerate's state reset
    between them); each seed's run is the one its own launch makes (the same evaluations, to the last digit), and
    each seed's process_wall_s is its main's seconds."""
    common = ["--recipe", "mnist_convnet", "--dataset", str(tiny), "--target", "0.05", "--seeds", "1,2"]
    common += ["--threads", "1", "--baseline", "off", "--eval-every-steps", "2"]
    common += ["--recipe-args", "--epochs 1 --batch-size 32 --width 8 --log-every 1 --val-fraction 0.2"]
    reports = {}
    for how, extra in (("one-by-one", []), ("in-one-process", ["--recipe-seeds-in-one-process"])):
        out = tmp_path / f"{how}.json"
        run_main([*common, *extra, "--work-dir", str(tmp_path / how), "--out", str(out)], tmp_path, monkeypatch, capsys)
        reports[how] = json.loads(out.read_text())
    seeds = {how: r["seeds"] for how, r in reports.items()}
    for alone, together in zip(seeds["one-by-one"], seeds["in-one-process"]):
        assert alone["seed"] == together["seed"]
        curve = [(p["step"], p["accuracy"]) for p in alone["recipe"]["curve"]]
        assert curve and curve == [(p["step"], p["accuracy"]) for p in together["recipe"]["curve"]]
        assert together["recipe"]["status"] == "completed" and together["recipe"]["process_wall_s"] > 0
    ran = json.loads((tmp_path / "in-one-process" / "recipe-seeds" / "seeds.json").read_text())
    assert [d["seed"] for d in ran] == [1, 2] and reports["in-one-process"]["settings"]["recipe_seeds_in_one_process"]
