"""The photo recipe's --model beyond torchvision: a timm name and a transformers folder train, resume exactly, are
scored by --eval-only, and load in predict and export (which rebuild the model from model.json through the recipe's
build_model); local weights load (.safetensors, .pth, a Hub-layout folder, a model folder, timm's DEFAULT from the
Hugging Face cache with no network); an offline Hub model with --weights fails at start naming the cache; a mistyped
name gets its closest names in one paragraph; without transformers, a transformers folder says what to install; a
transformers folder that asks to run its own code is refused in one paragraph, by --model and by predict, export and
--eval-only, and its code never runs, not even with stdin answering "y" to transformers' question. No test downloads
anything: models are built with pretrained=False and their weights saved here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import vision
from common.errors import ConfigError

from helpers import REPO, SMALL, check_ok, read_jsonl, run_in_process, stopped_at

FLAGS = [*SMALL["finetune_folder"], "--epochs", 2, "--batch-size", 32, "--log-every", 1]
FLAGS += ["--checkpoint-every", 3, "--keep-checkpoints", 10]


def losses(run):
    return [(x["step"], x["train/loss"]) for x in read_jsonl(run / "metrics.jsonl") if "train/loss" in x]


def same_weights(a, b) -> bool:
    a, b = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trains_resumes_scores_predicts_and_exports(model_flags, photos_like, tmp_path, env, capsys):
    """2 epochs; a copy stopped at step 3 resumed to the same losses and weights, bit for bit; --eval-only scores
    final/; predict and export load it."""
    from common.tools import export, predict

    base = ["--dataset", photos_like, *model_flags, *FLAGS]
    full = tmp_path / "full"
    proc = check_ok(run_in_process("finetune_folder", [*base, "--output-dir", full], env))
    run = stopped_at(full, 3, tmp_path / "run")
    resumed = check_ok(run_in_process("finetune_folder", [*base, "--output-dir", run, "--resume-from", "latest"], env))
    assert "resumed from" in resumed.stdout and losses(run) == losses(full) and len(losses(full)) > 3
    assert same_weights(run, full)
    ev = check_ok(run_in_process("finetune_folder", ["--eval-only", "--checkpoint", full / "final"], env))
    assert "eval-only: test accuracy" in ev.stdout
    assert json.loads((full / "final" / "eval-test.json").read_text())["count"] == 24
    capsys.readouterr()
    assert predict.main([str(full / "final"), str(photos_like / "test"), "--format", "json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 24 and all(r["predictions"][0]["label"] in ("ant", "bee", "wasp") for r in results)
    assert export.main([str(full / "final"), "--onnx", str(tmp_path / "m.onnx")]) == 0  # checked against torch
    return proc, json.loads((full / "final" / "model.json").read_text())


def test_a_timm_model_trains_resumes_exactly_and_predict_export_and_eval_only_load_it(
    tmp_path, photos_like, env, capsys
):
    """timm's registry name as the Hub spells it (timm/<architecture>.<tag>), from scratch: timm's own network (not
    a torchvision one of the same name), rebuilt by predict and export from model.json's config alone."""
    proc, card = trains_resumes_scores_predicts_and_exports(
        ["--model", "timm/test_resnet.r160_in1k", "--drop-path", 0.1, "--layer-decay", 0.75],
        photos_like,
        tmp_path,
        env,
        capsys,
    )
    assert "model: ResNet" in proc.stdout and card["input_shape"] == [3, 32, 32]
    assert card["config"]["model"] == "timm/test_resnet.r160_in1k"
    assert "fc.weight" in load_file(str(tmp_path / "full" / "final" / "model.safetensors"))  # timm's names
    opens_in_its_own_library("timm", tmp_path / "full", card)


def opens_in_its_own_library(library: str, run, card):
    """best/ and final/ open in the model's own library, with the run's classes and preprocessing, and compute what
    the recipe's model computes (predict's loader: the same logits)."""
    from common.tools.predict import load_predictor

    x = torch.randn(2, 3, 32, 32)
    for folder in (run / "best", run / "final"):
        ours = load_predictor(folder)
        if library == "timm":
            import timm

            model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
            data = timm.data.resolve_data_config(model=model)
            assert list(data["mean"]) == card["mean"] and list(data["std"]) == card["std"]
            assert data["input_size"] == (3, 32, 32) and model.pretrained_cfg["label_names"] == card["class_names"]
            theirs = model(x)
        else:
            import transformers

            model = transformers.AutoModelForImageClassification.from_pretrained(str(folder)).eval()
            processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
            assert list(processor.image_mean) == card["mean"] and processor.crop_size == {"height": 32, "width": 32}
            assert [model.config.id2label[i] for i in range(3)] == card["class_names"]
            theirs = model(pixel_values=x).logits
        with torch.no_grad():
            assert torch.allclose(theirs, ours.model(x), atol=1e-5), folder


def test_a_transformers_folder_trains_resumes_exactly_and_predict_export_and_eval_only_load_it(
    tmp_path, photos_like, env, capsys
):
    """A tiny ViT saved with save_pretrained (5 classes, its preprocessor's mean and std): --model FOLDER starts from
    its weights (the head of 5 skipped), with the folder's normalisation."""
    folder = tiny_vit(tmp_path / "vit")
    proc, card = trains_resumes_scores_predicts_and_exports(["--model", folder], photos_like, tmp_path, env, capsys)
    assert "weights DEFAULT: " in proc.stdout and "model.classifier.weight (5, 16) -> (3, 16)" in proc.stdout
    assert card["mean"] == [0.5, 0.5, 0.5] and card["config"]["weights"] == "DEFAULT"
    opens_in_its_own_library("transformers", tmp_path / "full", card)


def tiny_vit(folder):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    config.num_labels = 5
    transformers.AutoModelForImageClassification.from_config(config).save_pretrained(str(folder))
    preprocessor = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": 32, "width": 32}}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


def timm_with_1000_classes():
    import timm

    return timm.create_model("test_resnet", pretrained=False, num_classes=1000)


def test_local_weights_load_into_a_timm_model(tmp_path, photos_like, env, monkeypatch):
    """A .safetensors and a .pth state_dict, a folder in the Hub's layout (--weights DIR, or --model DIR, which starts
    from its weights), and --weights DEFAULT read from the Hugging Face cache offline: every backbone tensor as saved,
    the 1000-class head skipped."""
    import huggingface_hub.constants
    import timm

    source = timm_with_1000_classes()
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save(source.state_dict(), tmp_path / "w.pth")
    timm.models.save_for_hf(source, str(tmp_path / "hub-layout"))  # config.json + model.safetensors
    # the Hub's cache as `hf download timm/test_resnet.r160_in1k` leaves it, found with no network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo, commit = tmp_path / "hub" / "models--timm--test_resnet.r160_in1k", "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(source.state_dict(), str(repo / "snapshots" / commit / "model.safetensors"))
    for name, spec in [
        ("test_resnet", tmp_path / "w.safetensors"),
        ("test_resnet", tmp_path / "w.pth"),
        ("test_resnet", tmp_path / "hub-layout"),
        (tmp_path / "hub-layout", "DEFAULT"),
        ("timm/test_resnet.r160_in1k", "DEFAULT"),
    ]:
        model = vision.build(str(name), 3, 32)
        line = vision.load_pretrained(model, str(spec), str(name), 3, 32)
        assert "skipped the head of another shape (fc.bias (1000,) -> (3,)" in line, (name, spec, line)
        own = model.state_dict()
        assert all(torch.equal(own[k], v) for k, v in source.state_dict().items() if not k.startswith("fc.")), spec
    # through the recipe: a model folder starts from its weights, with its pretrained config's normalisation
    proc = check_ok(
        run_in_process(
            "finetune_folder",
            ["--dataset", photos_like, "--model", tmp_path / "hub-layout", "--image-size", 32, "--max-steps", 1]
            + ["--batch-size", 16, "--workers", 0, "--output-dir", tmp_path / "run"],
            env,
        )
    )
    assert "weights DEFAULT: 90 tensors loaded" in proc.stdout, proc.stdout
    card = json.loads((tmp_path / "run" / "final" / "model.json").read_text())
    assert card["mean"] == [0.5, 0.5, 0.5] and card["config"]["model"] == str(tmp_path / "hub-layout")


def test_a_hub_model_in_the_cache_is_built_and_loaded_with_no_network(tmp_path, monkeypatch):
    """An hf-hub: model whose config.json and weights are in the Hugging Face cache is built and started from its
    weights with no request to the Hub, HF_HUB_OFFLINE unset (on a machine without network each request retries for
    seconds), as predict and export rebuild it; a file the cache lacks is still asked of the Hub."""
    import huggingface_hub.constants
    import huggingface_hub.file_download
    import timm

    asked, metadata = [], huggingface_hub.file_download.get_hf_file_metadata

    def no_network(*args, **kwargs):  # offline mode stops a request before it is sent; else it is one
        if not huggingface_hub.constants.HF_HUB_OFFLINE:
            asked.append(kwargs.get("url") or args[0])
            raise AssertionError("a request to the Hub")
        return metadata(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    repo, commit = tmp_path / "hub" / "models--someorg--tiny", "a" * 40
    source = timm_with_1000_classes()
    timm.models.save_for_hf(source, str(repo / "snapshots" / commit))  # config.json + weights
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = vision.build("hf-hub:someorg/tiny", 3, 32)
    line = vision.load_pretrained(model, "DEFAULT", "hf-hub:someorg/tiny", 3, 32)
    assert "skipped the head of another shape (fc.bias (1000,) -> (3,)" in line and not asked, (line, asked)
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # the cache-only call leaves the setting as it was
    for weights in ("model.safetensors", "pytorch_model.bin"):  # the cache without the weights
        (repo / "snapshots" / commit / weights).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="timm could not load them|needs someorg/tiny"):
        vision.load_pretrained(vision.build("hf-hub:someorg/tiny", 3, 32), "DEFAULT", "hf-hub:someorg/tiny", 3, 32)
    assert asked  # then from the Hub


def test_an_offline_hub_model_with_weights_fails_at_start_naming_the_cache(tmp_path, env, monkeypatch):
    """No machine here reaches the Hub: an hf-hub: model (its config.json) and --weights DEFAULT of a timm name, not
    in the cache, stop the run before the photos are read, in one paragraph naming the cache folder HF_HOME sets."""
    import subprocess

    import huggingface_hub.constants

    from helpers import write_photo_folder

    root = write_photo_folder(tmp_path / "photos" / "train", 4)
    env = {**env, "HF_HOME": str(tmp_path / "hf"), "ACCELERATE_RECIPES_CACHE": str(tmp_path / "cache")}
    args = ["--dataset", root.parent, "--weights", "DEFAULT", "--workers", 0, "--output-dir", tmp_path / "run"]
    cmd = [sys.executable, str(REPO / "recipes" / "finetune_folder.py"), "--model", "hf-hub:timm/resnet10t.c3_in1k"]
    launched = subprocess.run(
        [*cmd, *map(str, args)], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=180, check=False
    )
    # the same for a registry name's weights, in this process (whose Hub cache constant HF_HOME set at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    in_process = run_in_process("finetune_folder", ["--model", "timm/resnet10t.c3_in1k", *args], env)
    for proc in (launched, in_process):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert str(tmp_path / "hf" / "hub") in paragraph and "hf download timm/resnet10t.c3_in1k" in paragraph
        assert "HF_HUB_OFFLINE is set" in paragraph, paragraph
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # the photos were not read
    assert not (tmp_path / "run").exists()


def test_a_mistyped_model_gets_its_closest_names_in_one_paragraph(tmp_path, env, photos_like):
    """Neither torchvision's nor timm's: the closest names of both, not the list of 80 torchvision names; a timm
    architecture with a tag it lacks: its tags."""
    with pytest.raises(ConfigError) as caught:
        vision.check_name("resnet10tt")
    message = str(caught.value)
    assert "did you mean" in message and "resnet10t" in message and "\n" not in message, message
    assert "wide_resnet101_2" not in message and len(message) < 800, message
    with pytest.raises(ConfigError, match=r"resnet10t has no pretrained tag 'a1_in1k'; its tags: c3_in1k"):
        vision.check_name("timm/resnet10t.a1_in1k")
    proc = run_in_process(
        "finetune_folder", ["--dataset", photos_like, "--model", "mobilenetv4_conv_smal", "--output-dir", tmp_path], env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "did you mean mobilenetv4_conv_small" in paragraph, paragraph


def test_without_timm_a_name_torchvision_lacks_says_what_to_install(monkeypatch):
    """timm is an extra: without it, a timm name (or a typo of a torchvision one) is one paragraph with torchvision's
    closest names and the install line; torchvision's names still resolve."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    assert vision.check_name("resnet18") == "torchvision"
    for name, close in (("resnet10t", "resnet18"), ("resnt18", "resnet18")):
        with pytest.raises(ConfigError) as caught:
            vision.check_name(name)
        message = str(caught.value)
        assert "pip install -e '.[timm]'" in message and "did you mean" in message and close in message, message
        assert "\n" not in message
    with pytest.raises(ConfigError, match=r"timm models need the timm package"):
        vision.resolve("timm/resnet10t.c3_in1k", "")


def test_without_transformers_a_transformers_folder_says_what_to_install(tmp_path, monkeypatch):
    folder = tmp_path / "vit"
    folder.mkdir()
    config = {"model_type": "vit", "architectures": ["ViTForImageClassification"]}
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ConfigError) as caught:
        vision.resolve(str(folder), "DEFAULT")
    message = str(caught.value)
    assert "pip install 'accelerate-recipes[transformers]'" in message and str(folder) in message, message
    assert "\n" not in message


def tiny_resnet(folder):
    """A tiny ResNet image classifier as save_pretrained writes it: transformers' own architecture, no code."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=5)
    transformers.AutoModelForImageClassification.from_config(config).save_pretrained(str(folder))
    return folder


def with_its_own_code(folder, model_type=None):
    """The folder's config.json made to ask for Python shipped beside it, as a Hub repo with custom code does
    (``auto_map`` naming classes of modeling_custom.py; with ``model_type`` one transformers lacks, transformers asks
    whether to run it). Importing that file writes the marker file the folder's code ran, which is returned."""
    marker = folder.parent / f"{folder.name}-code-ran"
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_custom.CustomConfig",
        "AutoModelForImageClassification": "modeling_custom.CustomClassifier",
    }
    if model_type:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text(
        f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('ran')\n\n"
        "from transformers import ResNetConfig as CustomConfig\n"
        "from transformers import ResNetForImageClassification as CustomClassifier\n"
    )
    return marker


def answering_yes(cmd, env):
    """``cmd`` run with stdin answering "y" to any question (a terminal's user, or a batch job's piped input)."""
    return subprocess.run(
        [sys.executable, *map(str, cmd)],
        input="y\n",
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def refused_as_code(proc, folder, marker):
    """Exit 2 with one paragraph naming the folder's code; transformers neither asked nor ran it."""
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said[-4000:]
    assert "[y/N]" not in said and "upgrade" not in said.lower() and "trust_remote_code" not in said, said[-4000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert str(folder) in paragraph and "custom code" in paragraph and "modeling_custom" in paragraph, paragraph
    assert "never run" in paragraph and "save_pretrained" in paragraph, paragraph
    assert not marker.exists(), "the folder's code ran"


def test_a_transformers_folder_with_its_own_code_is_refused_and_its_code_never_runs(tmp_path, env):
    """A folder whose config.json names classes of a .py file beside it (auto_map): refused before transformers reads
    it, in one paragraph, with no question asked: even with stdin answering "y" its code does not run. So is one
    of transformers' own model_type with an auto_map (transformers would quietly use its own class), and one whose
    model_type transformers lacks with a .py file and no auto_map."""
    from helpers import write_photo_folder

    photos = write_photo_folder(tmp_path / "photos" / "train", 4).parent
    args = ["--dataset", photos, *SMALL["finetune_folder"], "--epochs", 1, "--batch-size", 8, "--max-steps", 2]
    asks = tiny_resnet(tmp_path / "asks")
    marker = with_its_own_code(asks, model_type="custom-resnet")  # transformers would ask, and run it on "y"
    proc = answering_yes(
        [REPO / "recipes" / "finetune_folder.py", "--model", asks, *args, "--output-dir", tmp_path / "a"], env
    )
    refused_as_code(proc, asks, marker)
    own_type = tiny_resnet(tmp_path / "own-type")
    marker = with_its_own_code(own_type)  # model_type resnet: transformers' own, the auto_map beside it
    proc = run_in_process("finetune_folder", ["--model", own_type, *args, "--output-dir", tmp_path / "b"], env)
    refused_as_code(proc, own_type, marker)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    unknown = tiny_resnet(tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "custom-resnet"}))
    (unknown / "modeling_custom.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(ConfigError) as caught:
        vision.check_name(str(unknown))
    message = str(caught.value)
    assert "custom code" in message and "modeling_custom.py" in message and "never run" in message, message
    assert "\n" not in message and "upgrade" not in message.lower(), message


def test_a_run_whose_model_folder_asks_to_run_its_code_is_refused_by_predict_export_and_eval_only(
    tmp_path, env, capsys
):
    """A finished run of a transformers folder, whose folder then asks to run its own code (as a crafted model.json
    or a replaced folder would have it): predict, export and --eval-only, which rebuild the model from the run's
    model.json and config.json, refuse it as --model does, and the code does not run, stdin answering "y"."""
    from common.tools import export

    from helpers import write_photo_folder

    photos = write_photo_folder(tmp_path / "photos" / "train", 4).parent
    folder = tiny_resnet(tmp_path / "model")
    args = ["--dataset", photos, "--model", folder, *SMALL["finetune_folder"], "--epochs", 1, "--batch-size", 8]
    check_ok(run_in_process("finetune_folder", [*args, "--max-steps", 2, "--output-dir", tmp_path / "run"], env))
    final = tmp_path / "run" / "final"
    assert json.loads((final / "model.json").read_text())["config"]["model"] == str(folder)
    marker = with_its_own_code(folder, model_type="custom-resnet")
    predicted = answering_yes(["-m", "common.tools.predict", final, photos / "train" / "ant"], env)
    refused_as_code(predicted, folder, marker)
    scored = answering_yes([REPO / "recipes" / "finetune_folder.py", "--eval-only", "--checkpoint", final], env)
    refused_as_code(scored, folder, marker)
    capsys.readouterr()
    code = export.main([str(final), "--onnx", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and "custom code" in err and "upgrade" not in err.lower() and not marker.exists(), err
    assert not (tmp_path / "m.onnx").exists()
