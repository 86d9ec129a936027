"""The photo recipe (recipes/finetune_folder.py) on a tiny folder of photos of mixed sizes and modes: it trains,
resumes exactly (also with decoding moved into a worker process), predicts and exports photos of any size, scores
--eval-only, starts from a weights file with another head, and follows the LR rule. The reference runs of conftest
(1 process in this process, 2 real gloo processes) are shared with the pinned-loss test."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import check_ok, read_jsonl, run_in_process, stopped_at, write_photo_folder
from common import vision
from common.errors import ConfigError


def test_trains_on_photos_of_any_size_and_mode_at_1_and_2_processes(reference_run):
    for nproc in (1, 2):
        ref = reference_run("finetune_folder", nproc)
        summary = json.loads((ref.run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["processes"] == nproc
        assert summary["final"]["test/count"] == 24  # every test photo counted once, at 2 processes too
        assert "processes=%d" % nproc in ref.proc.stdout and "train=162 val=18 test=24" in ref.proc.stdout
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
    from common.photos import eval_view, read_rgb

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
    proc = check_ok(run_in_process("finetune_folder", [
        "--dataset", photos_like, "--weights", tmp_path / "resnet18.pth", "--max-steps", 1, "--batch-size", 16,
        "--workers", 0, "--output-dir", tmp_path / "run"], env))
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
    with pytest.raises(ConfigError, match="not a torchvision classification model"):
        vision.build("resnet_18", 3)


def test_a_changed_batch_scales_the_lr_linearly(tmp_path, photos_like, env):
    proc = check_ok(run_in_process("finetune_folder", [
        "--dataset", photos_like, "--batch-size", 16, "--image-size", 32, "--max-steps", 1, "--workers", 0,
        "--output-dir", tmp_path / "run"], env))
    assert "lr=0.025 (0.2 x 16/128, linear rule)" in proc.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == pytest.approx(0.025)


def test_copy_recipe_copies_the_photo_recipe(tmp_path, capsys):
    from common.tools import copy_recipe

    assert copy_recipe.main(["finetune_folder", str(tmp_path / "my_photos.py")]) == 0
    text = (tmp_path / "my_photos.py").read_text()
    assert 'RECIPE = "my_photos"' in text and "run.batches(train_loader)" in text
    shutil.rmtree(tmp_path)


def test_mixup_cutmix_and_ema_train_and_the_ema_is_what_is_saved(tmp_path, photos_like, env):
    """torchvision's MixUp/CutMix and torch's AveragedModel through the recipe: the weights saved in final/ are the
    average's (not the live model's), and it is in the checkpoint (a resume restores it)."""
    run = tmp_path / "run"
    args = ["--dataset", photos_like, "--image-size", 32, "--batch-size", 16, "--epochs", 1, "--workers", 0,
            "--mixup", 0.2, "--cutmix", 1.0, "--ema-decay", 0.5, "--output-dir", run]
    check_ok(run_in_process("finetune_folder", args, env))
    final = load_file(str(run / "final" / "model.safetensors"))
    checkpoint = next((run / "checkpoints").glob("step-*"))
    live, averaged = load_file(str(checkpoint / "model.safetensors")), load_file(str(checkpoint / "ema.safetensors"))
    assert not torch.equal(final["conv1.weight"], live["conv1.weight"])  # the average, not the live weights
    assert torch.equal(averaged["module.conv1.weight"], final["conv1.weight"])
    assert not list(checkpoint.glob("custom_checkpoint_*"))  # no pickle
    resumed = check_ok(run_in_process("finetune_folder", [*args[:-2], "--epochs", 2, "--output-dir", run,
                                                          "--resume-from", "latest"], env))
    assert "resumed from" in resumed.stdout


def test_an_unreadable_photo_is_named_before_training_at_every_launch(tmp_path, env):
    """Checked before the first step, in one paragraph naming the file; a failed check is not remembered as done."""
    root = write_photo_folder(tmp_path / "d", 6)
    (root / "ant" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    for _ in range(2):
        proc = run_in_process("finetune_folder", ["--dataset", root, "--image-size", 32, "--workers", 0,
                                                  "--output-dir", tmp_path / "run"], env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "1 of the 19 images" in proc.stderr and "broken.jpg" in proc.stderr
    # a photo whose header reads but whose data is cut short (a copy interrupted): decoded whole before training,
    # named there; before, the header check passed it and a DataLoader worker met it mid-epoch, ending the run
    # without a checkpoint
    (root / "ant" / "broken.jpg").unlink()
    whole = (root / "ant" / "0.jpg").read_bytes()
    (root / "ant" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    proc = run_in_process("finetune_folder", ["--dataset", root, "--image-size", 32, "--workers", 0, "--batch-size", 8,
                                              "--output-dir", tmp_path / "run2"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cut.jpg" in proc.stderr and "truncated" in proc.stderr and not (tmp_path / "run2").exists()
    (root / "ant" / "cut.jpg").unlink()
    fresh_cache = tmp_path / "new-user" / "cache"  # a first launch: the cache folder does not exist yet
    check_ok(run_in_process("finetune_folder", ["--dataset", root, "--image-size", 32, "--workers", 0,
                                                "--batch-size", 8, "--max-steps", 1, "--cache-dir", fresh_cache,
                                                "--output-dir", tmp_path / "run3"], env))
    assert list(fresh_cache.glob("photos-checked-*"))  # checked once; the next launch skips the check


def test_the_recipes_own_augmentation_trains_and_resumes_exactly(tmp_path, photos_like, env):
    """--auto-augment (TrivialAugmentWide) and --random-erase run in the recipe's train_view, in the loader's workers:
    they change what trains (other losses than the plain crop and flip), and a run stopped at step 3 and resumed with
    a worker process instead of none draws the same pixels (same losses and weights, bit for bit)."""
    base = ["--dataset", photos_like, "--image-size", 32, "--batch-size", 32, "--epochs", 2, "--log-every", 1,
            "--checkpoint-every", 3, "--keep-checkpoints", 10]
    plain, full = tmp_path / "plain", tmp_path / "full"
    check_ok(run_in_process("finetune_folder", [*base, "--workers", 0, "--output-dir", plain], env))
    augmented = [*base, "--auto-augment", "true", "--random-erase", 0.5]
    check_ok(run_in_process("finetune_folder", [*augmented, "--workers", 0, "--output-dir", full], env))
    losses = lambda r: [(x["step"], x["train/loss"]) for x in read_jsonl(r / "metrics.jsonl") if "train/loss" in x]
    assert losses(full)[0] != losses(plain)[0]  # the first batch already sees other pixels
    run = stopped_at(full, 3, tmp_path / "run")
    proc = check_ok(run_in_process("finetune_folder", [*augmented, "--workers", 1, "--output-dir", run,
                                                       "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout and losses(run) == losses(full)
    a, b = load_file(str(run / "final" / "model.safetensors")), load_file(str(full / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_weights_file_saved_without_batchnorm_counters_loads_as_torch_loads_it(tmp_path):
    """torchvision's older ImageNet files (resnet18's among them) were saved before BatchNorm had num_batches_tracked:
    no counters, BatchNorm version 1 in the metadata. They load, as torch's own load_state_dict loads them."""
    import collections

    import torchvision

    source = torchvision.models.resnet18(num_classes=1000)
    old = collections.OrderedDict((k, v) for k, v in source.state_dict().items()
                                  if not k.endswith("num_batches_tracked"))
    old._metadata = {name: {"version": 1} for name, _ in source.named_modules()}
    torch.save(old, tmp_path / "resnet18-old.pth")
    model = vision.build("resnet18", 1000)
    line = vision.load_pretrained(model, str(tmp_path / "resnet18-old.pth"), "resnet18", 1000)
    assert f"{len(old)} tensors loaded" in line and "skipped" not in line
    reference = torchvision.models.resnet18(num_classes=1000)
    reference.load_state_dict(torch.load(tmp_path / "resnet18-old.pth", weights_only=True))  # torch's own, strict
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    headless = {k: v for k, v in old.items() if not k.startswith("fc.")}
    torch.save(headless, tmp_path / "backbone.pth")
    line = vision.load_pretrained(vision.build("resnet18", 3), str(tmp_path / "backbone.pth"), "resnet18", 3)
    assert "the file holds no head (fc.bias, fc.weight): it starts fresh" in line, line


def test_an_unknown_model_with_weights_is_said_to_be_an_unknown_model():
    """--model resnet81 --weights DEFAULT blamed the weights ("neither a file nor one of torchvision's weights")."""
    with pytest.raises(ConfigError, match=r"--model 'resnet81' is not a torchvision classification model \(did you "
                                          r"mean resnet18"):
        vision.resolve("resnet81", "DEFAULT")


def test_a_weights_run_resumes_without_its_file_and_keeps_its_normalisation(tmp_path, photos_like, env):
    """Started from a weights file, stopped, the file then gone: the same command without --weights and
    --image-size resumes with the run's own (taken from the checkpoint, said so), never reads the file (the checkpoint
    holds every weight) and keeps the weights' normalisation. Before: the missing file stopped the resume, and
    without the flag the photos' own statistics silently replaced ImageNet's."""
    torch.save(vision.build("resnet18", 1000).state_dict(), tmp_path / "resnet18.pth")
    run = tmp_path / "run"
    base = ["--dataset", photos_like, "--batch-size", 16, "--epochs", 1, "--workers", 0, "--output-dir", run]
    check_ok(run_in_process("finetune_folder", [*base, "--weights", tmp_path / "resnet18.pth", "--image-size", 32,
                                                "--max-steps", 2, "--checkpoint-every", 2], env))
    (tmp_path / "resnet18.pth").unlink()
    proc = check_ok(run_in_process("finetune_folder", [*base, "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout and "--weights" in proc.stdout and "--image-size 32" in proc.stdout
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["mean"] == list(vision.IMAGENET_MEAN) and card["input_shape"] == [3, 32, 32]


def test_eval_only_normalises_as_the_scored_run_did_on_any_data(tmp_path, photos_like, env, monkeypatch):
    """--eval-only with --dataset naming other photos: the inputs are normalised with the mean and std the run
    recorded in model.json, not with statistics of the data being scored (before, a brighter folder was
    normalised back toward the training pixels and scored as if it were them)."""
    from conftest import import_recipe, write_photo_folder

    run = tmp_path / "run"
    check_ok(run_in_process("finetune_folder", ["--dataset", photos_like, "--image-size", 32, "--batch-size", 16,
                                                "--epochs", 1, "--workers", 0, "--output-dir", run], env))
    other = write_photo_folder(tmp_path / "other" / "train", 6, seed=5)
    for path in other.rglob("*.jpg"):  # brighter photos: other statistics
        Image.open(path).point(lambda v: min(255, v + 90)).save(path)
    recipe, used = import_recipe("finetune_folder"), []
    real = recipe.BatchTransform

    def recording(mean, std, **kw):
        used.append((list(mean), list(std)))
        return real(mean, std, **kw)

    monkeypatch.setattr(recipe, "BatchTransform", recording)
    check_ok(run_in_process("finetune_folder", ["--eval-only", "--checkpoint", run, "--dataset", other.parent], env))
    card = json.loads((run / "final" / "model.json").read_text())
    assert used == [(card["mean"], card["std"])]


def test_a_renamed_or_swapped_photo_is_refused_by_resume_and_eval_only_naming_it(tmp_path, env):
    """Two photos of one class swap names (`mv a t; mv b a; mv t b`): labels, counts and held-out positions are
    unchanged, so the old fingerprint matched and a held-out photo could be one the run trained on. Now a resume and
    --eval-only refuse, naming the rows whose files changed."""
    import os

    root = write_photo_folder(tmp_path / "photos" / "train", 12)
    run = tmp_path / "run"
    base = ["--dataset", root.parent, "--image-size", 32, "--batch-size", 8, "--epochs", 2, "--workers", 0,
            "--output-dir", run]
    check_ok(run_in_process("finetune_folder", [*base, "--max-steps", 3], env))
    a, b = root / "ant" / "0.jpg", root / "ant" / "5.jpg"
    os.rename(a, tmp_path / "t.jpg")
    os.rename(b, a)
    os.rename(tmp_path / "t.jpg", b)
    resumed = run_in_process("finetune_folder", [*base, "--resume-from", "latest"], env)
    assert resumed.returncode == 2 and "The data differs" in resumed.stderr, resumed.stderr[-2000:]
    assert "ant/0.jpg" in resumed.stderr and "Traceback" not in resumed.stderr
    scored = run_in_process("finetune_folder", ["--eval-only", "--checkpoint", run], env)
    assert scored.returncode == 2 and "The data differs" in scored.stderr and "ant/0.jpg" in scored.stderr, \
        scored.stderr[-2000:]


def test_the_ema_is_one_model_on_every_rank_and_resumes_exactly_at_2_processes(tmp_path, photos_like):
    """--ema-decay on 2 gloo processes: each rank's forward updates its own BatchNorm statistics, so each rank's
    average drifted apart and rank 1 scored its share of the images with a model never saved; a resume (every rank
    from rank 0's checkpoint) then scored differently. Now the average takes rank 0's statistics before it is read:
    stopped at step 4 and resumed, the evaluations and the final weights equal the uninterrupted run's."""
    from conftest import launch, recipe_env

    env = recipe_env(tmp_path)
    base = ["--dataset", photos_like, "--image-size", 32, "--batch-size", 16, "--epochs", 1, "--workers", 0,
            "--ema-decay", 0.8, "--log-every", 1, "--eval-every-steps", 3,
            "--eval-batch-size", 4]  # several evaluation batches, shared between the ranks
    full = tmp_path / "full"
    check_ok(launch("finetune_folder", [*base, "--checkpoint-every", 4, "--output-dir", full], env, nproc=2))
    part = stopped_at(full, 4, tmp_path / "part")  # as a run stopped at step 4 leaves its folder
    check_ok(launch("finetune_folder", [*base, "--checkpoint-every", 4, "--output-dir", part, "--resume-from",
                                        "latest"], env, nproc=2))
    evals = lambda r: {x["step"]: x["eval/loss"] for x in read_jsonl(r / "metrics.jsonl") if "eval/loss" in x}
    assert list(evals(full)) == [3, 6, 9, 10] and evals(part) == evals(full)  # every 3 steps and the epoch's end
    a, b = load_file(str(part / "final" / "model.safetensors")), load_file(str(full / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,size", [("googlenet", 64), ("inception_v3", 80), ("vit_b_16", 32)])
def test_every_listed_family_trains_a_step_at_its_size(name, size, tmp_path):
    """googlenet and inception_v3 returned a tuple in training (their auxiliary heads) and vit_b_16 took only 224 px:
    each crashed at its first step though --model lists it. Built as the recipe builds them, one training step."""
    model = vision.build(name, 3, size)
    model.train()
    logits = model(torch.randn(2, 3, size, size))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 3)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2])).backward()
    if name == "vit_b_16":
        with pytest.raises(ConfigError, match="must be a multiple of 16"):
            vision.build(name, 3, 40)
    if name != "vit_b_16":  # a file of torchvision's own (with its auxiliary heads) loads, the heads left out
        import torchvision

        full = torchvision.models.get_model(name, weights=None, num_classes=1000, aux_logits=True, init_weights=True)
        torch.save(full.state_dict(), tmp_path / f"{name}.pth")
        line = vision.load_pretrained(model, str(tmp_path / f"{name}.pth"), name, 3)
        assert "left out the auxiliary classifiers" in line and "skipped the head of another shape" in line


def test_every_path_scores_large_photos_of_odd_sizes_alike(tmp_path, env):
    """Photos far larger than the crop, of odd sizes (JPEG draft decoding takes them at 1/4 or 1/8 scale): the run's
    own final evaluation, --eval-only, predict and the exported ONNX model (fed the views predict makes) give the
    same test loss. Before, predict decoded them at full size
    (other pixels after the resize), and so scored other images than the run did."""
    import torch.nn.functional as F

    from common.tools import predict

    rng = np.random.default_rng(3)
    sizes = [(301, 203), (257, 419), (640, 480), (333, 500), (210, 210)]
    for split, n in (("train", 8), ("test", 3)):
        for k, cls in enumerate(("ant", "bee", "wasp")):
            (tmp_path / "big" / split / cls).mkdir(parents=True)
            for i in range(n):
                w, h = sizes[(i + k) % len(sizes)]
                small = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
                small[:, :, k] = 220  # a class colour, smooth at full size
                Image.fromarray(small).resize((w, h), Image.BICUBIC).save(tmp_path / "big" / split / cls / f"{i}.jpg")
    run = tmp_path / "run"
    check_ok(run_in_process("finetune_folder", ["--dataset", tmp_path / "big", "--image-size", 32, "--batch-size", 8,
                                                "--epochs", 2, "--workers", 0, "--output-dir", run], env))
    trained = json.loads((run / "summary.json").read_text())["final"]["test/loss"]
    check_ok(run_in_process("finetune_folder", ["--eval-only", "--checkpoint", run / "final"], env))
    scored = json.loads((run / "final" / "eval-test.json").read_text())["loss"]
    predictor = predict.load_predictor(run / "final")
    files = sorted((tmp_path / "big" / "test").rglob("*.jpg"))
    views = torch.stack([predict.load_image(f, predictor.input_shape, predictor.card["preprocess"])[0] for f in files])
    labels = torch.tensor([("ant", "bee", "wasp").index(f.parent.name) for f in files])
    predicted = F.cross_entropy(predictor.logits(views), labels).item()
    import onnxruntime

    from common.tools import export

    assert export.main([str(run / "final"), "--onnx", str(tmp_path / "m.onnx")]) == 0  # takes pixels / 255
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    exported = F.cross_entropy(torch.from_numpy(session.run(None, {"images": (views.float() / 255).numpy()})[0]),
                               labels).item()
    assert scored == pytest.approx(trained, rel=1e-5) and predicted == pytest.approx(trained, rel=1e-4) and \
        exported == pytest.approx(trained, rel=1e-4), (trained, scored, predicted, exported)


def test_tiny_images_in_bf16_on_a_cpu_train_with_sound_gradients():
    """A CPU defect: under bf16 autocast the weight gradient of a strided, padded convolution on a 1x1 input is
    garbage in about one call of four (uninitialised memory: 1e17 to 1e36; ResNet-18 below 17 px meets it in layer4
    and the run's loss turned NaN). The models vision.build makes run such convolutions in fp32: over 30 calls the
    weight gradient is the fp32 one every time, and a ResNet-18 at 16 px keeps every gradient finite."""
    torch.manual_seed(0)
    for _ in range(30):
        conv = vision.guard_cpu_bf16_strided_convs(torch.nn.Conv2d(64, 128, 3, 2, 1, bias=False))
        x = torch.randn(16, 64, 1, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = conv(x)
        out.float().sum().backward()
        expected = torch.nn.grad.conv2d_weight(x, conv.weight.shape, torch.ones_like(out), stride=2, padding=1)
        assert torch.allclose(conv.weight.grad, expected, rtol=1e-4, atol=1e-5)
    model = vision.build("resnet18", 2, 16).to(memory_format=torch.channels_last)
    for _ in range(3):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 3, 16, 16)).float(), torch.arange(16) % 2)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() and p.grad.abs().max() < 1e3 for p in model.parameters())
    import copy

    twin = copy.deepcopy(model)  # an EMA's copy computes with its own weights, not the model's
    conv = twin.conv1  # guarded (stride 2, padding 3), as layer4's strided convolutions are
    assert type(conv) is vision.GuardedConv2d and type(twin.layer4[0].conv1) is vision.GuardedConv2d
    torch.nn.init.zeros_(conv.weight)
    x = torch.randn(2, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.allclose(twin.eval()(x).float(), model.eval()(x).float())


def test_a_photo_that_breaks_mid_run_in_a_worker_is_one_paragraph(tmp_path, env):
    """Every photo is decoded whole before training; one that changes during the run (here: overwritten after the
    first step) is met by a DataLoader worker, whose error carried the worker's 12-line traceback as its message.
    Now one paragraph naming the file and what works (put it back, resume), exit 2, the last checkpoint kept."""
    from common.tools.copy_recipe import copy_recipe

    root = write_photo_folder(tmp_path / "d" / "train", 8)
    victim = sorted((root / "ant").glob("*.jpg"))[0]
    copy = copy_recipe("finetune_folder", tmp_path / "breaks.py")
    text = copy.read_text()
    anchor = "            if run.step_taken():"
    assert text.count(anchor) == 1
    copy.write_text(text.replace(anchor, f"            if run.global_step == 1:\n"
                                         f"                open({str(victim)!r}, 'wb').write(b'not a photo any more')\n"
                                         f"{anchor}"))
    proc = run_in_process(copy, ["--dataset", root.parent, "--image-size", 32, "--batch-size", 8, "--epochs", 3,
                                 "--workers", 1, "--output-dir", tmp_path / "run"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert victim.name in paragraph and "Put the original file back" in paragraph and "DataLoader worker" in paragraph
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))  # epoch 1's end, before the worker met it


def test_torchvisions_own_spellings_of_weights_name_them(tmp_path):
    """`--weights ResNet18_Weights.IMAGENET1K_V1` (torchvision's docs and reference script) was taken for a file with
    the ending '.IMAGENET1K_V1' ("no such file"). Every spelling names the entry; another model's weights or an
    unknown member is one paragraph; a file is a file."""
    from torchvision.models import ResNet18_Weights

    for spec in ("ResNet18_Weights.IMAGENET1K_V1", "ResNet18_Weights.DEFAULT", "IMAGENET1K_V1", "DEFAULT"):
        assert vision.weights_entry("resnet18", spec) is ResNet18_Weights.IMAGENET1K_V1, spec
        assert vision.resolve("resnet18", spec).crop == 224
    with pytest.raises(ConfigError, match="weights of another model: resnet18's are ResNet18_Weights"):
        vision.weights_entry("resnet18", "ResNet50_Weights.IMAGENET1K_V2")
    with pytest.raises(ConfigError, match="IMAGENET1K_V1, or DEFAULT"):
        vision.weights_entry("resnet18", "ResNet18_Weights.IMAGENET1K_V9")
    (tmp_path / "IMAGENET1K_V1").write_bytes(b"")  # a file of that name is the file
    assert vision.weights_entry("resnet18", str(tmp_path / "IMAGENET1K_V1")) is None
    assert vision.weights_entry("resnet18", "my_resnet.pth") is None
