"""Fine-tune (or train from scratch) a torchvision, timm or transformers model on a folder of your own photos, or a
Hugging Face image dataset, on 1 to N devices (FSDP version 2 on GPUs for models too large for one).

Photos of any size and mode are decoded per batch in DataLoader workers: random resized crops and flips for
training, the shorter side resized and the centre cropped for evaluation and predict. From scratch the training
crops grow from half of --image-size to it (progressive resizing). --model: a torchvision or timm name, or a folder
holding a timm or transformers model; --weights: DEFAULT (the library's pretrained weights) or a state_dict file.
Folder rules and models: docs/data.md; measured accuracy and wall time: docs/results.md.

    accelerate launch recipes/finetune_folder.py --dataset ~/photos                     # ResNet-18 from scratch
    accelerate launch recipes/finetune_folder.py --dataset ~/photos --weights DEFAULT   # pretrained (downloads)
    accelerate launch recipes/finetune_folder.py --dataset beans        # a Hub image dataset (or its clone, parquet)
    accelerate launch recipes/finetune_folder.py --dataset ~/photos --model timm/resnet10t.c3_in1k --weights DEFAULT
    accelerate launch recipes/finetune_folder.py --dataset ~/photos --model convnext_tiny.fb_in1k --weights DEFAULT \\
        --layer-decay 0.75 --drop-path 0.1            # timm's fine-tuning regularisers; best/ opens in timm itself
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/finetune_folder.py \\
        --dataset ~/photos --workers 8 --output-dir runs/photos --resume-from latest
Every knob: python recipes/finetune_folder.py --help
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from common.api import (
    EMA,
    BatchTransform,
    CommonConfig,
    ConfigError,
    LRRule,
    TrainingRun,
    batch_mix,
    build_scheduler,
    evaluate,
    knob,
    load_photos,
    mixed,
    param_groups,
    parse_config,
    photo_stats,
    say,
    vision,
)


@dataclass
class Config(CommonConfig):
    # --- yours to change: the defaults of a run ---
    dataset: str = knob(
        "",
        "a folder of photos (<dir>/<class>/<image>, optionally under train/ val/ test/), or a "
        "Hugging Face image dataset: a Hub id, a local clone, parquet files (docs/data.md)",
    )
    model: str = knob(
        "resnet18",
        "a torchvision classification model (resnet50, convnext_tiny, efficientnet_b0, mobilenet_v3_large, vit_b_16, "
        "...); a timm model (resnet50d, mobilenetv4_conv_small, with a pretrained tag resnet10t.c3_in1k or "
        "timm/resnet10t.c3_in1k, a Hub repo hf-hub:org/name; timm/resnet50 is timm's resnet50); or a folder holding "
        "a timm or transformers (AutoModelForImageClassification) model: config.json and model.safetensors, "
        "started from those weights unless --weights says otherwise",
    )
    weights: str = knob(
        "",
        "start from: '' (scratch), DEFAULT (the model's pretrained weights: torchvision's, timm's from the Hugging "
        "Face cache or Hub, a model folder's own), or a .pth/.safetensors state_dict file or a folder holding "
        "model.safetensors; heads of another shape are skipped",
    )
    image_size: int = knob(
        128,
        "crop side in pixels: of evaluation, predict and the last training epochs (with "
        "--weights, the weights' own unless given)",
    )
    start_image_size: int = knob(
        64,
        "progressive resizing: the first epoch trains on crops of this side, growing "
        "linearly (in steps of 16 px) to --image-size at the last (when not given: half of "
        "--image-size from scratch, off with --weights; 0 = off)",
    )
    epochs: int = 32
    eval_every: int = knob(4, "evaluate on the validation split every N epochs (and after the last)")
    batch_size: int = 128
    lr: float = knob(0.2, "peak learning rate of the head (SGD, Nesterov)")
    lr_rule = LRRule("linear", 128)
    shards = True  # takes the launcher's FSDP version 2 answer on GPUs (a plain class attribute, as lr_rule)
    backbone_lr_scale: float = knob(0.1, "with --weights, the backbone learns at this times --lr (from scratch: 1)")
    momentum: float = knob(0.9, "SGD momentum (Nesterov)")
    weight_decay: float = knob(5e-4, "SGD weight decay, on weight matrices and kernels only: not on norms, biases")
    layer_decay: float = knob(
        0.0,
        "layer-wise LR decay of a timm model: each layer below the head learns at this times the one above "
        "(timm's --layer-decay, e.g. 0.75; replaces --backbone-lr-scale; 0 = off)",
    )
    drop_path: float = knob(
        -1.0,
        "drop rate of the residual branches (stochastic depth: timm's --drop-path, torchvision's "
        "stochastic_depth_prob, e.g. 0.1; -1 = the model's own: none for timm, 0.1 for torchvision's convnext_tiny)",
    )
    warmup_fraction: float = knob(0.1, "fraction of optimizer steps spent warming the LR up linearly")
    label_smoothing: float = 0.1
    min_crop_scale: float = knob(0.25, "smallest area share of a random resized crop (torchvision's default: 0.08)")
    auto_augment: bool = knob(False, "TrivialAugmentWide on each training photo (torchvision's --auto-augment ta_wide)")
    random_erase: float = knob(
        0.0, "probability of erasing a random rectangle of each training photo (torchvision's --random-erase; 0 = off)"
    )
    mixup: float = knob(0.0, "MixUp alpha (torchvision.transforms.v2.MixUp; 0 = off)")
    cutmix: float = knob(0.0, "CutMix alpha (torchvision.transforms.v2.CutMix; 0 = off; with --mixup, one per batch)")
    tta: int = knob(
        0,
        "test-time augmentation: 0 none, 1 the mean of the photo's and its mirror image's logits "
        "(evaluation, predict and export alike)",
        choices=[0, 1],
    )
    ema_decay: float = knob(
        0.0,
        "keep an exponential moving average of the weights (torch.optim.swa_utils) with "
        "this decay per step, evaluated and saved instead of the weights (0 = off)",
    )
    workers: int = knob(
        -1,
        "DataLoader worker processes per process decoding photos (-1 = its share of the CPU "
        "cores less one, at most 8: none on a 2-core machine running 2 processes)",
    )
    channels_last: bool = knob(True, "channels_last memory format for the model and batches")
    max_damaged: float = knob(
        0.01,
        "a damaged photo is skipped with a warning naming it; more than this share of the photos a process reads "
        "damaged stops the run, naming them (0 = stop at the first)",
    )
    cache_dir: str = knob("", "where a local table dataset's Arrow copy is kept ('' = ~/.cache/accelerate-recipes)")
    # settings every recipe has that this one does not read: left out of --help, refused when given (a plain class
    # attribute, as lr_rule: not a setting)
    not_read = {
        "channels": "photos are decoded per batch on the host, always as RGB",
        "data_on_device": "photos are decoded per batch on the host and never kept decoded",
    }

    def __post_init__(self):
        if not 0 <= self.max_damaged <= 1:
            raise ConfigError(f"--max-damaged is a share of the photos, from 0 to 1 (got {self.max_damaged}).")
        if not 0 <= self.layer_decay < 1 or not (self.drop_path == -1 or 0 <= self.drop_path < 1):
            raise ConfigError(
                f"--layer-decay must be in [0, 1) (got {self.layer_decay}) and --drop-path in [0, 1), or -1 for the "
                f"model's own (got {self.drop_path})."
            )
        if self.start_image_size < 0:
            raise ConfigError(
                f"--start-image-size must be >= 0 (got {self.start_image_size}); 0 trains every epoch at --image-size."
            )

    def settle(self):
        folder = vision.model_folder(self.model)  # absolute: predict and export rebuild the model from it
        if folder is not None:
            self.model = str(folder)
            if "weights" not in self.explicit:  # a model folder holds its weights: the start, unless --weights ''
                self.weights = "DEFAULT"
        if "image_size" not in self.explicit:  # pretrained weights: their own crop (224 for torchvision's ImageNet)
            self.image_size = vision.resolve(self.model, self.weights).crop or self.image_size
        if "start_image_size" not in self.explicit:  # pretrained weights: at their own size throughout
            self.start_image_size = 0 if self.weights else self.image_size // 2
        vision.check_regularisers(self.model, drop_path(self), self.layer_decay)  # a model without them: refused


def drop_path(cfg: Config) -> float | None:
    return None if cfg.drop_path < 0 else cfg.drop_path


def crop_side(cfg: Config, epoch: int) -> int:
    """The side of this epoch's training crops: progressive resizing from --start-image-size to --image-size (low
    resolution first, as FFCV's and fast.ai's ImageNet speed runs do: the early epochs cost less)."""
    start = cfg.start_image_size or cfg.image_size
    if epoch >= cfg.epochs - 1 or start >= cfg.image_size:
        return cfg.image_size
    side = start + (cfg.image_size - start) * epoch / max(1, cfg.epochs - 1)
    return min(cfg.image_size, 16 * round(side / 16))


def train_view(cfg: Config, mean: list[float], side: int):
    """Each training photo's augmentation: uint8 (3, H, W) in, (3, side, side) out (``crop_side``), run in the
    loader's workers with its draws seeded per image (exact resume). Yours to change: any torchvision v2 transform."""
    from torchvision.transforms import v2

    steps = [v2.RandomResizedCrop(side, scale=(cfg.min_crop_scale, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    if cfg.auto_augment:
        steps.append(v2.TrivialAugmentWide())
    if cfg.random_erase:  # filled with the mean colour, as erasing after normalisation fills with 0
        steps.append(v2.RandomErasing(cfg.random_erase, value=[round(255 * m) for m in mean]))
    return v2.Compose(steps)


def build_model(cfg: Config, in_shape, num_classes: int) -> torch.nn.Module:
    """The model this recipe trains; predict, export and --eval-only rebuild it from here (weights from files)."""
    return vision.build(cfg.model, num_classes, in_shape[-1], drop_path(cfg))


def build_optimizer(cfg: Config, model: torch.nn.Module, num_classes: int, fused: bool = True) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, no weight decay on norms and biases; ``fused``: one kernel per step, which masks a
    NaN step on the device (no wait for it); torch's sharded parameters (FSDP2) take the unfused one only."""
    scale = cfg.backbone_lr_scale if cfg.weights else 1.0
    return torch.optim.SGD(
        param_groups(model, num_classes, cfg.lr, scale, cfg.weight_decay, cfg.layer_decay),
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=True,
        weight_decay=cfg.weight_decay,
        fused=fused,
    )


def main(argv=None) -> int:
    cfg = parse_config(Config, argv, __doc__)  # the command line (and --config FILE)
    # + the launcher's answers and a resume's settings; the Accelerator; runs/<file name>-<time>/
    with TrainingRun(cfg, __file__) as run:
        train(cfg, run)
    return run.exit_code  # how it ended (summary.json says it too)


def train(cfg: Config, run: TrainingRun) -> None:
    accelerator = run.accelerator
    pretrained = vision.resolve(cfg.model, cfg.weights)  # the weights' normalisation (their crop: Config.settle)
    if cfg.weights and not cfg.eval_only and not run.resuming:  # before the data: offline or missing fails at once
        vision.fetch(cfg.model, cfg.weights)
    # --- data ---
    data = run.load_data(load_photos)  # file lists; decoded per batch in the loader's workers
    # the weights' own normalisation, else the photos' (--eval-only: the scored run's)
    mean, std = run.normalisation(
        lambda: (pretrained.mean, pretrained.std) if pretrained.mean else photo_stats(data.train)
    )
    transform = BatchTransform(mean, std, channels_last=cfg.channels_last)  # normalises on the device
    train_loader = run.loader(
        data.train,
        train=True,
        train_view=partial(train_view, cfg, mean),  # per epoch
        sides=partial(crop_side, cfg),
    )
    val_loader = run.loader(data.val)
    final_loader = run.loader(data.test) or val_loader

    # --- model ---
    set_seed(cfg.seed)
    model = build_model(cfg, data.shape, data.num_classes)
    if cfg.weights and not cfg.eval_only and not run.resuming:  # a resume takes every weight from its checkpoint
        say(vision.load_pretrained(model, cfg.weights, cfg.model, data.num_classes, cfg.image_size))
    if cfg.channels_last and not accelerator.is_fsdp2:  # FSDP2 shards contiguous weights only (batches still are)
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(cfg, model, data.num_classes, fused=not accelerator.is_fsdp2)
    model, optimizer, train_loader, val_loader, final_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader, final_loader
    )
    scheduler = accelerator.prepare(build_scheduler(optimizer, cfg, math.ceil(len(train_loader) / cfg.grad_accum)))
    ema = EMA(accelerator, model, cfg.ema_decay)  # a no-op when off; in every checkpoint when on
    mix = batch_mix(cfg.mixup, cfg.cutmix, data.num_classes)  # None when both are off
    scored = ema.module if ema.module is not None else model  # the weights that are evaluated and saved

    def validate(loader):
        ema.sync()  # the average is one model on every rank (rank 0's BatchNorm statistics), the one saved
        return evaluate(accelerator, scored, loader, transform, data.num_classes, tta=cfg.tta)

    if cfg.eval_only:  # score the weights in --checkpoint on the test split (else validation)
        return run.eval_only(scored, validate, final_loader)

    # --- train: the loop is yours; each line says when, each run.<call> says how (docs/loop.md) ---
    run.start(model, optimizer, scheduler, train_loader, data, transform, scored=scored)  # or resume exactly
    last_step = cfg.max_steps or math.inf  # --max-steps: this launch stops there
    for epoch in range(run.epoch, cfg.epochs):
        if run.step >= last_step or run.no_improvement():  # --max-steps; --patience
            break
        model.train()
        for images, labels in run.batches(train_loader, epoch):  # a resumed epoch skips ahead
            with accelerator.accumulate(model):
                x = transform.train(images, run.augment_generator())  # normalised (train_view ran in the workers)
                if mix is not None:  # MixUp / CutMix: mixed images, soft targets
                    x, labels = mixed(mix, x, labels, run.augment_generator())
                logits = model(x)
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
            ema.update()
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
