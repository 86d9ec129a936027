"""Scaling of one recipe from 1 process to 2 at the same global batch, through Accelerate and through raw
DistributedDataParallel, on synthetic data of its shape; 1 thread per process on a CPU, 1 GPU each with --device
cuda. Rows (samples/s over all processes): `recipe_1proc` and `raw_torch_1proc` as in throughput.py;
`recipe_2proc`, `accelerate launch` with accelerate_configs/cpu_2proc.yaml, fp32; `raw_ddp_2proc`, the plain loop
in 2 spawned processes under DDP (gloo on a CPU, nccl on GPUs), a window lasting as long as its slowest rank.
Ratios (targets in benchmarks/README.md): 2-process scaling efficiency = samples/s(2 procs) / (2 x samples/s(1
proc)) of each, and the recipe's overhead over the plain loop at 2 processes and at 1.

    python benchmarks/scaling.py --recipe mnist_convnet
    python benchmarks/scaling.py --recipe cifar_cnn --device cuda      # 2 GPUs
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import harness
import torch
import torch.multiprocessing as mp
from launching import import_recipe, recipe_config
from machine import free_port


def _ddp_worker(rank: int, world: int, port: int, job: dict, out_dir: str):
    """One rank of raw_ddp_2proc (spawned): the recipe's model under DDP on the same synthetic images."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = job["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(job["threads"])
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    module, cfg = import_recipe(job["recipe"]), recipe_config(job["recipe"], job["recipe_argv"])
    shape = tuple(job["shape"])
    images, labels = harness.synthetic_images(shape, job["num_images"])
    transform, windows = harness.batch_transform(cfg, images), []
    for k in range(job["runs"]):
        stream = harness.tensor_batches(images, labels, cfg.batch_size // world, cfg.seed + k, rank, world)
        step = harness.raw_step(module, cfg, shape, device, stream, transform, rank, world)
        torch.distributed.barrier()
        windows += harness.time_windows(step, job["steps"], job["log_every"], device)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"seconds": windows, "backend": torch.distributed.get_backend()})
    )
    torch.distributed.barrier()  # both ranks done before either tears gloo down (else the other can abort)
    torch.distributed.destroy_process_group()


def raw_ddp_row(bench, world: int, threads: int) -> dict:
    args = bench.args
    job = {
        "device": bench.device.type,
        "threads": threads,
        "recipe": str(args.recipe_path),
        "recipe_argv": args.recipe_argv,
        "shape": list(bench.shape),
        "num_images": bench.num_images,
        "runs": args.runs,
        "steps": args.steps,
        "log_every": args.log_every,
    }
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _ddp_worker, args=(world, free_port(), job, tmp), nprocs=world, join=True, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    seconds = [max(ts) for ts in zip(*(r["seconds"] for r in ranks))]  # a window lasts as long as its slowest rank
    return harness.timed_row(
        seconds,
        args.log_every * bench.cfg.batch_size,
        world,
        threads,
        global_batch=bench.cfg.batch_size,
        backend=ranks[0]["backend"],
    )


def measure(bench) -> dict:
    cpu, batch = bench.device.type == "cpu", bench.cfg.batch_size
    threads = 1 if cpu else torch.get_num_threads()  # per process: on a CPU, 2 processes use 2 cores, not 2 x all
    bench.measure("recipe_1proc", lambda: bench.recipe_row("recipe_1proc", 1, threads))
    bench.measure("raw_torch_1proc", lambda: bench.raw_row(threads))
    why = (
        f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
        if not cpu and torch.cuda.device_count() < 2
        else f"the global batch {batch} does not split over 2 processes"
        if batch % 2
        else None
    )
    if why:
        bench.skipped["recipe_2proc"] = bench.skipped["raw_ddp_2proc"] = why
    else:
        bench.measure("recipe_2proc", lambda: bench.recipe_row("recipe_2proc", 2, threads))
        bench.measure("raw_ddp_2proc", lambda: raw_ddp_row(bench, 2, threads))
    return {
        "scaling_efficiency_2proc": (
            "2-proc scaling efficiency (recipe)",
            bench.ratio("recipe_2proc", "recipe_1proc", 2),
            ">=",
            0.85 if bench.cnn else 0.75,
        ),
        "scaling_efficiency_2proc_raw": (
            "2-proc scaling efficiency (raw DDP)",
            bench.ratio("raw_ddp_2proc", "raw_torch_1proc", 2),
            None,
            None,
        ),
        "accelerate_overhead_2proc_pct": (
            "recipe overhead vs raw DDP, 2 procs (%)",
            bench.overhead_pct("recipe_2proc", "raw_ddp_2proc"),
            "<=",
            3.0,
        ),
        "accelerate_overhead_1proc_pct": (
            "recipe overhead vs raw PyTorch, 1 proc (%)",
            bench.overhead_pct("recipe_1proc", "raw_torch_1proc"),
            None,
            None,
        ),
    }


def main(argv=None) -> int:
    return harness.main("scaling", __doc__, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
