"""The checks every recipe's settings pass, on the command line and when read back from a run's files: values
that would crash later or train silently wrong are refused with the fix. A recipe checks its own knobs in its
Config's ``__post_init__``."""

from __future__ import annotations

from common.errors import ConfigError

# what evaluation produces, and which way is better (top-5 accuracy: with more than TOP_K classes)
MONITOR_MODES = {"eval/accuracy": "max", "eval/loss": "min", "eval/top5_accuracy": "max"}


def check(cfg) -> None:
    """Reject values that would crash later or train silently wrong."""

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    need(cfg.epochs >= 1, f"--epochs must be at least 1 (got {cfg.epochs}); pass e.g. --epochs 2.")
    need(cfg.lr > 0, f"--lr must be positive (got {cfg.lr}); pass e.g. --lr 1e-3.")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0 (got {cfg.weight_decay}).")
    need(cfg.batch_size >= 1, f"--batch-size must be at least 1 (got {cfg.batch_size}).")
    need(cfg.eval_batch_size >= 1, f"--eval-batch-size must be at least 1 (got {cfg.eval_batch_size}).")
    need(cfg.grad_accum >= 1, f"--grad-accum must be at least 1 (got {cfg.grad_accum}).")
    need(0 <= cfg.val_fraction < 1, f"--val-fraction must be in [0, 1) (got {cfg.val_fraction}).")
    need(0 <= cfg.warmup_fraction < 1, f"--warmup-fraction must be in [0, 1) (got {cfg.warmup_fraction}).")
    need(
        0 <= cfg.warmup_start <= 1 and 0 <= cfg.final_lr <= 1,
        f"--warmup-start and --final-lr are fractions of --lr in [0, 1] (got {cfg.warmup_start} and {cfg.final_lr}).",
    )
    need(
        0 <= cfg.label_smoothing < 1,
        f"--label-smoothing must be in [0, 1) (got {cfg.label_smoothing}).",
    )
    need(cfg.eval_every_steps >= 0, f"--eval-every-steps must be >= 0 (got {cfg.eval_every_steps}); 0 turns it off.")
    need(cfg.progress_every_s >= 0, f"--progress-every-s must be >= 0 (got {cfg.progress_every_s}).")
    need(cfg.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (got {cfg.max_grad_norm}); 0 turns clipping off.")
    need(cfg.channels in (0, 1, 3), f"--channels must be 0 (keep), 1 or 3 (got {cfg.channels}).")
    need(cfg.image_size >= 0, f"--image-size must be >= 0 (got {cfg.image_size}); 0 keeps the data's size.")
    need(cfg.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1 (got {cfg.keep_checkpoints}).")
    need(cfg.log_every >= 1, f"--log-every must be at least 1 (got {cfg.log_every}).")
    need(cfg.eval_every >= 1, f"--eval-every must be at least 1 (got {cfg.eval_every}).")
    need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 (got {cfg.checkpoint_every}).")
    need(
        cfg.checkpoint_every_s >= 0,
        f"--checkpoint-every-s must be >= 0 (got {cfg.checkpoint_every_s}); 0 turns it off.",
    )
    need(cfg.max_steps >= 0, f"--max-steps must be >= 0 (got {cfg.max_steps}).")
    need(cfg.patience >= 0, f"--patience takes a number of evaluations, >= 0 (got {cfg.patience}); 0 turns it off.")
    need(
        0 <= cfg.target_accuracy <= 1,
        f"--target-accuracy is a fraction in [0, 1] (got {cfg.target_accuracy}); pass e.g. 0.99 for 99%.",
    )
    need(cfg.profile >= 0, f"--profile takes a number of optimizer steps to record, >= 0 (got {cfg.profile}).")
    need(cfg.timeout_s >= 10, f"--timeout-s must be at least 10 seconds (got {cfg.timeout_s}).")
    need(
        not (cfg.eval_only and not cfg.checkpoint),
        "--eval-only needs --checkpoint <run or checkpoint directory> naming the weights to evaluate.",
    )
    if cfg.mode == "auto":  # loss: lower is better; accuracy: higher
        cfg.mode = MONITOR_MODES[cfg.monitor]
    need(
        not (cfg.resume_from and cfg.eval_only),
        "--resume-from and --eval-only can't be combined; use --checkpoint to pick the weights to evaluate.",
    )


def check_received(cfg, where: str) -> None:
    """After settings were taken from a run's files (a resume, --eval-only): the same checks as the command line's,
    said as the file's fault."""
    try:
        check(cfg)
    except ConfigError as err:
        raise ConfigError(
            f"The settings recorded in {where} are not valid: {err} The file was changed or damaged "
            "since the run wrote it; start a new run with a new --output-dir, or restore the file."
        ) from None
