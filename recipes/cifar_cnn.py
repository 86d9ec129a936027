"""CIFAR-10 with a BatchNorm CNN (stem + three conv blocks, global max pool), on 1 to N devices.

Target: 94% test accuracy in 10 epochs (--target-accuracy 0.94 exits 4 if missed; not measured on CIFAR-10 yet).
On an H100 it reaches 99.3% on MNIST digits made CIFAR-shaped in about 6 s (README, Performance).

Techniques, each a flag (on by default; --no-<flag> or 0 turns one off): --whiten-init (stem conv whitens 3x3
patches), --translate 2 --flip (on-device batch augmentation), --label-smoothing 0.2, --warmup-fraction 0.1
--schedule linear, SGD --lr 0.2 --momentum 0.9 (Nesterov) --weight-decay 5e-4 --batch-size 512, --ema-decay
0.99 (evaluate and save a weight average), --tta (average each test image with its mirror), --channels-last;
--sync-bn is off by default.

    # one process (CPU or one GPU)
    accelerate launch recipes/cifar_cnn.py
    # two gloo processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/cifar_cnn.py
    # all GPUs of one machine, bf16
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/cifar_cnn.py
    # resume (the same command starts fresh when there is nothing to resume)
    accelerate launch recipes/cifar_cnn.py --output-dir runs/cifar --resume-from latest
Every knob: python recipes/cifar_cnn.py --help
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from common.augment import BatchTransform, channel_stats
from common.config import DATASET_HELP, CommonConfig, knob, parse_config
from common.ema import WeightEMA
from common.metrics import evaluate
from common.models import CifarCNN, convert_sync_batchnorm, init_whitening, parse_ints
from common.run import TrainingRun
from common.schedule import build_scheduler

RECIPE = "cifar_cnn"


@dataclass
class Config(CommonConfig):
    dataset: str = knob("uoft-cs/cifar10", DATASET_HELP)
    epochs: int = knob(10, "number of passes over the training split")
    batch_size: int = knob(512, "GLOBAL batch size per optimizer step, split over processes and accumulation steps")
    lr: float = knob(0.2, "peak learning rate (SGD, Nesterov momentum)")
    momentum: float = knob(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = knob(5e-4, "SGD weight decay")
    warmup_fraction: float = knob(0.1, "fraction of optimizer steps spent warming the LR up linearly from 0")
    schedule: str = knob("linear", "LR schedule after warm-up", choices=["cosine", "linear", "constant"])
    label_smoothing: float = knob(0.2, "label smoothing for the cross-entropy loss")
    widths: str = knob("64,256,256", "channels of the three conv blocks, comma-separated")
    whiten_init: bool = knob(True, "initialize the stem conv to whiten 3x3 patches of the training images")
    ema_decay: float = knob(0.99, "evaluate and save a weight average with this decay per optimizer step (0 = off)")
    translate: int = knob(2, "random translation of each training image by up to N pixels (reflection padding)")
    flip: bool = knob(True, "random horizontal flip of each training image")
    tta: bool = knob(True, "evaluate on each image and its mirror image and average the logits")
    channels_last: bool = knob(True, "channels_last memory format for the model and batches")
    sync_bn: bool = knob(False, "BatchNorm statistics over all processes (SyncBatchNorm) instead of per process")

    def __post_init__(self):
        parse_ints(self.widths, "--widths")  # a malformed list fails here, before any data is read


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here."""
    return CifarCNN(in_shape, num_classes, widths=parse_ints(cfg.widths, "--widths"))


def build_optimizer(cfg: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                           weight_decay=cfg.weight_decay, foreach=True)


def main(argv=None) -> int:
    cfg = parse_config(Config, argv, __doc__)
    # Sets up the Accelerator and the run directory, calls train(cfg, run), and turns how it ended into an
    # exit code, a one-paragraph error and summary.json's status.
    return TrainingRun(cfg, RECIPE).execute(train)


def train(cfg: Config, run: TrainingRun) -> None:
    accelerator = run.accelerator

    # --- data ---
    data = run.load_data()  # decoded once into uint8 tensors and cached; validation held out of train
    mean, std = channel_stats(data.train)
    transform = BatchTransform(mean, std, translate=cfg.translate, flip=cfg.flip, channels_last=cfg.channels_last)
    train_loader, val_loader = run.loader(data.train, train=True), run.loader(data.val)
    final_loader = run.loader(data.test) or val_loader

    # --- model ---
    set_seed(cfg.seed)
    model = build_model(cfg, data.shape, data.num_classes)
    if cfg.whiten_init:  # from the same images on every rank, so every rank starts from the same weights
        init_whitening(model.features[0], transform.eval(data.train.images_at(slice(0, 5000))))
    if cfg.sync_bn:
        model = convert_sync_batchnorm(model, accelerator.device)
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
    optimizer = build_optimizer(cfg, model, accelerator.device)
    model, optimizer, train_loader, val_loader, final_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader, final_loader)
    # Schedule length from the prepared loader (per-process batches), so the LR trace is the same on N processes.
    scheduler = accelerator.prepare(build_scheduler(optimizer, cfg, math.ceil(len(train_loader) / cfg.grad_accum)))
    # Before resuming (its state is in the checkpoint); --eval-only loads weights that already are the average.
    ema = WeightEMA(accelerator, model, 0 if cfg.eval_only else cfg.ema_decay)

    def validate(loader):  # the weight average when --ema-decay is on (the same model on every rank)
        return evaluate(accelerator, ema.for_eval(model), loader, transform, data.num_classes, tta_flip=cfg.tta)

    if cfg.eval_only:  # score the weights in --checkpoint on the test split (else validation)
        run.load_weights(model)
        return run.report_eval_only(data, validate(final_loader))

    # --- train ---
    run.start(model, optimizer, scheduler, train_loader, data, transform)  # fresh, or resumed exactly
    for epoch in run.epochs():
        model.train()
        for images, labels in run.batches(train_loader):  # resumes mid-epoch where the checkpoint left off
            with accelerator.accumulate(model):
                logits = model(transform.train(images, run.augment_generator()))
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.label_smoothing)
                accelerator.backward(loss)
                run.track_loss(loss)  # summed on the device: no sync
                if accelerator.sync_gradients:
                    # --max-grad-norm clips; the norm is logged either way
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
                    run.guard_step(grad_norm)  # one all-reduce: a NaN loss or a stop signal on any rank stops all
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                if run.step_was_taken():  # False when fp16 loss scaling skipped the step
                    scheduler.step()
                    ema.update(model)
                if run.end_step():  # logs, checkpoints (--checkpoint-every), stops on a signal or --max-steps
                    run.record_eval(validate(val_loader), ema.for_eval(model))  # --eval-every-steps

        # --- eval and checkpoint ---
        if run.eval_due():
            run.record_eval(validate(val_loader), ema.for_eval(model))  # keeps the best --monitor value in best/
        run.end_epoch()

    run.finish(ema.for_eval(model), validate(final_loader))  # final/ weights, summary.json, target check


if __name__ == "__main__":
    sys.exit(main())
