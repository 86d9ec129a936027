"""--eval-only under another launcher precision than the run trained under says so on its report line, with the
command that scores as the run trained; under the same precision it says nothing of it.

A bf16 launch on a CPU without native bf16 (AVX2 only) runs in fp32 (``make_accelerator`` asks
``cpu_bf16_support``), which would leave no other precision to score under: on such a CPU the check answers as an
AMX CPU's does (a stand-in for the capability only; torch still computes bf16 autocast, emulated and slower), so
the bf16 half runs on every CPU."""

from __future__ import annotations

import json

import common.train.accelerator as accelerator_module
from common.train.accelerator import cpu_bf16_support

from helpers import check_ok, run_in_process


def test_eval_only_names_a_precision_other_than_the_runs(tmp_path, env, mnist_like, monkeypatch):
    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            [
                "--dataset",
                mnist_like,
                "--hidden",
                "32",
                "--epochs",
                1,
                "--batch-size",
                32,
                "--output-dir",
                run,
            ],
            env,
        )
    )
    assert json.loads((run / "summary.json").read_text())["precision"] == "no"  # the launcher's default
    same = check_ok(run_in_process("fashion_mnist_mlp", ["--eval-only", "--checkpoint", run], env))
    [line] = [line for line in same.stdout.splitlines() if line.startswith("eval-only:")]
    assert "precision" not in line, line
    if not cpu_bf16_support():  # the run is in this process (run_in_process): make_accelerator reads the stand-in
        monkeypatch.setattr(accelerator_module, "cpu_bf16_support", lambda: "amx")
    other = check_ok(
        run_in_process(
            "fashion_mnist_mlp",
            ["--eval-only", "--checkpoint", run / "final"],
            {**env, "ACCELERATE_MIXED_PRECISION": "bf16"},
        )
    )
    [line] = [line for line in other.stdout.splitlines() if line.startswith("eval-only:")]
    assert (
        "NOTE: trained under no precision, scored now under bf16: accuracy and loss may differ a little; launch "
        "with `accelerate launch --mixed_precision no ...` to score as trained"
    ) in line, line
    assert json.loads((run / "final" / "eval-test.json").read_text())["precision"] == "bf16"
