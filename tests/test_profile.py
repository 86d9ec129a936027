"""--profile N: a few optimizer steps under the PyTorch profiler, one trace per process. Read from the
2-process fashion_mnist_mlp reference run of conftest, which runs with --profile 2."""

from __future__ import annotations

import json


def test_profile_writes_a_trace_per_process(reference_run):
    ref = reference_run("fashion_mnist_mlp", 2)
    run, proc = ref.run, ref.proc
    traces = sorted((run / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) == 2  # exactly N steps
        assert any("addmm" in e.get("name", "") or "linear" in e.get("name", "") for e in events)
    assert "profiler: trace of 2 optimizer step(s)" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 16  # the run goes on to the end
