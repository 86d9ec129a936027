"""Top-5 accuracy: exact over the split (each image counted once) where there are more than 5 classes, logged beside
accuracy, in the final metrics and eval-only's file, selectable by --monitor (best/ then holds the best top-5
weights); with 5 classes or fewer it is not reported, and --monitor eval/top5_accuracy is refused in one paragraph."""

from __future__ import annotations

import json

import torch
from accelerate import Accelerator

from common.train.metrics import evaluate

from helpers import check_ok, read_jsonl, run_in_process, write_parquet_dataset


class Fixed(torch.nn.Module):
    """A model whose logits for image i are row i of ``table`` (the image holds its own index)."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, x):
        return self.table[x.long()]


def test_top5_accuracy_counts_the_images_whose_class_is_among_the_five_highest_logits():
    # 7 classes; image i's class is 0; its logits rank class 0 first, 3rd, 5th, 6th and 7th
    ranks = [0, 2, 4, 5, 6]
    table = torch.zeros(5, 7)
    for i, r in enumerate(ranks):
        table[i] = torch.arange(7, 0, -1).float()  # class k has logit 7 - k: ranked k-th
        table[i, [0, r]] = table[i, [r, 0]]  # class 0 swapped into rank r
    images, labels = torch.arange(5), torch.zeros(5, dtype=torch.int64)
    loader = [(images[:3], labels[:3]), (images[3:], labels[3:])]
    transform = type("T", (), {"eval": staticmethod(lambda x: x)})()
    m = evaluate(Accelerator(cpu=True), Fixed(table), loader, transform, num_classes=7)
    assert m["count"] == 5 and m["accuracy"] == 0.2 and m["top5_accuracy"] == 0.6  # ranks 1, 3 and 5 of 5
    four = evaluate(Accelerator(cpu=True), Fixed(table[:, :4]), loader, transform, num_classes=4)
    assert "top5_accuracy" not in four  # 4 classes: every image's top 5 would hold its class


def test_a_run_monitors_top5_accuracy_and_refuses_it_with_five_classes_or_fewer(tmp_path, env, mnist_like):
    seven = write_parquet_dataset(tmp_path / "seven", {"train": 280, "test": 70}, num_classes=7)
    run = tmp_path / "run"
    args = ["--dataset", seven, "--epochs", 2, "--batch-size", 32, "--hidden", 32, "--output-dir", run]
    check_ok(run_in_process("fashion_mnist_mlp", [*args, "--monitor", "eval/top5_accuracy"], env))
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r]
    assert len(evals) == 2 and all(r["eval/accuracy"] <= r["eval/top5_accuracy"] <= 1 for r in evals), evals
    best = json.loads((run / "best" / "model.json").read_text())["metrics"]
    assert best == {"eval/top5_accuracy": max(r["eval/top5_accuracy"] for r in evals)}
    final = json.loads((run / "summary.json").read_text())["final"]
    assert final["test/accuracy"] <= final["test/top5_accuracy"] and final["test/count"] == 70
    refused = run_in_process(
        "fashion_mnist_mlp",
        ["--dataset", mnist_like, "--epochs", 1, "--batch-size", 32, "--hidden", 32, "--monitor", "eval/top5_accuracy",
         "--output-dir", tmp_path / "four"],
        env,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    [paragraph] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "--monitor eval/top5_accuracy needs more than 5 classes" in paragraph and "has 4" in paragraph
