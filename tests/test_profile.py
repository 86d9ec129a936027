"""--profile N: a few optimizer steps under the PyTorch profiler, one trace per process."""

from __future__ import annotations

import json

from conftest import check_ok, launch


def test_profile_writes_a_trace_per_process(tmp_path, env, mnist_like):
    run = tmp_path / "run"
    proc = check_ok(launch("fashion_mnist_mlp", ["--dataset", mnist_like, "--hidden", 32, "--epochs", 1,
                                                 "--batch-size", 32, "--profile", 2, "--output-dir", run], env, nproc=2))
    traces = sorted((run / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) == 2  # exactly N steps recorded
    assert any("addmm" in e.get("name", "") or "linear" in e.get("name", "") for e in events)
    assert "profiler: trace of 2 optimizer step(s)" in proc.stdout
    assert (run / "summary.json").is_file()  # the run goes on to the end after the profiled steps
