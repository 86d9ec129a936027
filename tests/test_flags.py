"""The command line a recipe offers: flags of the scripts users come from (torchvision's classification reference
script, Accelerate's cv_example) are answered with this recipe's name for them, in one paragraph."""

from __future__ import annotations

import pytest

from helpers import run_in_process


def refused(recipe, args, env, tmp_path) -> str:
    proc = run_in_process(recipe, ["--output-dir", tmp_path / "r", *args], env, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert not (tmp_path / "r").exists()
    return paragraph


@pytest.mark.parametrize(
    "args,answers",
    [
        (
            ["--data-path", "x", "-j", "4", "-b", "32"],  # data and loader; short flags too
            ["--data-path -> --dataset", "-j -> --workers", "-b -> --batch-size (the GLOBAL batch", "-b is per GPU"],
        ),
        (
            [  # the schedule and optimizer
                "--lr-warmup-epochs",
                "2",
                "--lr-warmup-decay",
                "0.01",
                "--lr-scheduler",
                "cosineannealinglr",
                "--wd",
                "1e-4",
                "--lr-min",
                "0",
                "--clip-grad-norm",
                "1",
            ],
            [
                "--lr-warmup-epochs -> --warmup-fraction",
                "--lr-warmup-decay -> --warmup-start",
                "--lr-scheduler -> --schedule",
                "--wd -> --weight-decay",
                "--lr-min -> --final-lr",
                "--clip-grad-norm -> --max-grad-norm",
            ],
        ),
        (
            [  # augmentation, EMA
                "--mixup-alpha",
                "0.2",
                "--cutmix-alpha=1.0",
                "--model-ema",
                "--train-crop-size",
                "176",
            ],
            [
                "--mixup-alpha -> --mixup",
                "--cutmix-alpha -> --cutmix",
                "--model-ema -> --ema-decay",
                "--train-crop-size -> --image-size",
            ],
        ),
        (
            ["--resume", "ckpt.pth", "--test-only", "--print-freq", "10"],  # checkpoints and evaluation
            ["--resume -> --resume-from", "--test-only -> --eval-only --checkpoint", "--print-freq -> --log-every"],
        ),
        (
            ["--amp", "--cpu", "--world-size", "2", "--device", "cuda"],  # the launcher's
            [
                "--amp -> a launcher setting here: `accelerate launch --mixed_precision bf16",
                "--cpu -> a launcher setting here: `accelerate launch --cpu",
                "--world-size -> a launcher setting here: `accelerate launch --num_processes N",
                "--device -> a launcher setting here",
            ],
        ),
        (
            ["--data_dir", "x", "--project_dir", "runs", "--num_epochs", "3"],  # Accelerate's cv_example
            ["--data_dir -> --dataset", "--project_dir -> --output-dir", "--num_epochs -> --epochs"],
        ),
    ],
)
def test_flags_of_torchvisions_reference_script_and_cv_example_get_this_recipes_name(args, answers, tmp_path, env):
    paragraph = refused("finetune_folder", args, env, tmp_path)
    for answer in answers:
        assert answer in paragraph, paragraph


def test_a_flag_whose_counterpart_is_another_recipes_says_so(tmp_path, env):
    """mnist_convnet keeps its decoded data in memory: it has no loader workers and no MixUp."""
    paragraph = refused("mnist_convnet", ["-j", "4", "--mixup-alpha", "0.2", "--data-path", "x"], env, tmp_path)
    for answer in (
        "-j -> none in this recipe (--workers is finetune_folder's)",
        "--mixup-alpha -> none in this recipe (--mixup is finetune_folder's)",
        "--data-path -> --dataset",
    ):
        assert answer in paragraph, paragraph


# What each recipe leaves unread of the settings every recipe has: the three others read them all (common.data.decoded's
# decoded-image loading reads --channels, --data-on-device and --cache-dir); the photo recipe decodes photos per
# batch on the host, always as RGB.
UNREAD = {
    "fashion_mnist_mlp": set(),
    "mnist_convnet": set(),
    "cifar_cnn": set(),
    "finetune_folder": {"channels", "data_on_device"},
}


@pytest.mark.parametrize("recipe", sorted(UNREAD))
def test_help_lists_only_what_the_recipe_reads_and_an_unread_setting_is_refused(recipe, tmp_path, env):
    import dataclasses
    import re

    from helpers import import_recipe

    proc = run_in_process(recipe, ["--help"], env)
    assert proc.returncode == 0, proc.stderr
    listed = set(re.findall(r"^  (--[a-z0-9-]+)", proc.stdout, re.MULTILINE))
    fields = {f.name for f in dataclasses.fields(import_recipe(recipe).Config)}
    assert listed == {"--" + name.replace("_", "-") for name in fields - UNREAD[recipe]} | {"--config"}, listed
    if recipe == "finetune_folder":  # its cache holds no decoded tensors
        text = " ".join(proc.stdout.split())
        assert "decoded uint8 tensors" not in text and "photos were all readable" in text, text
    for name in UNREAD[recipe]:
        flag = "--" + name.replace("_", "-")
        for given in ([flag, "3"] if name == "channels" else [flag]), ["--" + name, "1"], ["--no-" + flag[2:]]:
            paragraph = refused(recipe, given, env, tmp_path)
            assert f"{recipe}.py does not read {given[0]}: photos are decoded per batch on the host" in paragraph
