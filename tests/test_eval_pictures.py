"""An evaluation's bookkeeping stays off the training loop: its pictures are drawn in a child process
(common.train.render) and still all reach TensorBoard (read with TensorBoard's own reader) and the run folder by the
end of the run or a stop; best/ is written by a thread from a copy of the weights, and whatever records the best
value waits for it. Asserted by structure (where the drawing runs, what waits for what), never by timing."""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import check_ok, read_jsonl, run_in_process, run_in_process_signalled

CONV = ["--width", "8"]
NAMES = ["cat", "dog", "bird", "fish"]


def job_and_arrays():
    rng = np.random.default_rng(0)
    labels = np.arange(12) % 4
    job = {"title": "confusion matrix, eval split (12 images), step 3", "class_names": NAMES}
    job["draw"] = ["confusion", "misclassified"]
    arrays = {
        "confusion": rng.integers(0, 9, (4, 4)),
        "images": rng.integers(0, 256, (12, 1, 8, 8), dtype=np.uint8),
        "labels": labels,
        "preds": (labels + 1) % 4,
    }
    return job, arrays


def images_by_tag(run: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    return {tag: acc.Images(tag) for tag in acc.Tags()["images"]}


def eval_steps(run: Path, split: str = "eval") -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if f"{split}/accuracy" in r]


# --- the drawing process -----------------------------------------------------------------------------------------


def test_the_child_process_draws_what_this_process_would(tmp_path):
    from common.train.render import Renderer, draw

    renderer = Renderer()
    job, arrays = job_and_arrays()
    first = renderer.submit(job, arrays)
    second = renderer.submit(job, arrays)
    drawn = renderer.collect(until=second)
    assert [d.id for d in drawn] == [first, second] and renderer.fallback is None
    here = draw(job, arrays)
    for d in drawn:
        assert d.error is None and set(d.pictures) == {"confusion", "misclassified"}
        for name, (png, height, width) in d.pictures.items():
            assert png == here[name][0] and (height, width) == here[name][1:]  # the same PNG bytes
    child = renderer.proc
    assert child is not None and child.pid != os.getpid() and child.poll() is None  # drawn elsewhere
    assert renderer.finish(timeout=60) == ([], 0)
    renderer.stop()
    assert child.poll() is not None  # the stop message ends it


def test_the_child_imports_nothing_from_the_folder_the_run_is_launched_from(tmp_path, monkeypatch):
    """Launched from a folder that holds a `common` package (and a `matplotlib` one) whose import leaves a marker,
    with an empty PYTHONPATH entry (which stands for that folder): the child imports this process's own `common` and
    the installed matplotlib, draws the same picture this process would, and no marker appears."""
    from common.train.render import Renderer, draw

    launch, marker = tmp_path / "launch", tmp_path / "imported-from-the-launch-folder"
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("common/__init__.py", "common/train/__init__.py", "common/train/render.py", "matplotlib/__init__.py"):
        (launch / name).parent.mkdir(parents=True, exist_ok=True)
        (launch / name).write_text(plant)
    monkeypatch.chdir(launch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep + os.environ.get("PYTHONPATH", ""))
    renderer = Renderer()
    job, arrays = job_and_arrays()
    job["draw"] = ["confusion"]
    job_id = renderer.submit(job, arrays)
    (drawn,) = renderer.collect(until=job_id)
    renderer.stop()
    assert not marker.exists(), marker.read_text()
    assert renderer.fallback is None and drawn.error is None  # drawn by the child
    assert drawn.pictures["confusion"][0] == draw(job, arrays)["confusion"][0]


def test_submitting_does_not_wait_and_what_is_not_drawn_in_time_is_dropped_cleanly():
    """A child that never answers: submit returns at once (the loop is not held); at the end finish waits its time
    limit, drops the job, says how many, and kills the child; a later job starts a new one."""
    from common.train.render import Renderer

    renderer = Renderer(command=[sys.executable, "-c", "import time; time.sleep(120)"], max_pending=2)
    job, arrays = job_and_arrays()
    renderer.submit(job, arrays)
    assert renderer.in_flight == 1 and renderer.collect() == []  # returned with the job still being drawn
    while renderer.proc is None:  # the courier thread starts the child
        time.sleep(0.01)
    hung = renderer.proc
    assert renderer.finish(timeout=0.5) == ([], 1)
    assert hung.poll() is not None and renderer.proc is None and renderer.in_flight == 0


def test_a_child_that_cannot_start_or_dies_is_replaced_by_drawing_in_this_process():
    from common.train.render import Renderer, draw

    renderer = Renderer(command=[sys.executable, "-c", "pass"])  # ends without answering
    job, arrays = job_and_arrays()
    job_id = renderer.submit(job, arrays)
    (drawn,) = renderer.collect(until=job_id)
    assert drawn.error is None and renderer.fallback  # why it draws here
    assert drawn.pictures["confusion"][0] == draw(job, arrays)["confusion"][0]


# --- a run -----------------------------------------------------------------------------------------------------------


def test_a_run_draws_no_picture_in_its_own_process_and_every_one_reaches_tensorboard(
    tmp_path, env, mnist_like, monkeypatch
):
    """The drawing functions raise in the training process: every evaluation's pictures still reach TensorBoard at
    its step (so they were drawn elsewhere), confusion_matrix.png is the final one TensorBoard got, and curves.png is
    drawn by the drawing process too (matplotlib is not imported here for it)."""
    import common.train.plots as plots
    import common.train.render as render

    def not_here(*args, **kwargs):
        raise AssertionError("a picture was drawn in the training process")

    for module in (plots, render):
        monkeypatch.setattr(module, "confusion_matrix_image", not_here)
        monkeypatch.setattr(module, "misclassified_grid", not_here)
        monkeypatch.setattr(module, "curves_png", not_here)
    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, *CONV, "--eval-every-steps", 3]
    proc = check_ok(run_in_process("mnist_convnet", [*args, "--output-dir", run], env))
    assert "pictures" not in proc.stdout, proc.stdout  # no picture failed, none drawn here
    assert render.renderer().fallback is None and render.renderer().proc.pid != os.getpid()
    steps, found = eval_steps(run), images_by_tag(run)
    assert steps == [3, 6, 9]
    for tag in ("eval/confusion_matrix", "eval/misclassified"):
        assert [e.step for e in found[tag]] == steps, tag
    (final,) = found["test/confusion_matrix"]
    assert final.step == 9 and [e.step for e in found["test/misclassified"]] == [9]
    assert (run / "confusion_matrix.png").read_bytes() == final.encoded_image_string
    monkeypatch.undo()
    assert (run / "curves.png").read_bytes() == plots.curves_png(run / "metrics.jsonl")  # what this process draws
    assert not list(run.glob("*.tmp")) and not list(run.glob(".tmp-*")) and not list(run.glob(".old-*"))


def test_a_stopped_run_keeps_every_evaluations_pictures_and_its_resume_adds_the_rest(tmp_path, env, mnist_like):
    """SIGTERM while pictures may still be drawing: the run checkpoints, exits 75, and every evaluation it logged
    has its pictures in TensorBoard; the resumed run adds its own, each evaluation step once."""
    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 400, "--batch-size", 32, *CONV, "--eval-every-steps", 2]
    args += ["--log-every", 1, "--output-dir", run, "--resume-from", "latest"]
    proc = run_in_process_signalled("mnist_convnet", args, env, run, "eval/accuracy", 2)  # after two evaluations
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, found = eval_steps(run), images_by_tag(run)
    assert len(steps) >= 2
    for tag in ("eval/confusion_matrix", "eval/misclassified"):
        assert [e.step for e in found[tag]] == steps, tag
    stopped = json.loads((run / "summary.json").read_text())["global_step"]
    check_ok(run_in_process("mnist_convnet", [*args, "--max-steps", stopped + 2], env))
    steps, found = eval_steps(run), images_by_tag(run)
    assert steps[-1] == stopped + 2  # where --max-steps ended the launch
    for tag in ("eval/confusion_matrix", "eval/misclassified"):
        assert [e.step for e in found[tag]] == steps, tag


# --- best/ ---------------------------------------------------------------------------------------------------------


def make_evaluator(tmp_path, accuracies):
    from types import SimpleNamespace

    from accelerate import Accelerator

    from common.train.evaluator import Evaluator

    model = torch.nn.Linear(3, 2)
    cfg = SimpleNamespace(monitor="eval/accuracy", mode="max", eval_every_steps=0, eval_every=1, epochs=9)
    log = SimpleNamespace(log=lambda *a, **k: None, images=lambda *a, **k: None)
    data = SimpleNamespace(val=object(), test=None, class_names=["a", "b"])
    scores = iter(accuracies)

    def evaluate():
        return {"loss": 1.0, "accuracy": next(scores), "count": 2, "seconds": 0.0}

    evaluator = Evaluator(cfg, Accelerator(cpu=True), model, data, log, {"recipe": "t"}, tmp_path, None)
    evaluator.run = lambda step, epoch, mid_epoch: evaluator.record(evaluate(), step, epoch)  # what run.evaluate does
    return evaluator, model


def test_best_is_written_from_the_weights_at_the_evaluation_and_its_readers_wait_for_it(tmp_path, monkeypatch):
    from common.train import checkpoint as ckpt

    evaluator, model = make_evaluator(tmp_path, [0.5])
    release, writing, real = threading.Event(), threading.Event(), ckpt.save_model_dir

    def slow_save(*args):
        writing.set()
        assert release.wait(60)
        real(*args)

    monkeypatch.setattr(ckpt, "save_model_dir", slow_save)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    evaluator.run(step=3, epoch=0, mid_epoch=False)  # returns with best/ still being written
    assert writing.wait(60) and not (tmp_path / "best").exists()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: best/ keeps the evaluated weights
    read = []
    reader = threading.Thread(target=lambda: read.append(evaluator.best))  # what a checkpoint does
    reader.start()
    reader.join(timeout=0.5)
    assert reader.is_alive() and read == []  # ... waits for best/
    release.set()
    reader.join(timeout=60)
    assert read == [0.5]
    saved = load_file(str(tmp_path / "best" / "model.safetensors"))
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    assert json.loads((tmp_path / "best" / "model.json").read_text())["step"] == 3
    # the same bytes a write in the loop (the previous behaviour) gives for those weights
    model.load_state_dict(expected)
    real(evaluator.accelerator, model, tmp_path / "direct", json.loads((tmp_path / "best" / "model.json").read_text()))
    for name in ("model.safetensors", "model.json"):
        assert (tmp_path / "best" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes()


def test_a_failed_best_write_keeps_the_previous_value_and_is_raised_at_the_next_evaluation(tmp_path, monkeypatch):
    from common.train import checkpoint as ckpt

    evaluator, _ = make_evaluator(tmp_path, [0.5, 0.7, 0.9])
    evaluator.run(step=1, epoch=0, mid_epoch=False)
    assert evaluator.best == 0.5

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_model_dir", full_disk)
    evaluator.run(step=2, epoch=1, mid_epoch=False)
    assert evaluator.best == 0.5  # best/ holds the 0.5 weights: a checkpoint now records 0.5
    assert json.loads((tmp_path / "best" / "model.json").read_text())["metrics"] == {"eval/accuracy": 0.5}
    with pytest.raises(OSError, match="No space left"):
        evaluator.run(step=3, epoch=2, mid_epoch=False)
