"""--profile N: a PyTorch profiler trace of N optimizer steps per process."""

from __future__ import annotations

from pathlib import Path

from common.console import say


class StepProfiler:
    """--profile N: skip one optimizer step, warm up one, then record N with the PyTorch profiler (its default
    activities: the CPU, and CUDA where there is one). Each rank writes a trace to <run dir>/profile (TensorBoard's
    PyTorch Profiler plugin, torch-tb-profiler, shows it; so do Perfetto and chrome://tracing). Does nothing when N
    is 0."""

    def __init__(self, accelerator, steps: int, run_dir: Path):
        self.prof = None
        if not steps:
            return
        from torch.profiler import profile, schedule, tensorboard_trace_handler

        self.dir, self.steps, self.written = run_dir / "profile", steps, False
        write = tensorboard_trace_handler(str(self.dir), worker_name=f"rank{accelerator.process_index}")

        def written(prof) -> None:
            write(prof)
            self.written = True

        self.prof = profile(
            schedule=schedule(wait=1, warmup=1, active=steps, repeat=1), on_trace_ready=written, record_shapes=True
        )
        self.prof.start()

    def step(self):
        if self.prof is None:
            return
        self.prof.step()
        if self.written:  # the schedule's one cycle is recorded and its trace written: no profiler from here on
            self.close()
            say(
                f"profiler: trace of {self.steps} optimizer step(s) per process written to "
                f"{self.dir} (tensorboard --logdir {self.dir.parent}, PyTorch Profiler tab)"
            )

    def close(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
