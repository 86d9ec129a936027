"""The photo recipe (recipes/finetune_folder.py) on a tiny folder of photos of mixed sizes and modes: it trains,
resumes exactly (also with decoding moved into a worker process), predicts and exports photos of any size, scores
--eval-only, starts from a weights file with another head, and follows the LR rule. The reference runs of conftest
(1 process in this process, 2 real gloo processes) are shared with the pinned-loss test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from common import vision
from common.errors import ConfigError

from helpers import check_ok, copy_recipe, read_jsonl, run_in_process, stopped_at


def test_trains_on_photos_of_any_size_and_mode_at_1_and_2_processes(reference_run):
    for nproc in (1, 2):
        ref = reference_run("finetune_folder", nproc)
        summary = json.loads((ref.run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["processes"] == nproc
        assert summary["final"]["test/count"] == 24  # every test photo counted once, at 2 processes too
        assert f"processes={nproc}" in ref.proc.stdout and "train=162 val=18 test=24" in ref.proc.stdout
    card = json.loads((ref.run / "final" / "model.json").read_text())
    assert card["preprocess"] == {"resize_shorter": 37, "center_crop": 32} and card["input_shape"] == [3, 32, 32]
    assert card["class_names"] == ["ant", "bee", "wasp"]


def test_resumes_exactly_with_decoding_in_a_worker_process(reference_run, tmp_path, env):
    """Stopped at step 3 (of 20), resumed with --workers 1 instead of 0: the same per-step losses and weights,
    bit for bit: each photo's crop and flip are drawn from (seed, epoch, image), not from the process's RNG."""
    ref = reference_run("finetune_folder", 1)
    run = stopped_at(ref.run, 3, tmp_path / "run")
    args = [*ref.train_args, "--output-dir", run, "--resume-from", "latest"]
    args[args.index("--workers") + 1] = "1"
    proc = check_ok(run_in_process("finetune_folder", args, env))
    assert "resumed from" in proc.stdout
    losses = lambda r: [(x["step"], x["train/loss"]) for x in read_jsonl(r / "metrics.jsonl") if "train/loss" in x]
    assert losses(run) == losses(ref.run)
    a, b = load_file(str(run / "final" / "model.safetensors")), load_file(str(ref.run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def crop_of(side):
    """A module-level transform (worker processes may import it): a seeded random crop to ``side``."""
    from torchvision.transforms import v2

    return v2.RandomResizedCrop(side, antialias=True)


def test_training_workers_kept_across_epochs_draw_each_epochs_crops_at_its_side(tmp_path):
    """The training loader's workers persist across epochs (no start-up every epoch), yet each epoch's crops and
    crop side (progressive resizing) are the epoch's: a persistent worker reads the epoch the main process set, and
    hands out exactly what decoding in the main process gives, epoch after epoch."""
    from common.data.photos import PhotoDataset, PhotoSplit

    from helpers import write_photo_folder

    files = sorted(str(p) for p in write_photo_folder(tmp_path / "d", 4).rglob("*.*"))
    split = PhotoSplit(files, torch.zeros(len(files), dtype=torch.int64), 24)
    sides = lambda epoch: (16, 20, 24)[epoch]  # noqa: E731

    def epochs(workers):
        data = PhotoDataset(split, seed=5, train_view=crop_of, sides=sides)
        loader = torch.utils.data.DataLoader(
            data, batch_size=4, num_workers=workers, persistent_workers=workers > 0, collate_fn=lambda b: b
        )
        out = []
        for epoch in range(3):
            data.set_epoch(epoch)
            out.append(torch.stack([image for batch in loader for image, _, _ in batch]))
        return out, getattr(loader, "_iterator", None)

    inline, _ = epochs(0)
    kept, iterator = epochs(1)
    assert iterator is not None and iterator._persistent_workers  # one set of workers served all three epochs
    assert [tuple(x.shape[-2:]) for x in kept] == [(16, 16), (20, 20), (24, 24)]
    assert all(torch.equal(a, b) for a, b in zip(inline, kept))
    assert not torch.equal(kept[0][:, :, :16, :16], kept[1][:, :, :16, :16])  # each epoch draws its own crops


def test_predict_export_and_eval_only_take_photos_of_any_size(reference_run, tmp_path, env, capsys):
    from common.tools import export, predict

    ref = reference_run("finetune_folder", 1)
    photos = tmp_path / "new"
    photos.mkdir()
    Image.new("RGB", (300, 120), (200, 30, 30)).save(photos / "wide.jpg")
    Image.new("L", (50, 140), 90).save(photos / "tall_grey.png")
    Image.new("RGBA", (64, 64), (0, 0, 255, 128)).save(photos / "rgba.png")
    assert predict.main([str(ref.run / "final"), str(photos), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)["results"]
    assert len(results) == 3 and "were resized" not in err
    assert all(r["predictions"][0]["label"] in ("ant", "bee", "wasp") for r in results)
    # predict's view of a photo is the run's evaluation view: the shorter side resized, the centre cropped
    from common.data.photos import eval_view
    from common.data.pixels import read_rgb

    view, _ = predict.load_image(photos / "wide.jpg", (3, 32, 32), {"resize_shorter": 37, "center_crop": 32})
    assert torch.equal(view, eval_view(read_rgb(str(photos / "wide.jpg"), 37), 32))
    # a photo far larger than the crop: training and evaluation decode it at 1/8 scale (JPEG draft); predict too
    big = np.random.default_rng(0).integers(0, 255, (600, 800, 3), dtype=np.uint8)
    Image.fromarray(big).resize((800, 600)).save(tmp_path / "big.jpg", quality=90)
    view, _ = predict.load_image(tmp_path / "big.jpg", (3, 32, 32), {"resize_shorter": 37, "center_crop": 32})
    assert torch.equal(view, eval_view(read_rgb(str(tmp_path / "big.jpg"), 37), 32))
    assert export.main([str(ref.run / "final"), "--onnx", str(tmp_path / "m.onnx")]) == 0  # checked against torch
    out, _ = capsys.readouterr()
    assert "resize the shorter side to 37" in out
    ev = check_ok(run_in_process("finetune_folder", ["--eval-only", "--checkpoint", ref.run / "final"], env))
    assert "eval-only: test accuracy" in ev.stdout
    assert json.loads((ref.run / "final" / "eval-test.json").read_text())["count"] == 24


def test_a_weights_file_with_a_1000_class_head_loads_into_a_3_class_model(tmp_path, photos_like, env):
    import torchvision

    imagenet_like = torchvision.models.resnet18(num_classes=1000)
    torch.save(imagenet_like.state_dict(), tmp_path / "resnet18.pth")
    model = vision.build("resnet18", 3)
    line = vision.load_pretrained(model, str(tmp_path / "resnet18.pth"), "resnet18", 3)
    assert "skipped the head of another shape" in line and "fc.weight (1000, 512) -> (3, 512)" in line
    assert torch.equal(model.conv1.weight, imagenet_like.conv1.weight)
    assert model.fc.weight.shape == (3, 512)
    # through the recipe: the backbone learns at --backbone-lr-scale x the head's LR, the weights' own crop
    proc = check_ok(
        run_in_process(
            "finetune_folder",
            [
                "--dataset",
                photos_like,
                "--weights",
                tmp_path / "resnet18.pth",
                "--max-steps",
                1,
                "--batch-size",
                16,
                "--workers",
                0,
                "--output-dir",
                tmp_path / "run",
            ],
            env,
        )
    )
    assert "skipped the head of another shape" in proc.stdout and "train=162" in proc.stdout
    assert json.loads((tmp_path / "run" / "final" / "model.json").read_text())["input_shape"] == [3, 224, 224]


def test_weights_that_do_not_fit_or_cannot_be_fetched_are_one_paragraph(tmp_path, monkeypatch):
    torch.save(vision.build("mobilenet_v3_small", 1000).state_dict(), tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="don't fit --model resnet18"):
        vision.load_pretrained(vision.build("resnet18", 3), str(tmp_path / "other.pth"), "resnet18", 3)
    (tmp_path / "junk.pth").write_bytes(b"not a state dict")
    with pytest.raises(ConfigError, match="Could not read the weights file"):
        vision.load_pretrained(vision.build("resnet18", 3), str(tmp_path / "junk.pth"), "resnet18", 3)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):  # nothing listens there: offline
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    import urllib.request

    # urllib builds its default opener (and reads the proxies) once: this test's goes when the test ends
    monkeypatch.setattr(urllib.request, "_opener", None)
    with pytest.raises(ConfigError, match="probably offline") as err:
        vision.load_pretrained(vision.build("resnet18", 3), "DEFAULT", "resnet18", 3)
    assert "resnet18-f37072fd.pth" in str(err.value) and "--weights /path/to/" in str(err.value)
    with pytest.raises(ConfigError, match="neither a torchvision classification model nor a timm model"):
        vision.build("resnet_18", 3)


def test_a_changed_batch_scales_the_lr_linearly(tmp_path, photos_like, env):
    proc = check_ok(
        run_in_process(
            "finetune_folder",
            [
                "--dataset",
                photos_like,
                "--batch-size",
                16,
                "--image-size",
                32,
                "--max-steps",
                1,
                "--workers",
                0,
                "--output-dir",
                tmp_path / "run",
            ],
            env,
        )
    )
    assert "lr=0.025 (0.2 x 16/128, linear rule)" in proc.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == pytest.approx(0.025)


def test_mixup_cutmix_and_ema_train_and_the_ema_is_what_is_saved(tmp_path, photos_like, env):
    """torchvision's MixUp/CutMix and torch's AveragedModel through the recipe: the weights saved in final/ are the
    average's (not the live model's), and it is in the checkpoint (a resume restores it)."""
    run = tmp_path / "run"
    args = [
        "--dataset",
        photos_like,
        "--image-size",
        32,
        "--batch-size",
        16,
        "--epochs",
        1,
        "--workers",
        0,
        "--mixup",
        0.2,
        "--cutmix",
        1.0,
        "--ema-decay",
        0.5,
        "--output-dir",
        run,
    ]
    check_ok(run_in_process("finetune_folder", args, env))
    final = load_file(str(run / "final" / "model.safetensors"))
    checkpoint = next((run / "checkpoints").glob("step-*"))
    live, averaged = load_file(str(checkpoint / "model.safetensors")), load_file(str(checkpoint / "ema.safetensors"))
    assert not torch.equal(final["conv1.weight"], live["conv1.weight"])  # the average, not the live weights
    assert torch.equal(averaged["module.conv1.weight"], final["conv1.weight"])
    assert not list(checkpoint.glob("custom_checkpoint_*"))  # no pickle
    resumed = check_ok(
        run_in_process(
            "finetune_folder", [*args[:-2], "--epochs", 2, "--output-dir", run, "--resume-from", "latest"], env
        )
    )
    assert "resumed from" in resumed.stdout


def test_the_recipes_own_augmentation_trains_and_resumes_exactly(tmp_path, photos_like, env):
    """--auto-augment (TrivialAugmentWide) and --random-erase run in the recipe's train_view, in the loader's workers:
    they change what trains (other losses than the plain crop and flip), and a run stopped at step 3 and resumed with
    a worker process instead of none draws the same pixels (same losses and weights, bit for bit)."""
    base = [
        "--dataset",
        photos_like,
        "--image-size",
        32,
        "--batch-size",
        32,
        "--epochs",
        2,
        "--log-every",
        1,
        "--checkpoint-every",
        3,
        "--keep-checkpoints",
        10,
    ]
    plain, full = tmp_path / "plain", tmp_path / "full"
    check_ok(run_in_process("finetune_folder", [*base, "--workers", 0, "--output-dir", plain], env))
    augmented = [*base, "--auto-augment", "true", "--random-erase", 0.5]
    check_ok(run_in_process("finetune_folder", [*augmented, "--workers", 0, "--output-dir", full], env))
    losses = lambda r: [(x["step"], x["train/loss"]) for x in read_jsonl(r / "metrics.jsonl") if "train/loss" in x]
    assert losses(full)[0] != losses(plain)[0]  # the first batch already sees other pixels
    run = stopped_at(full, 3, tmp_path / "run")
    proc = check_ok(
        run_in_process(
            "finetune_folder", [*augmented, "--workers", 1, "--output-dir", run, "--resume-from", "latest"], env
        )
    )
    assert "resumed from" in proc.stdout and losses(run) == losses(full)
    a, b = load_file(str(run / "final" / "model.safetensors")), load_file(str(full / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_progressive_resizing_grows_the_crops_and_a_resume_draws_the_same_pixels(tmp_path, photos_like, env):
    """--start-image-size: the training crops grow epoch by epoch from it to --image-size (a copy whose loop prints
    each batch's side shows 16, then 32, then 48 px), evaluation stays at --image-size, and a run stopped inside the
    second epoch and resumed with a worker process instead of none, and without the two size flags (the run's own
    are taken from the checkpoint), trains on the same pixels (same losses, same weights bit for bit)."""
    copy = copy_recipe("finetune_folder", tmp_path / "my_photos.py")
    loop = "            with accelerator.accumulate(model):\n"
    text = copy.read_text()
    assert text.count(loop) == 1
    copy.write_text(text.replace(loop, '            print("crop side", images.shape[-1], flush=True)\n' + loop))
    base = [
        "--dataset",
        photos_like,
        "--batch-size",
        32,
        "--epochs",
        3,
        "--log-every",
        1,
        "--checkpoint-every",
        3,
        "--keep-checkpoints",
        10,
    ]
    full = tmp_path / "full"
    proc = check_ok(
        run_in_process(
            copy, [*base, "--image-size", 48, "--start-image-size", 16, "--workers", 0, "--output-dir", full], env
        )
    )
    sides = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("crop side")]
    per_epoch = len(sides) // 3
    assert per_epoch and sides == [16] * per_epoch + [32] * per_epoch + [48] * per_epoch, sides
    model_json = json.loads((full / "final" / "model.json").read_text())
    assert model_json["preprocess"]["center_crop"] == 48  # evaluation and predict: --image-size
    losses = lambda r: [(x["step"], x["train/loss"]) for x in read_jsonl(r / "metrics.jsonl") if "train/loss" in x]
    run = stopped_at(full, per_epoch + 1, tmp_path / "run")  # inside the second epoch, at 32 px
    proc = check_ok(run_in_process(copy, [*base, "--workers", 1, "--output-dir", run, "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout and losses(run) == losses(full)
    a, b = load_file(str(run / "final" / "model.safetensors")), load_file(str(full / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a resume that extends --epochs: the note says the crops' schedule moves too (before, it spoke of the LR only)
    longer = stopped_at(full, per_epoch + 1, tmp_path / "longer")
    extended = [*base[:-6], "--epochs", 5, "--max-steps", per_epoch + 2, "--log-every", 1]
    proc = check_ok(run_in_process(copy, [*extended, "--output-dir", longer, "--resume-from", "latest"], env))
    assert "--epochs 5 differs from the run's 3" in proc.stdout
    assert (
        "progressive resizing follows --epochs too" in proc.stdout
        and "epochs 2-5 now train at 32, 32, 32, 48 px (the run had planned 32, 48 px for epochs 2-3)" in proc.stdout
    )


def test_progressive_resizing_starts_at_half_the_size_from_scratch_and_is_off_with_weights(tmp_path):
    """Left out, --start-image-size is half of --image-size from scratch (the default 128 -> 64, a given 224 -> 112)
    and off with --weights (pretrained features at their own size throughout); given, it is taken as given."""
    from common.config import parse_config

    from helpers import import_recipe, recipe_path

    recipe = import_recipe(recipe_path("finetune_folder"))
    weights = tmp_path / "w.pth"
    torch.save({}, weights)

    def sides(*flags):
        cfg = parse_config(recipe.Config, ["--dataset", str(tmp_path), *map(str, flags)], "")
        return cfg.image_size, cfg.start_image_size, [recipe.crop_side(cfg, e) for e in range(cfg.epochs)]

    size, start, per_epoch = sides()
    assert (size, start) == (128, 64) and per_epoch[0] == 64 and per_epoch[-1] == 128
    assert per_epoch == sorted(per_epoch) and all(s % 16 == 0 for s in per_epoch)
    assert sides("--image-size", 224)[:2] == (224, 112)
    assert sides("--weights", weights, "--image-size", 96)[1:] == (0, [96] * 32)
    assert sides("--start-image-size", 0)[2] == [128] * 32
    assert sides("--weights", weights, "--image-size", 96, "--start-image-size", 48, "--epochs", 3)[2] == [48, 64, 96]
