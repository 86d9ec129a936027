"""The command line a recipe offers: a flag it lacks is answered in one paragraph with this repository's name for it
(another script's flag, from docs/flags.md's tables), its closest flags or the recipe that has it; --help lists what
the recipe reads."""

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
    "recipe,args,answers",
    [
        ("finetune_folder", ["--epoch", "3"], ["--epoch: did you mean --epochs?"]),
        ("mnist_convnet", ["--batchsize", "8"], ["--batchsize: did you mean --batch-size"]),
        (
            "cifar_cnn",
            ["--weight_decays", "1e-4", "--lable-smoothing=0.1"],
            ["did you mean --weight-decay", "--lable-smoothing: did you mean --label-smoothing?"],
        ),
        (
            "mnist_convnet",
            ["--mixup", "0.2", "--workers", "4"],
            ["--mixup is a knob of finetune_folder, not of this recipe", "--workers is a knob of finetune_folder"],
        ),
        (
            "finetune_folder",
            ["--data-path", "x", "-j", "4"],
            [
                "--data-path is torchvision's classification reference script's flag; here: --dataset",
                "-j is torchvision's classification reference script's flag; here: --workers",
            ],
        ),
        ("mnist_convnet", ["--learning_rate", "0.1"], ["--learning_rate is Hugging Face's Trainer's flag; here: --lr"]),
        ("mnist_convnet", ["--model-ema"], ["here: --ema-decay (the decay per optimizer step; 0 = off) (a knob of"]),
        (
            "finetune_folder",
            ["--reprob", "0.25", "--clip-grad", "1"],
            [
                "--reprob is timm's training script's flag; here: --random-erase (the probability per training photo)",
                "--clip-grad is timm's training script's flag; here: --max-grad-norm",
            ],
        ),
        ("cifar_cnn", ["--drop-path", "0.1"], ["here: --drop-path (a knob of finetune_folder)"]),
    ],
)
def test_a_flag_the_recipe_lacks_gets_its_closest_flags_and_the_recipe_that_has_it(
    recipe, args, answers, tmp_path, env
):
    """One paragraph, without argparse's usage block: "unrecognized arguments", then for each flag its name here when
    it is another script's (read from docs/flags.md's tables), else the closest flags by spelling or the recipe whose
    knob it is, and where other scripts' flags are given their names here (docs/flags.md) when one was not named."""
    from common.flag_hints import other_scripts_flags

    paragraph = refused(recipe, args, env, tmp_path)
    table = other_scripts_flags()
    pointer = [] if all(a in table for a in args if a.startswith("-")) else ["their names here: docs/flags.md"]
    for answer in [*answers, *pointer]:
        assert answer in paragraph, paragraph
    proc = run_in_process(recipe, ["--output-dir", tmp_path / "r", *args], env, cwd=tmp_path)
    assert proc.stderr.strip() == paragraph, proc.stderr  # no usage block above it


def test_the_flags_page_names_only_flags_a_recipe_has():
    """docs/flags.md: every flag its 'here' column names is a flag of a recipe (or the launcher's)."""
    import dataclasses
    import re

    from helpers import REPO, import_recipe

    have = {
        "--" + f.name.replace("_", "-")
        for recipe in ("fashion_mnist_mlp", "mnist_convnet", "cifar_cnn", "finetune_folder")
        for f in dataclasses.fields(import_recipe(recipe).Config)
    }
    rows = re.findall(r"^\| `[^`]+` \| (.*) \|$", (REPO / "docs" / "flags.md").read_text(), re.M)
    assert len(rows) >= 40
    named = {flag for row in rows if not row.startswith("the launcher's") for flag in re.findall(r"`(--[a-z-]+)", row)}
    assert named and named <= have, named - have


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
        assert "decoded uint8 tensors" not in text and "table dataset's Arrow copy" in text, text
    for name in UNREAD[recipe]:
        flag = "--" + name.replace("_", "-")
        for given in ([flag, "3"] if name == "channels" else [flag]), ["--" + name, "1"], ["--no-" + flag[2:]]:
            paragraph = refused(recipe, given, env, tmp_path)
            assert f"{recipe}.py does not read {given[0]}: photos are decoded per batch on the host" in paragraph
