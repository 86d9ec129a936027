"""MNIST with a lean ConvNet (a 5x5 conv and a 3x3 conv, each followed at once by a 2x2 maxpool, BatchNorm and
ReLU, then a 256-unit hidden layer), on 1 to N devices: about 10 MFLOP per training image.

The techniques are flags with tuned defaults: --model lean --width 24 --hidden 256 (model size), AdamW --lr 1e-2
--betas 0.7,0.9 --weight-decay 1e-4, --warmup-fraction 0.2 --schedule cosine, --label-smoothing 0.1, --batch-size
256, no augmentation (--translate N adds random shifts), --channels-last (CPUs' max-pool is vectorised only for it),
--sync-bn (BatchNorm statistics shared over processes); --model deep is a larger ConvNet. --target-accuracy 0.993
exits 4 below it. Measured accuracy and wall time, seed by seed: docs/results.md.

    accelerate launch recipes/mnist_convnet.py                                   # one process (CPU or one GPU)
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/mnist_convnet.py  # 2 CPU processes
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/mnist_convnet.py --sync-bn  # GPUs
    accelerate launch recipes/mnist_convnet.py --output-dir runs/mnist --resume-from latest   # resume, or start fresh
Every knob: python recipes/mnist_convnet.py --help
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from common.api import (
    BatchTransform,
    CommonConfig,
    ConvNet,
    LeanConvNet,
    LRRule,
    TrainingRun,
    build_scheduler,
    channel_stats,
    convert_sync_batchnorm,
    evaluate,
    knob,
    parse_config,
    parse_floats,
)


@dataclass
class Config(CommonConfig):
    dataset: str = "ylecun/mnist"
    epochs: int = 3
    batch_size: int = 256
    lr: float = knob(1e-2, "peak learning rate (AdamW)")
    lr_rule = LRRule("sqrt", 256)  # AdamW: the LR follows the square root of the batch
    betas: str = knob("0.7,0.9", "AdamW betas, comma-separated (short memories suit a 3-epoch run)")
    weight_decay: float = knob(1e-4, "AdamW weight decay")
    warmup_fraction: float = 0.2
    label_smoothing: float = 0.1
    translate: int = knob(0, "random translation of each training image by up to N pixels (reflection padding)")
    model: str = knob(
        "lean",
        "lean: 5x5 conv, pool, 3x3 conv, pool, hidden linear layer; deep: blocks of --depth 3x3 "
        "conv-BN-ReLU layers, each block ending in a pool",
        choices=["lean", "deep"],
    )
    width: int = knob(24, "channels of the first conv (block); the second has twice as many")
    hidden: int = knob(256, "units of the hidden linear layer (--model lean)")
    depth: int = knob(2, "conv-BN-ReLU layers per block (--model deep)")
    dropout: float = knob(0.0, "dropout before the last linear layer")
    channels_last: bool = knob(
        True,
        "channels_last memory format for the model and batches (on CPUs the max-pools "
        "then take the vectorised path: half the step time here)",
    )
    sync_bn: bool = knob(False, "BatchNorm statistics over all processes (SyncBatchNorm) instead of per process")

    def __post_init__(self):
        parse_floats(self.betas, "--betas", count=2)  # a malformed pair fails here, before any data is read


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here."""
    if cfg.model == "lean":
        return LeanConvNet(in_shape, num_classes, width=cfg.width, hidden=cfg.hidden, dropout=cfg.dropout)
    return ConvNet(in_shape, num_classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout)


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
    mean, std = run.normalisation(lambda: channel_stats(data.train))  # --eval-only: the scored run's
    transform = BatchTransform(mean, std, translate=cfg.translate, channels_last=cfg.channels_last)  # on the device
    train_loader, val_loader = run.loader(data.train, train=True), run.loader(data.val)
    final_loader = run.loader(data.test) or val_loader

    # --- model ---
    set_seed(cfg.seed)
    model = build_model(cfg, data.shape, data.num_classes)
    if cfg.sync_bn:
        model = convert_sync_batchnorm(model, accelerator.device)
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
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
