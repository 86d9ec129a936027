"""Your photos, trusted end to end: torchvision's own weight files and spellings load as torch loads them, every path
that reads a pixel (the run's evaluation, --eval-only, predict, export) reads it the same way, a renamed or swapped
file is noticed, one bad photo is named before training or in one paragraph mid-run, the EMA is one model on every
rank, and each listed model family trains (tiny images in bf16 on a CPU included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from common import vision
from common.errors import ConfigError, DataError

from helpers import check_ok, copy_recipe, read_jsonl, run_in_process, stopped_at, write_photo_folder


def test_a_weights_file_saved_without_batchnorm_counters_loads_as_torch_loads_it(tmp_path):
    """torchvision's older ImageNet files (resnet18's among them) were saved before BatchNorm had num_batches_tracked:
    no counters, BatchNorm version 1 in the metadata. They load, as torch's own load_state_dict loads them."""
    import collections

    import torchvision

    source = torchvision.models.resnet18(num_classes=1000)
    old = collections.OrderedDict(
        (k, v) for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")
    )
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


def test_a_weights_file_saved_from_a_ddp_model_loads_without_its_module_prefix(tmp_path):
    """A file saved from a DistributedDataParallel model prefixes every key (and its metadata) with ``module.``: it
    loads as torch's own ``consume_prefix_in_state_dict_if_present`` and load_state_dict would load it."""
    import torchvision

    source = torchvision.models.resnet18(num_classes=3)
    wrapped = torch.nn.Module()  # DDP's key layout (the model as its ``module``) without a process group
    wrapped.module = source
    saved = wrapped.state_dict()
    assert all(k.startswith("module.") for k in saved) and "module.layer1.0.bn1" in saved._metadata
    torch.save(saved, tmp_path / "ddp.pth")
    model = vision.build("resnet18", 3)
    line = vision.load_pretrained(model, str(tmp_path / "ddp.pth"), "resnet18", 3)
    assert f"{len(saved)} tensors loaded" in line and "skipped" not in line and "no head" not in line, line
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))


def test_an_unknown_model_with_weights_is_said_to_be_an_unknown_model():
    """--model resnet81 --weights DEFAULT blamed the weights ("neither a file nor one of torchvision's weights")."""
    with pytest.raises(
        ConfigError,
        match=r"--model 'resnet81' is neither a torchvision classification model nor a timm model \(did you "
        r"mean resnet18",
    ):
        vision.resolve("resnet81", "DEFAULT")


def test_a_weights_run_resumes_without_its_file_and_keeps_its_normalisation(tmp_path, photos_like, env):
    """Started from a weights file, stopped, the file then gone: the same command without --weights and
    --image-size resumes with the run's own (taken from the checkpoint, said so), never reads the file (the checkpoint
    holds every weight) and keeps the weights' normalisation. Before: the missing file stopped the resume, and
    without the flag the photos' own statistics silently replaced ImageNet's."""
    torch.save(vision.build("resnet18", 1000).state_dict(), tmp_path / "resnet18.pth")
    run = tmp_path / "run"
    base = ["--dataset", photos_like, "--batch-size", 16, "--epochs", 1, "--workers", 0, "--output-dir", run]
    check_ok(
        run_in_process(
            "finetune_folder",
            [
                *base,
                "--weights",
                tmp_path / "resnet18.pth",
                "--image-size",
                32,
                "--max-steps",
                2,
                "--checkpoint-every",
                2,
            ],
            env,
        )
    )
    (tmp_path / "resnet18.pth").unlink()
    proc = check_ok(run_in_process("finetune_folder", [*base, "--resume-from", "latest"], env))
    assert "resumed from" in proc.stdout and "--weights" in proc.stdout and "--image-size 32" in proc.stdout
    card = json.loads((run / "final" / "model.json").read_text())
    assert card["mean"] == list(vision.IMAGENET_MEAN) and card["input_shape"] == [3, 32, 32]


def test_eval_only_normalises_as_the_scored_run_did_on_any_data(tmp_path, photos_like, env, monkeypatch):
    """--eval-only with --dataset naming other photos: the inputs are normalised with the mean and std the run
    recorded in model.json, not with statistics of the data being scored (before, a brighter folder was
    normalised back toward the training pixels and scored as if it were them)."""
    from helpers import import_recipe, write_photo_folder

    run = tmp_path / "run"
    check_ok(
        run_in_process(
            "finetune_folder",
            [
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
                "--output-dir",
                run,
            ],
            env,
        )
    )
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
    base = [
        "--dataset",
        root.parent,
        "--image-size",
        32,
        "--batch-size",
        8,
        "--epochs",
        2,
        "--workers",
        0,
        "--output-dir",
        run,
    ]
    check_ok(run_in_process("finetune_folder", [*base, "--max-steps", 3], env))
    a, b = root / "ant" / "0.jpg", root / "ant" / "5.jpg"
    os.rename(a, tmp_path / "t.jpg")
    os.rename(b, a)
    os.rename(tmp_path / "t.jpg", b)
    resumed = run_in_process("finetune_folder", [*base, "--resume-from", "latest"], env)
    assert resumed.returncode == 2 and "The data differs" in resumed.stderr, resumed.stderr[-2000:]
    assert "ant/0.jpg" in resumed.stderr and "Traceback" not in resumed.stderr
    scored = run_in_process("finetune_folder", ["--eval-only", "--checkpoint", run], env)
    assert scored.returncode == 2 and "The data differs" in scored.stderr and "ant/0.jpg" in scored.stderr, (
        scored.stderr[-2000:]
    )


def test_the_ema_is_one_model_on_every_rank_and_resumes_exactly_at_2_processes(tmp_path, photos_like):
    """--ema-decay on 2 gloo processes: each rank's forward updates its own BatchNorm statistics, so each rank's
    average drifted apart and rank 1 scored its share of the images with a model never saved; a resume (every rank
    from rank 0's checkpoint) then scored differently. Now the average takes rank 0's statistics before it is read:
    stopped at step 4 and resumed, the evaluations and the final weights equal the uninterrupted run's."""
    from helpers import launch, recipe_env

    env = recipe_env(tmp_path)
    base = [
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
        "--ema-decay",
        0.8,
        "--log-every",
        1,
        "--eval-every-steps",
        3,
        "--eval-batch-size",
        4,  # several evaluation batches, shared between the ranks
    ]
    full = tmp_path / "full"
    check_ok(launch("finetune_folder", [*base, "--checkpoint-every", 4, "--output-dir", full], env, nproc=2))
    part = stopped_at(full, 4, tmp_path / "part")  # as a run stopped at step 4 leaves its folder
    check_ok(
        launch(
            "finetune_folder",
            [*base, "--checkpoint-every", 4, "--output-dir", part, "--resume-from", "latest"],
            env,
            nproc=2,
        )
    )
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
    check_ok(
        run_in_process(
            "finetune_folder",
            [
                "--dataset",
                tmp_path / "big",
                "--image-size",
                32,
                "--batch-size",
                8,
                "--epochs",
                2,
                "--workers",
                0,
                "--output-dir",
                run,
            ],
            env,
        )
    )
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
    exported = F.cross_entropy(
        torch.from_numpy(session.run(None, {"images": (views.float() / 255).numpy()})[0]), labels
    ).item()
    assert (
        scored == pytest.approx(trained, rel=1e-5)
        and predicted == pytest.approx(trained, rel=1e-4)
        and exported == pytest.approx(trained, rel=1e-4)
    ), (trained, scored, predicted, exported)


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


def test_a_photo_that_breaks_mid_run_stops_it_in_one_paragraph_past_the_share(tmp_path, env):
    """A photo overwritten after the first step is met by a DataLoader worker: skipped with a warning naming it, and
    (1 of 24 photos: past the default --max-damaged 1%) the run stops at the next step in one paragraph naming it,
    exit 2, a checkpoint of where it stopped kept, summary.json listing it."""
    root = write_photo_folder(tmp_path / "d" / "train", 8)
    victim = sorted((root / "ant").glob("*.jpg"))[0]
    copy = copy_recipe("finetune_folder", tmp_path / "breaks.py")
    text = copy.read_text()
    anchor = "            if not accelerator.optimizer_step_was_skipped:"
    assert text.count(anchor) == 1
    copy.write_text(
        text.replace(
            anchor,
            f"            if run.step == 1:\n"
            f"                open({str(victim)!r}, 'wb').write(b'not a photo any more')\n"
            f"{anchor}",
        )
    )
    args = ["--dataset", root.parent, "--image-size", 32, "--batch-size", 8, "--epochs", 3, "--workers", 1]
    proc = run_in_process(copy, [*args, "--output-dir", tmp_path / "run"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "1 damaged photo met" in paragraph and str(victim) in paragraph and "--max-damaged" in paragraph
    assert f"warning: skipped a damaged photo, {victim} (not an image file Pillow can read)" in proc.stderr
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "bad_input" and summary["damaged_photos"]["count"] == 1, summary


def test_damaged_photos_are_skipped_named_once_counted_and_left_out_of_the_scores(tmp_path, env):
    """One training and one validation photo cut short, 2 of 30, with --max-damaged 0.1: the run trains to its end,
    each named once in a warning though three epochs and three evaluations read them, validation scores the 5 photos
    it could read, and summary.json lists both. With the default --max-damaged (1%) the same folder stops the run in
    one paragraph naming them."""
    root = tmp_path / "d"
    write_photo_folder(root / "train", 8)
    write_photo_folder(root / "val", 2, seed=1)
    cut = [sorted((root / "train" / "bee").glob("*.jpg"))[-1], sorted((root / "val" / "wasp").glob("*.jpg"))[-1]]
    for victim in cut:
        victim.write_bytes(victim.read_bytes()[:200])
    args = ["--dataset", root, "--image-size", 32, "--batch-size", 8, "--epochs", 3, "--workers", 1]
    args += ["--eval-every", 1]
    proc = run_in_process("finetune_folder", [*args, "--max-damaged", 0.1, "--output-dir", tmp_path / "run"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for victim in cut:
        assert proc.stderr.count(f"warning: skipped a damaged photo, {victim} (") == 1, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final"]["val/count"] == 5, summary["final"]
    listed = summary["damaged_photos"]
    assert listed["count"] == 2 and {f["file"] for f in listed["files"]} == {str(v) for v in cut}, listed
    assert "damaged photos      2 skipped (summary.json)" in proc.stdout, proc.stdout[-2000:]
    proc = run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "run2"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "damaged photo" in paragraph and "raise --max-damaged" in paragraph, paragraph
    assert json.loads((tmp_path / "run2" / "summary.json").read_text())["status"] == "bad_input"


def test_a_damaged_photos_stand_in_is_drawn_at_random_seeded_and_an_unreadable_split_is_one_paragraph(tmp_path):
    """In training a damaged photo's place goes to another photo of the split drawn at random (seeded by the seed,
    the epoch and the photo: the same draw again, another one next epoch), not its neighbour in folder order (a
    whole damaged class folder would hand its places to the next class). A split none of whose photos read is one
    paragraph after 32 draws, not a scan of every file for every sample."""
    from common.data.photos import STAND_IN_TRIES, PhotoDataset, PhotoSplit

    root = write_photo_folder(tmp_path / "d", 10)
    files = sorted(str(p) for p in root.rglob("*.*"))
    for path in files[:10]:  # every photo of the first class folder (ant)
        Path(path).write_bytes(b"not a photo")
    labels = torch.tensor([0 if "/ant/" in f else 1 if "/bee/" in f else 2 for f in files])
    split = PhotoSplit(files, labels, 16)
    data = PhotoDataset(split, seed=3, train_view=lambda image: image[:, :16, :16])
    _, label, damaged = data[0]
    assert damaged[0] == files[0] and "Pillow" in damaged[1]
    again = data[0]
    assert torch.equal(again[0], data[0][0]) and again[1] == label  # seeded: the same stand-in
    stand_ins = set()
    for epoch in range(6):
        data.set_epoch(epoch)
        stand_ins.add(int(data[0][1]))
    assert stand_ins <= {1, 2} and len(stand_ins) == 2, stand_ins  # never the damaged class; both others drawn
    for path in files:
        Path(path).write_bytes(b"not a photo")
    with pytest.raises(DataError, match=f"nor could any of the {STAND_IN_TRIES} photos"):
        data[5]


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


@pytest.mark.parametrize("damaged", ["all", "half"])
def test_damaged_photos_in_the_final_split_are_held_to_max_damaged(damaged, tmp_path, env):
    """test/ with every photo damaged, under a --max-damaged that allows them: one paragraph (bad input) saying
    nothing could be scored, no traceback, no final/ (a KeyError traceback before; a NaN accuracy would have passed
    --target-accuracy). Half of test/ damaged (past the default --max-damaged 1%): the run does not end with a score
    of the other half, it says so in one paragraph naming them. --eval-only of its checkpoint says the same."""
    root = tmp_path / "d"
    write_photo_folder(root / "train", 6)
    write_photo_folder(root / "val", 1, seed=1)
    write_photo_folder(root / "test", 2, seed=2)
    tests = sorted(p for p in (root / "test").rglob("*") if p.is_file())
    for victim in tests if damaged == "all" else tests[::2]:
        victim.write_bytes(victim.read_bytes()[:200])
    run = tmp_path / "run"
    args = ["--dataset", root, "--image-size", 32, "--batch-size", 8, "--epochs", 1, "--workers", 1]
    args += ["--max-damaged", 0.5] if damaged == "all" else []
    proc = run_in_process("finetune_folder", [*args, "--target-accuracy", 0.01, "--output-dir", run], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if damaged == "all":
        assert "None of the" in paragraph and "could be read" in paragraph, paragraph
    else:
        assert "damaged photos met, more than --max-damaged" in paragraph and str(tests[0]) in paragraph, paragraph
    assert json.loads((run / "summary.json").read_text())["status"] == "bad_input"
    assert not (run / "final").exists()
    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    again = run_in_process("finetune_folder", [*args, "--eval-only", "--checkpoint", latest], env)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
