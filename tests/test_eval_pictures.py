"""An evaluation's bookkeeping: the final evaluation's pictures (and those the loop asks for) reach TensorBoard (read
with TensorBoard's own reader) and the run folder; best/ is written by a thread from a copy of the weights, and
whatever records the best value waits for it. Asserted by structure (what is drawn, what waits for what), never by
timing."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import check_ok, read_jsonl, run_in_process, run_in_process_signalled

CONV = ["--width", "8"]
NAMES = ["cat", "dog", "bird", "fish"]


def images_by_tag(run: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    return {tag: acc.Images(tag) for tag in acc.Tags()["images"]}


def eval_steps(run: Path, split: str = "eval") -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if f"{split}/accuracy" in r]


# --- a run -----------------------------------------------------------------------------------------------------------


def test_a_runs_evaluations_log_scalars_and_its_final_evaluation_draws_the_pictures(tmp_path, env, mnist_like):
    """Evaluations during the run log their scalars only; the final evaluation draws its confusion matrix and
    misclassified images into TensorBoard (read with TensorBoard's own reader) at its step, confusion_matrix.png is
    the same picture, and curves.png is what plots.curves_png draws from the run's metrics.jsonl."""
    from common.train import plots

    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, *CONV, "--eval-every-steps", 3]
    check_ok(run_in_process("mnist_convnet", [*args, "--output-dir", run], env))
    assert eval_steps(run) == [3, 6, 9]
    found = images_by_tag(run)
    assert sorted(found) == ["test/confusion_matrix", "test/misclassified"], sorted(found)
    (final,) = found["test/confusion_matrix"]
    assert final.step == 9 and [e.step for e in found["test/misclassified"]] == [9]
    assert (run / "confusion_matrix.png").read_bytes() == final.encoded_image_string
    assert (run / "curves.png").read_bytes() == plots.curves_png(run / "metrics.jsonl")
    assert not list(run.glob("*.tmp")) and not list(run.glob(".tmp-*")) and not list(run.glob(".old-*"))


def test_a_picture_that_cannot_be_drawn_is_a_note_and_the_run_completes(tmp_path, env, mnist_like, monkeypatch):
    """matplotlib failing at the end (a broken font cache, a full /tmp): the run's weights, final/ and summary.json
    are what they would be; each picture left out is said in one NOTE line."""
    from common.train import plots

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plots, "confusion_matrix_image", broken)
    monkeypatch.setattr(plots, "curves_png", broken)
    run = tmp_path / "run"
    proc = check_ok(run_in_process("mnist_convnet", ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, *CONV,
                                                     "--output-dir", run], env))  # fmt: skip
    assert "NOTE: the test pictures of step 9 could not be drawn (RuntimeError: no fonts)" in proc.stdout
    assert "NOTE: curves.png could not be drawn (RuntimeError: no fonts)" in proc.stdout
    assert json.loads((run / "summary.json").read_text())["status"] == "completed" and (run / "final").is_dir()
    assert not (run / "confusion_matrix.png").exists() and not (run / "curves.png").exists()


def test_an_evaluation_the_loop_asks_pictures_of_draws_them_at_its_step(tmp_path, env, mnist_like):
    """`run.evaluate(validate, val_loader, pictures=True)` in a copy's loop: those evaluations' pictures are in
    TensorBoard at their steps; a resume after a stop adds its own, each step once."""
    from helpers import copy_recipe

    copy = copy_recipe("mnist_convnet", tmp_path / "with_pictures.py")
    line = "                run.evaluate(validate, val_loader)  # pictures=True: its pictures too\n"
    text = copy.read_text()
    assert text.count(line) == 1
    copy.write_text(text.replace(line, line.replace("val_loader)", "val_loader, pictures=True)")))
    run = tmp_path / "run"
    args = ["--dataset", mnist_like, "--epochs", 400, "--batch-size", 32, *CONV, "--eval-every-steps", 2]
    args += ["--log-every", 1, "--output-dir", run, "--resume-from", "latest"]
    proc = run_in_process_signalled(copy, args, env, run, "eval/accuracy", 2)  # after two evaluations
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, found = eval_steps(run), images_by_tag(run)
    assert len(steps) >= 2
    for tag in ("eval/confusion_matrix", "eval/misclassified"):
        assert [e.step for e in found[tag]] == steps, tag
    stopped = json.loads((run / "summary.json").read_text())["global_step"]
    check_ok(run_in_process(copy, [*args, "--max-steps", stopped + 2], env))
    steps, found = eval_steps(run), images_by_tag(run)
    assert steps[-1] == stopped + 2  # where --max-steps ended the launch (evaluated there by its own line)
    for tag in ("eval/confusion_matrix", "eval/misclassified"):
        assert [e.step for e in found[tag]] == [s for s in steps if s % 2 == 0], tag


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
