"""Training throughput of one recipe against what its model could do, on the recipe's own code (its Config,
build_model, build_optimizer) and synthetic data of its shape. Rows (samples/s, 1 process): `recipe` (the recipe
itself, read back from its metrics.jsonl), `raw_torch` (its step in a plain PyTorch loop), `pure_compute` (its
model and optimizer over ONE pre-built batch: the compute bound), and the levers on that bound: `pure_bf16` (bf16
autocast), `pure_channels_last` or `pure_contiguous` (the memory format the recipe does not use), `pure_compiled`
(torch.compile, --compile-backend; the cold compile timed apart). The recipe and raw rows time windows of
--log-every steps, the first dropped; the pure rows take turns, --repeats rounds after --warmup steps each.
Ratios (targets in benchmarks/README.md): recipe / pure compute, recipe overhead vs raw PyTorch, bf16 / fp32,
channels_last / contiguous, compiled / eager.

    python benchmarks/throughput.py --recipe mnist_convnet              # any recipes/*.py, or a recipe file
    python benchmarks/throughput.py --recipe mnist_convnet --recipe-args "--width 32" --skip compile
"""

import contextlib
import math
import os
import statistics
import sys

import harness
import torch
import torch.nn.functional as F

LEVERS = ("bf16", "channels_last", "compile")


def add_args(p):
    p.add_argument("--repeats", type=int, help="timed rounds of the pure rows (default 5, --tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps of each pure row (default 2, --tiny 1)")
    p.add_argument("--skip", type=skip_list, default=[], help=f"levers to leave out: {','.join(LEVERS)}")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of pure_compiled")


def skip_list(text: str) -> list[str]:
    skip = sorted({s.strip() for s in text.split(",") if s.strip()})
    if set(skip) - set(LEVERS):
        harness.bad_input(
            f"--skip {','.join(sorted(set(skip) - set(LEVERS)))}: unknown; the levers are {', '.join(LEVERS)}."
        )
    return skip


def pure_step(bench, x, y, bf16=False, channels_last=None, compile_backend=None):
    """The compute bound: the recipe's model and optimizer over ONE pre-built batch."""
    cfg, device = bench.cfg, bench.device
    model = harness.new_model(bench.module, cfg, bench.shape, device, channels_last)
    optimizer = bench.module.build_optimizer(cfg, model)
    cl = channels_last if channels_last is not None else getattr(cfg, "channels_last", False)
    x = x.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step():
        with autocast():
            logits = forward(x)
        F.cross_entropy(logits.float(), y, label_smoothing=getattr(cfg, "label_smoothing", 0.0)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def pure_rows(bench) -> dict:
    """pure_compute and the levers on it, in turns. A lever that fails is reported with its reason."""
    from common.data.augment import batch_generator
    from common.train.accelerator import cpu_bf16_support

    args, cfg, device, batch = bench.args, bench.cfg, bench.device, bench.cfg.batch_size
    x = bench.transform.train(bench.images[:batch].to(device), batch_generator(cfg.seed, 0, 0, 0))
    y = bench.labels[:batch].to(device)
    runners, levers = {"pure_compute": pure_step(bench, x, y)}, bench.extra["levers"]
    cl_default = bool(getattr(cfg, "channels_last", False))
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else bool(cpu_bf16_support())
    # inductor keeps compiled kernels on disk across processes: a cache of its own (empty unless a --work-dir
    # is reused) makes compile_s what a first run pays, not a cache read
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(bench.work / "inductor-cache"))
    candidates = {
        "bf16": ({"row": "pure_bf16", "native_bf16": native}, dict(bf16=True)),
        "channels_last": (
            {"row": "pure_contiguous" if cl_default else "pure_channels_last", "recipe_default": cl_default},
            dict(channels_last=not cl_default),
        ),
        "compile": (
            {
                "row": "pure_compiled",
                "backend": args.compile_backend,
                "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            },
            dict(compile_backend=args.compile_backend),
        ),
    }
    for name, (lever, how) in candidates.items():
        if name in args.skip:
            bench.skipped[name] = f"--skip {name}"
        elif name == "channels_last" and not bench.cnn:
            levers[name] = {"status": "n/a", "reason": "the model has no convolutions"}
        else:
            levers[name] = lever
            try:  # the first step, timed apart: for torch.compile, the compile (forward and backward graphs)
                step = pure_step(bench, x, y, **how)
                lever["first_step_s"] = harness.time_rounds({"": step}, 0, 1, 1, device)[""][0]
                runners[lever["row"]] = step
            except Exception as err:  # reported with its reason, not hidden; the other rows still count
                lever.update(status="failed", reason=harness.first_line(err))
                bench.skipped[lever["row"]] = f"failed: {lever['reason']}"

    seconds = harness.time_rounds(runners, args.warmup, args.repeats, args.log_every, device)
    out = {
        name: harness.timed_row(
            s, args.log_every * batch, global_batch=batch, ms_per_step=1000 * statistics.median(s) / args.log_every
        )
        for name, s in seconds.items()
    }
    for name, lever in levers.items():
        if lever.get("row") in out:
            speedup = out[lever["row"]]["samples_per_s"] / out["pure_compute"]["samples_per_s"]
            # channels_last is always reported as channels_last / contiguous, whichever the recipe uses
            lever.update(status="ok", speedup=1 / speedup if lever.get("recipe_default") else speedup)
    if "pure_compiled" in out:
        levers["compile"]["compile_s"] = max(
            0.0, levers["compile"]["first_step_s"] - out["pure_compiled"]["ms_per_step"] / 1000
        )
    return out


def measure(bench) -> dict:
    threads = torch.get_num_threads()
    bench.extra["levers"] = levers = {}
    bench.measure("recipe", lambda: bench.recipe_row("recipe", 1, threads))
    bench.measure("raw_torch", lambda: bench.raw_row(threads))
    bench.measure("pure rows and levers", lambda: pure_rows(bench))
    bf16, cl, compiled = (levers.get(k, {}) for k in LEVERS)
    return {
        "recipe_vs_pure_compute": ("recipe / pure compute", bench.ratio("recipe", "pure_compute"), ">=", 0.90),
        "accelerate_overhead_1proc_pct": (
            "recipe overhead vs raw PyTorch, 1 proc (%)",
            bench.overhead_pct("recipe", "raw_torch"),
            "<=",
            3.0,
        ),
        "bf16_vs_fp32": (
            f"bf16 autocast / fp32, pure step{'' if bf16.get('native_bf16', True) else ' (emulated)'}",
            bench.ratio("pure_bf16", "pure_compute"),
            *((">=", 1.3 if bench.cnn else 1.0) if bf16.get("native_bf16") else (None, None)),
        ),
        "channels_last_vs_contiguous": (
            f"channels_last / contiguous, pure step (recipe: "
            f"{'channels_last' if cl.get('recipe_default') else 'contiguous'})",
            cl.get("speedup"),
            None,
            None,
        ),
        "compile_vs_eager": (
            f"torch.compile ({bench.args.compile_backend}) / eager, pure step, steady state "
            f"(compile {compiled.get('compile_s', math.nan):.1f} s apart)",
            bench.ratio("pure_compiled", "pure_compute"),
            None,
            None,
        ),
    }


def main(argv=None) -> int:
    return harness.main("throughput", __doc__, argv, measure, add_args)


if __name__ == "__main__":
    sys.exit(main())
