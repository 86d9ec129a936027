"""CIFAR-10 with airbench94's method (arXiv 2404.00498), as an Accelerate script, on 1 to N devices.

Each part of the method is a flag: the airbench network (common.models) with --whiten-init and --dirac-init,
BatchNorm biases at --bias-lr-scale 64x (common.optimizers), Lookahead (common.averaging), --flip alternating,
--translate, --tta 2, one evaluation at the end (--eval-every 10). Measured accuracy and wall time, seed by seed and
machine by machine: docs/results.md.

    accelerate launch recipes/cifar_cnn.py          # one process (CPU or one GPU)
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/cifar_cnn.py   # 2 CPU processes
    # all GPUs of one machine, bf16; the final model: all 50,000 images, the test split reported
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/cifar_cnn.py --val-fraction 0
    accelerate launch recipes/cifar_cnn.py --output-dir runs/cifar --resume-from latest   # resume, or start fresh
Every knob: python recipes/cifar_cnn.py --help
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
    CifarCNN,
    CommonConfig,
    ConfigError,
    Lookahead,
    LRRule,
    TrainingRun,
    build_scheduler,
    channel_stats,
    convert_sync_batchnorm,
    evaluate,
    init_whitening,
    knob,
    parse_config,
    parse_ints,
    sgd_with_bias_groups,
)


@dataclass
class Config(CommonConfig):
    dataset: str = "uoft-cs/cifar10"
    epochs: int = 10
    batch_size: int = 1024
    lr: float = knob(1.5, "peak learning rate of the mean loss (SGD, Nesterov)")
    lr_rule = LRRule("linear", 1024)  # SGD on the mean loss: the LR follows the batch linearly
    momentum: float = knob(0.85, "SGD momentum (Nesterov)")
    weight_decay: float = knob(1.33e-3, "SGD weight decay (coupled to the LR, as torch's SGD does)")
    bias_lr_scale: float = knob(64.0, "BatchNorm biases learn this many times faster (their decay per step unchanged)")
    warmup_fraction: float = knob(0.23, "fraction of optimizer steps spent warming the LR up linearly")
    warmup_start: float = 0.2
    schedule: str = "linear"
    final_lr: float = 0.07
    label_smoothing: float = 0.2
    widths: str = knob("64,256,256", "channels of the three conv groups, comma-separated")
    whiten_init: bool = knob(True, "set the stem conv to whiten 2x2 patches of the training images, and freeze it")
    dirac_init: bool = knob(True, "3x3 convs start as the identity on their first channels (dirac init)")
    whiten_bias_epochs: int = knob(3, "train the whitening conv's bias for this many epochs, then hold it still")
    lookahead_every: int = knob(5, "Lookahead weight averaging every N optimizer steps (0 = off)")
    translate: int = knob(2, "random translation of each training image by up to N pixels (reflection padding)")
    flip: str = knob(
        "alternating",
        "mirror each image every other epoch, or at random, or never",
        choices=["alternating", "random", "none"],
    )
    tta: int = knob(2, "test-time augmentation: 0 none, 1 mirror, 2 mirror and 1-pixel shifts", choices=[0, 1, 2])
    eval_every: int = knob(
        10,
        "evaluate on the validation split every N epochs, and after the last (the method evaluates once, at the end "
        "of its 10 epochs: each evaluation with --tta 2 is 6 passes over the split)",
    )
    channels_last: bool = knob(True, "channels_last memory format for the model and batches")
    sync_bn: bool = knob(False, "BatchNorm statistics over all processes (SyncBatchNorm) instead of per process")

    def __post_init__(self):
        parse_ints(self.widths, "--widths")  # a malformed list fails here, before any data is read
        if self.lookahead_every < 0:
            raise ConfigError(f"--lookahead-every must be >= 0 (got {self.lookahead_every}); 0 turns the average off.")


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here."""
    return CifarCNN(in_shape, num_classes, widths=parse_ints(cfg.widths, "--widths"), dirac=cfg.dirac_init)


def build_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    return sgd_with_bias_groups(
        model,
        cfg.lr,
        cfg.momentum,
        cfg.weight_decay,
        cfg.bias_lr_scale,
        early_params=[model.whiten.bias],
        early_epochs=cfg.whiten_bias_epochs,
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
    transform = BatchTransform(mean, std, cfg.translate, cfg.flip == "random", channels_last=cfg.channels_last)
    train_loader = run.loader(data.train, train=True, alternating_flip=cfg.flip == "alternating")
    val_loader, final_loader = run.loader(data.val), run.loader(data.test) or run.loader(data.val)

    # --- model ---
    set_seed(cfg.seed)
    model = build_model(cfg, data.shape, data.num_classes)
    if cfg.whiten_init:  # from the same images on every rank, so every rank starts from the same weights
        init_whitening(model.whiten, transform.eval(data.train.images_at(slice(0, 5000))).float())
    model.whiten.weight.requires_grad_(not cfg.whiten_init)  # frozen when whitening, else a plain stem
    if cfg.sync_bn:
        model = convert_sync_batchnorm(model, accelerator.device)
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
    optimizer = build_optimizer(cfg, model)
    model, optimizer, train_loader, val_loader, final_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader, final_loader
    )
    # Schedule length from the prepared loader (per-process batches), so the LR trace is the same on N processes.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
    scheduler = accelerator.prepare(build_scheduler(optimizer, cfg, steps_per_epoch))
    # Before resuming (its state is in the checkpoint); --eval-only scores weights that are the average.
    lookahead = Lookahead(accelerator, model, steps_per_epoch * cfg.epochs, 0 if cfg.eval_only else cfg.lookahead_every)

    def validate(loader):
        return evaluate(accelerator, model, loader, transform, data.num_classes, tta=cfg.tta)

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
            lookahead.step()  # every 5 steps; at the last step the weights become the average
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
