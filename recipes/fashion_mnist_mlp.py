"""FashionMNIST with an MLP (flatten, 784 -> 512 -> 512 -> 10, ReLU), on 1 to N devices: the simplest recipe to
start from (no augmentation, no weight average).

The techniques are flags: --hidden 512,512 (width), --dropout (0: off), --label-smoothing 0.1, --warmup-fraction
0.05 --schedule cosine (warm-up, then cosine decay to zero within the run), AdamW --lr 4e-3 --weight-decay 1e-4,
--batch-size 1024, --epochs 18. The Hub's dataset has a test split, on which the run ends; --target-accuracy 0.89
exits 4 below it. Measured accuracy and wall time, seed by seed: docs/results.md.

    accelerate launch recipes/fashion_mnist_mlp.py                              # one process (CPU or one GPU)
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/fashion_mnist_mlp.py  # 2 CPU processes
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/fashion_mnist_mlp.py  # GPUs, bf16
    accelerate launch recipes/fashion_mnist_mlp.py --output-dir runs/fmnist --resume-from latest  # resume or start
Every knob: python recipes/fashion_mnist_mlp.py --help
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from common.api import (
    MLP,
    BatchTransform,
    CommonConfig,
    LRRule,
    TrainingRun,
    build_scheduler,
    channel_stats,
    evaluate,
    knob,
    parse_config,
    parse_floats,
    parse_ints,
)


@dataclass
class Config(CommonConfig):
    dataset: str = "zalando-datasets/fashion_mnist"
    epochs: int = 18
    batch_size: int = 1024
    lr: float = knob(4e-3, "peak learning rate (AdamW)")
    lr_rule = LRRule("sqrt", 1024)  # AdamW: the LR follows the square root of the batch
    betas: str = knob("0.9,0.999", "AdamW betas, comma-separated")
    weight_decay: float = knob(1e-4, "AdamW weight decay")
    warmup_fraction: float = 0.05
    label_smoothing: float = 0.1
    hidden: str = knob("512,512", "hidden layer widths, comma-separated (e.g. 512 for one layer)")
    dropout: float = knob(0.0, "dropout after each hidden layer")

    def __post_init__(self):
        parse_ints(self.hidden, "--hidden")  # a malformed list fails here, before any data is read
        parse_floats(self.betas, "--betas", count=2)


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here."""
    return MLP(in_shape, num_classes, hidden=parse_ints(cfg.hidden, "--hidden"), dropout=cfg.dropout)


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=parse_floats(cfg.betas, "--betas", count=2),
        weight_decay=cfg.weight_decay,
        fused=True,  # one kernel per step; masks a NaN step
    )


def main(argv=None) -> int:
    cfg = parse_config(Config, argv, __doc__)  # the command line (and --config FILE)
    # + the launcher's answers and a resume's settings; the Accelerator; runs/<file name>-<time>/
    with TrainingRun(cfg, __file__) as run:
        train(cfg, run)
    return run.exit_code  # how it ended (summary.json says it too)


def train(cfg: Config, run: TrainingRun) -> None:
    accelerator = run.accelerator

    # --- data ---
    data = run.load_data()  # decoded once into uint8 tensors and cached; validation held out of train
    # normalisation only, on the device (--eval-only: the scored run's)
    transform = BatchTransform(*run.normalisation(lambda: channel_stats(data.train)))
    train_loader, val_loader = run.loader(data.train, train=True), run.loader(data.val)
    final_loader = run.loader(data.test) or val_loader

    # --- model ---
    set_seed(cfg.seed)
    model = build_model(cfg, data.shape, data.num_classes)
    optimizer = build_optimizer(cfg, model)
    model, optimizer, train_loader, val_loader, final_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader, final_loader
    )
    # Schedule length from the prepared loader (per-process batches), so the LR trace is the same on N processes.
    scheduler = accelerator.prepare(build_scheduler(optimizer, cfg, math.ceil(len(train_loader) / cfg.grad_accum)))

    def validate(loader):
        return evaluate(accelerator, model, loader, transform, data.num_classes)

    if cfg.eval_only:  # score the weights in --checkpoint on the test split (else validation)
        return run.eval_only(model, validate, final_loader)

    # --- train: the loop is yours; each line says when, each run.<call> says how (docs/loop.md) ---
    run.start(model, optimizer, scheduler, train_loader, data, transform)  # or resume exactly
    last_step = cfg.max_steps or math.inf  # --max-steps: this launch stops there
    for epoch in range(run.epoch, cfg.epochs):
        if run.step >= last_step or run.no_improvement():  # --max-steps; --patience
            break
        model.train()
        for images, labels in run.batches(train_loader, epoch):  # a resumed epoch skips ahead
            with accelerator.accumulate(model):
                logits = model(transform.train(images, run.augment_generator()))
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.label_smoothing)
                accelerator.backward(loss)
                run.track(loss)  # counts the update; the NaN/stop guard (no sync)
                log_now = accelerator.sync_gradients and run.step % cfg.log_every == 0
                if accelerator.sync_gradients and (cfg.max_grad_norm or log_now):
                    clip_to = cfg.max_grad_norm or math.inf  # --max-grad-norm 0: measured, not clipped
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_to)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:  # a --grad-accum micro-batch: the update comes later
                continue
            if not accelerator.optimizer_step_was_skipped:  # fp16 loss scaling may skip an update
                scheduler.step()
            if log_now:  # the mean loss since the last log, LR, throughput: one sync
                run.log({"train/grad_norm": grad_norm})  # your own scalars go here too
            if cfg.eval_every_steps and run.step % cfg.eval_every_steps == 0:
                run.evaluate(validate, val_loader)  # pictures=True: its pictures too
            if run.stop_requested():  # a signal or a lost launcher, on any rank
                run.preempt()  # checkpoint, exit 75
            if run.checkpoint_due():  # --checkpoint-every-s (and --checkpoint-every)
                run.checkpoint()
            if run.step >= last_step or run.no_improvement():
                break
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            run.evaluate(validate, val_loader)  # not twice for the same weights

    run.finish(validate, final_loader)  # checkpoint, final evaluation, final/, summary.json


if __name__ == "__main__":
    sys.exit(main())
