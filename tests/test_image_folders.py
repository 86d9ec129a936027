"""A user's own image folder is read by one rule, torchvision's ImageFolder (common.data.folders): split folders only
at the top level beside train/, the class is the first folder under the split root, any folder name is a
class. Pixels are read as the file holds them (16-bit scaled, transparency flattened, EXIF orientation), the
channel count is decided over the whole split, a replaced file is decoded afresh, and every layout that can't
be read one way is refused in one paragraph. Most cases load the folder in this process (the real loading
code, no recipe); the eval-only and 2-process cases run real recipe processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import CommonConfig
from common.data.decoded import DataError, load_image_data

from helpers import ACCELERATE, CONFIGS, REPO, free_port, learnable_images, run_in_process, write_image_folder


def load(root, tmp_path, logs=None, **kw):
    cfg = CommonConfig(dataset=str(root), cache_dir=str(tmp_path / "cache"), **kw)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # what common.console.say printed
        data = load_image_data(cfg, "", True)
    if logs is not None:
        logs.extend(said.getvalue().splitlines())
    return data


def all_images(data) -> list[bytes]:
    """Every image of every split as bytes, to tell which split an image ended up in."""
    return [
        img.numpy().tobytes()
        for split in (data.train, data.val, data.test)
        if split is not None
        for img in split.images
    ]


def pixels_of(folder: Path) -> set[bytes]:
    return {np.asarray(Image.open(p).convert("RGB")).transpose(2, 0, 1).tobytes() for p in folder.rglob("*.png")}


# --- the layout rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("classes", [("valid", "invalid"), ("train", "other")])
def test_class_folders_named_like_splits_stay_in_their_split(tmp_path, classes):
    """train/valid/, train/invalid/, test/valid/, test/invalid/ (a quality-control set), and a class named
    train under test/: 20 training images (2 held out), 4 test images, none crossing."""
    root = tmp_path / "qc"
    write_image_folder(root / "train", n_per_class=10, classes=classes)
    write_image_folder(root / "test", n_per_class=2, classes=classes, seed=7)
    data = load(root, tmp_path)
    assert data.class_names == sorted(classes)
    assert (len(data.train), len(data.val), len(data.test)) == (18, 2, 4)
    test_pixels = {img.numpy().tobytes() for img in data.test.images}
    assert test_pixels == pixels_of(root / "test")
    assert not test_pixels & {img.numpy().tobytes() for img in data.train.images}
    assert not test_pixels & {img.numpy().tobytes() for img in data.val.images}


def test_valid_and_invalid_side_by_side_without_train_are_two_classes(tmp_path):
    root = write_image_folder(tmp_path / "qc", n_per_class=10, classes=("valid", "invalid"))
    data = load(root, tmp_path)
    assert data.class_names == ["invalid", "valid"] and data.test is None
    assert len(data.train) + len(data.val) == 20


def test_every_image_below_a_class_folder_belongs_to_it_at_any_depth(tmp_path):
    """cat/2023/, cat/2024/, dog/2023/, dog/2024/: a cat-vs-dog classifier, not 2023-vs-2024."""
    images, labels = learnable_images(24, 2, (3, 16, 16))
    for i, (arr, k) in enumerate(zip(images, labels)):
        d = tmp_path / "pets" / ("cat", "dog")[k] / ("2023", "2024")[i % 2] / ("deep" if i % 3 == 0 else "")
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(d / f"{i}.png")
    data = load(tmp_path / "pets", tmp_path, val_fraction=0)
    assert data.class_names == ["cat", "dog"]
    assert sorted(data.train.labels.tolist()) == sorted(labels.tolist())


def test_links_back_up_the_tree_and_files_in_two_classes_are_refused_naming_them(tmp_path):
    """ants/up -> .. made every bee an ant too; two such links made the folder check walk forever. A link to a folder
    of the same class reads its images once; one into another class (or split) is refused."""
    import threading

    root = write_image_folder(tmp_path / "insects", n_per_class=4, classes=("ants", "bees"))
    os.symlink("..", root / "ants" / "up")
    with pytest.raises(DataError, match=r"ants/up is a link back up the tree"):
        load(root, tmp_path)
    os.symlink("..", root / "bees" / "up")  # two of them: before, os.walk went round forever
    outcome = []
    worker = threading.Thread(
        target=lambda: outcome.append(pytest.raises(DataError, load, root, tmp_path)), daemon=True
    )
    worker.start()
    worker.join(60)
    assert outcome and "link back up the tree" in str(outcome[0].value)
    for link in (root / "ants" / "up", root / "bees" / "up"):
        link.unlink()
    os.symlink(root / "bees", root / "ants" / "more")  # every bee reached as an ant
    with pytest.raises(DataError, match=r"reached from two classes or splits through links") as err:
        load(root, tmp_path)
    assert "ants/more/" in str(err.value)
    (root / "ants" / "more").unlink()
    (root / "ants" / "sub").mkdir()
    os.symlink(root / "ants" / "sub", root / "ants" / "again")  # the same class twice: read once
    Image.fromarray(learnable_images(1, 2, (3, 32, 32))[0][0]).save(root / "ants" / "sub" / "x.png")
    data = load(root, tmp_path, val_fraction=0)
    assert np.bincount(data.train.labels.numpy()).tolist() == [5, 4]


def test_a_folder_that_vanishes_while_it_is_read_is_one_paragraph(tmp_path, monkeypatch):
    """A sub-folder moved away while the scan walks (a sync tool, a colleague): was a raw FileNotFoundError."""
    from common.data import folders

    root = write_image_folder(tmp_path / "pets", n_per_class=3, classes=("cat", "dog"))
    (root / "cat" / "2023").mkdir()
    real = os.stat

    def gone(path, *a, **kw):
        if str(path).endswith("2023"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(folders.os, "stat", gone)
    with pytest.raises(DataError, match=r"cat/2023 vanished while the dataset was read"):
        folders.scan(root, "pets")


def test_class_folders_that_differ_only_in_letter_case_are_refused(tmp_path):
    root = write_image_folder(tmp_path / "pets", n_per_class=3, classes=("Cat", "cat", "dog"))
    with pytest.raises(DataError, match=r"differ only in letter case") as err:
        load(root, tmp_path)
    assert "Cat" in str(err.value) and "cat" in str(err.value)


def test_any_folder_name_is_a_class_name(tmp_path):
    names = ("__background__", "with space", "猫", "café", "valid")
    root = write_image_folder(tmp_path / "named", n_per_class=3, classes=names)
    data = load(root, tmp_path, val_fraction=0)
    assert data.class_names == sorted(names)
    assert np.bincount(data.train.labels.numpy()).tolist() == [3] * len(names)


def test_hidden_entries_and_non_images_are_skipped_and_counted(tmp_path):
    root = write_image_folder(tmp_path / "d", n_per_class=4, classes=("a", "b"))
    (root / "a" / ".DS_Store").write_bytes(b"\0")
    (root / ".thumbnails").mkdir()
    Image.new("RGB", (32, 32)).save(root / ".thumbnails" / "x.png")  # an image, but in a hidden folder
    (root / "b" / "notes.txt").write_text("hello")
    (root / "README.md").write_text("my data")
    data = load(root, tmp_path, val_fraction=0)
    assert len(data.train) == 8
    assert data.note == "skipped 2 hidden, 2 not images (.md 1, .txt 1)", data.note


# --- layouts refused, each with its fix ------------------------------------------------------------


def test_a_class_only_in_test_is_refused_with_its_name(tmp_path):
    root = tmp_path / "d"
    write_image_folder(root / "train", n_per_class=4, classes=("cat", "dog"))
    write_image_folder(root / "test", n_per_class=2, classes=("cat", "dog", "Dog"))
    with pytest.raises(DataError, match=r"test split .* class folder\(s\) Dog, which train does not have"):
        load(root, tmp_path)


@pytest.mark.parametrize(
    "layout,needles",
    [
        (
            {"train/cat": 3, "train/dog": 3, "train": 1},
            ["1 images lie directly in", "outside any class folder", "train/<class>/"],
        ),
        ({"train/cat": 3, "train/dog": 3, "extra/cat": 2}, ["has a train/ folder", "extra/", "belongs to no split"]),
        ({"train/cat": 3, "train/dog": 3, "val/cat": 1, "valid/cat": 1}, ["val/ and valid/", "validation split"]),
        ({"val/cat": 3, "test/cat": 3}, ["no train/ folder", "add train/"]),
        (
            {"cat": 3, "dog": 3, "test/cat": 2, "test/dog": 2},
            ["test/ holds folders named like the classes", "train/<class>/"],
        ),
        ({"train/cat": 3, "train/dog": 0, "train/bird": 3}, ["dog", "hold no images"]),
        ({"train/cat": 3}, ["single class folder"]),
    ],
)
def test_layouts_that_cannot_be_read_one_way_are_refused(tmp_path, layout, needles):
    root = tmp_path / "d"
    for folder, n in layout.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("L", (8, 8), 10 * i).save(root / folder / f"{i}.png")
    with pytest.raises(DataError) as err:
        load(root, tmp_path)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_a_flat_folder_with_metadata_csv_says_its_labels_are_not_read(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for i in range(4):
        Image.new("L", (8, 8), i).save(root / f"{i}.png")
    (root / "metadata.csv").write_text("file_name,label\n" + "".join(f"{i}.png,{i % 2}\n" for i in range(4)))
    with pytest.raises(DataError, match="not sorted into class folders") as err:
        load(root, tmp_path)
    assert "metadata.csv is not read" in str(err.value) and "under train/" not in str(err.value).split("(")[0]


def test_a_table_beside_images_says_it_is_not_read_and_how_it_would_be(tmp_path):
    """train.csv naming images/ files beside them: the folder is an image folder with one class (images/), refused;
    the paragraph says the table is not read and names the two ways to train on its labels. A refusal with no table
    beside it says nothing of tables."""
    root = tmp_path / "kaggle"
    (root / "images").mkdir(parents=True)
    for i in range(4):
        Image.new("L", (8, 8), i).save(root / "images" / f"{i}.png")
    (root / "train.csv").write_text("image,label\n" + "".join(f"images/{i}.png,{i % 2}\n" for i in range(4)))
    with pytest.raises(DataError, match="single class folder") as err:
        load(root, tmp_path)
    assert "train.csv beside the images is not read" in str(err.value) and "A table of labels" in str(err.value)
    (root / "train.csv").unlink()
    with pytest.raises(DataError, match="single class folder") as err:
        load(root, tmp_path)
    assert "not read" not in str(err.value)
    # docs/data.md's "A table of labels", word for word (its splits: the tables there are): a dataset of its own
    page = (REPO / "docs" / "data.md").read_text().split("### A table of labels", 1)[1]
    snippet = page.split("```python\n", 1)[1].split("```", 1)[0].replace('("train", "test")', '("train",)')
    (root / "train.csv").write_text("image,label\n" + "".join(f"images/{i}.png,{'ab'[i % 2]}\n" for i in range(4)))
    subprocess.run([sys.executable, "-c", snippet], cwd=root, check=True, capture_output=True)
    data = load(root / "my_dataset", tmp_path / "tables", val_fraction=0)
    assert data.class_names == ["a", "b"] and data.train.labels.tolist() == [0, 1, 0, 1]
    assert [int(img[0, 0, 0]) for img in data.train.images] == [0, 1, 2, 3]  # each image's own bytes, in order


# --- pixels ----------------------------------------------------------------------------------------


def test_16_bit_images_are_scaled_to_8_bits_not_clipped(tmp_path):
    ramp = (np.arange(16 * 16, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)  # 0 .. 65535
    for cls in ("a", "b"):
        (tmp_path / "d" / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(ramp).save(tmp_path / "d" / cls / f"{i}.png")
    assert Image.open(tmp_path / "d" / "a" / "0.png").mode.startswith("I")  # really a 16-bit file
    data = load(tmp_path / "d", tmp_path, val_fraction=0)
    assert data.shape == (1, 16, 16)
    assert torch.equal(data.train.images[0, 0], torch.arange(256, dtype=torch.uint8).view(16, 16))


def test_float_images_are_read_by_their_range_not_as_black(tmp_path):
    """A 32-bit float TIFF holding 0-1 reads as 0-255 (Pillow's convert('L') made it black); one in 0-255 as it is;
    any other range is named as unreadable."""
    root = tmp_path / "floats"
    ramp = np.linspace(0, 1, 16 * 16, dtype=np.float32).reshape(16, 16)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        Image.fromarray(ramp, "F").save(root / cls / "unit.tif")
        Image.fromarray(ramp * 255, "F").save(root / cls / "bytes.tif")
    data = load(root, tmp_path, val_fraction=0)
    expected = np.rint(ramp.astype(np.float64) * 255).astype(np.uint8)
    assert all(np.array_equal(img[0].numpy(), expected) for img in data.train.images)
    Image.fromarray(ramp * 1000, "F").save(root / "a" / "wide.tif")
    with pytest.raises(DataError, match=r"wide.tif \(a floating-point image with values from 0 to 1000"):
        load(root, tmp_path / "again", val_fraction=0)


def test_transparency_is_flattened_and_exif_orientation_applied(tmp_path):
    root = tmp_path / "d"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
    # a palette image, 8 wide and 16 high, whose colour 0 (red) is transparent and fills the bottom half
    pal = Image.new("P", (8, 16), 0)
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.paste(1, (0, 0, 8, 8))
    pal.save(root / "a" / "pal.png", transparency=0)
    # a photo stored 16 wide and 8 high (left half white, right half blue) with EXIF orientation 6, "rotate
    # 90 degrees clockwise to view": seen 8 wide and 16 high, white on top
    photo = Image.new("RGB", (16, 8), (0, 0, 255))
    photo.paste((255, 255, 255), (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = 6
    photo.save(root / "b" / "photo.jpg", exif=exif, quality=95)
    data = load(root, tmp_path, val_fraction=0)
    assert data.shape == (3, 16, 8)
    by_label = {int(k): img.float() for img, k in zip(data.train.images, data.train.labels)}
    assert by_label[0][:, 8:, :].sum() == 0  # transparent red is black, not red
    assert by_label[0][1, :8, :].min() == 255 and by_label[0][0, :8, :].max() == 0  # the opaque green stays
    assert by_label[1][:, :6, :].mean() > 230  # white on top
    assert by_label[1][2, 10:, :].mean() > 230 and by_label[1][0, 10:, :].mean() < 30  # blue below


@pytest.mark.parametrize("channels", [1, 3])
def test_predict_reads_a_file_as_the_decoded_cache_recipes_decode_it(tmp_path, channels):
    """A transparent palette image, a 16-bit one and a sideways photo, none at --image-size: predict's reading of each
    (``load_image`` at the model's input shape) is the very tensor training decoded from it."""
    from common.tools import predict

    root = tmp_path / "odd"
    for cls in ("a", "b", "c"):
        (root / cls).mkdir(parents=True)
    pal = Image.new("P", (40, 30), 0)
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.paste(1, (0, 0, 20, 30))
    pal.save(root / "a" / "pal.png", transparency=0)
    Image.fromarray(np.arange(20 * 20, dtype=np.uint16).reshape(20, 20) * 150).save(root / "b" / "deep.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 36, 3), dtype=np.uint8))
    photo.save(root / "c" / "photo.jpg", exif=exif, quality=90)
    data = load(root, tmp_path, val_fraction=0, image_size=28, channels=channels)
    files = [root / "a" / "pal.png", root / "b" / "deep.png", root / "c" / "photo.jpg"]
    for img, label in zip(data.train.images, data.train.labels):
        read, resized = predict.load_image(files[int(label)], (channels, 28, 28))
        assert resized and torch.equal(read, img), files[int(label)]


def test_channel_count_is_decided_over_the_whole_split(tmp_path):
    """One grey image among colour ones makes nothing grey, wherever it sorts; all grey stays grey."""
    for grey_name in ("a_first.png", "z_last.png"):
        root = write_image_folder(tmp_path / grey_name, n_per_class=3, classes=("x", "y"))
        Image.new("L", (32, 32), 77).save(root / "x" / grey_name)
        logs = []
        data = load(root, tmp_path / "c" / grey_name, logs=logs, val_fraction=0)
        assert data.shape == (3, 32, 32), grey_name
        grey = [img for img in data.train.images if int(img[0, 0, 0]) == 77 and bool((img == 77).all())]
        assert len(grey) == 1
        assert "1 grey image(s)" in data.note and "read as RGB" in data.note
    forced = load(tmp_path / "z_last.png", tmp_path / "c" / "forced", val_fraction=0, channels=1)
    assert forced.shape == (1, 32, 32)
    grey_only = write_image_folder(tmp_path / "g", n_per_class=3, classes=("x", "y"), shape=(1, 20, 20))
    assert load(grey_only, tmp_path / "c" / "g", val_fraction=0).shape == (1, 20, 20)


def test_a_grey_test_split_beside_colour_training_images_is_read_as_rgb(tmp_path):
    root = tmp_path / "d"
    write_image_folder(root / "train", n_per_class=3, classes=("x", "y"))
    write_image_folder(root / "test", n_per_class=2, classes=("x", "y"), shape=(1, 32, 32))
    logs = []
    data = load(root, tmp_path, logs=logs)
    assert data.test.image_shape == (3, 32, 32)
    assert any("test split(s) hold only grey images" in line for line in logs), logs


# --- changed data ----------------------------------------------------------------------------------


def test_a_replaced_image_with_its_old_mtime_is_decoded_afresh(tmp_path):
    root = tmp_path / "d"
    for cls, value in (("a", 10), ("b", 20)):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (16, 16), value).save(root / cls / f"{i}.bmp")  # BMP: same size whatever the pixels
    first = load(root, tmp_path, val_fraction=0)
    assert int(first.train.images.max()) == 20
    target = root / "b" / "0.bmp"
    st = target.stat()
    Image.new("L", (16, 16), 250).save(target)  # `cp -p` / `rsync` / `touch -r`: size and mtime as before
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = load(root, tmp_path, val_fraction=0)
    assert int(again.train.images.max()) == 250


# --- bad files: named, with their fix --------------------------------------------------------------


def test_a_decompression_bomb_and_a_damaged_bmp_are_named_in_one_error(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "d", n_per_class=3, classes=("a", "b"))
    Image.new("L", (200, 200)).save(root / "a" / "scan.png")
    good = root / "b" / "ok.bmp"
    Image.new("RGB", (32, 32)).save(good)
    damaged = root / "b" / "damaged.bmp"
    raw = bytearray(good.read_bytes())
    raw[14:18] = (7).to_bytes(4, "little")  # a header size no BMP has
    damaged.write_bytes(bytes(raw))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # 200x200 stands in for a 13500x13500 scan
    with pytest.raises(DataError) as err:
        load(root, tmp_path)
    msg = str(err.value)
    assert "2 of the 9 images" in msg and "scan.png" in msg and "damaged.bmp" in msg, msg
    assert "decompression bomb" in msg and "megapixels" in msg and "Remove or replace" in msg


def test_a_parquet_row_with_no_label_is_named(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Value
    from datasets import Image as ImageFeature

    img = Image.new("L", (28, 28))
    for label_type in (Value("int64"), ClassLabel(names=["a", "b"])):
        root = tmp_path / type(label_type).__name__
        (root / "data").mkdir(parents=True)
        Dataset.from_dict(
            {"image": [img] * 6, "label": [0, 1, 0, None, 1, 0]},
            features=Features({"image": ImageFeature(), "label": label_type}),
        ).to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
        with pytest.raises(DataError, match="no label") as err:
            load(root, tmp_path)
        assert "Fill in its label" in str(err.value)


# --- through the recipes -------------------------------------------------------------------------


def test_eval_only_refuses_a_folder_that_changed_since_the_run(tmp_path, env):
    root = write_image_folder(tmp_path / "d", n_per_class=20, classes=("a", "b"), shape=(1, 20, 20))
    run = tmp_path / "run"
    common = ["--dataset", root, "--batch-size", "8", "--epochs", "1", "--val-fraction", "0.2"]
    trained = run_in_process("mnist_convnet", [*common, "--output-dir", run], env, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    same = run_in_process("mnist_convnet", ["--eval-only", "--checkpoint", run / "final"], env, cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    Image.fromarray(learnable_images(1, 2, (1, 20, 20), seed=9)[0][0][..., 0]).save(root / "a" / "new.png")
    changed = run_in_process("mnist_convnet", ["--eval-only", "--checkpoint", run / "final"], env, cwd=tmp_path)
    assert changed.returncode == 2, changed.stdout[-2000:] + changed.stderr[-3000:]
    assert "Traceback" not in changed.stderr
    assert "The data differs" in changed.stderr and "train 32 -> 33" in changed.stderr, changed.stderr
    assert not list((run / "final").glob("eval-*-*.json"))  # nothing scored, no second result written
    (root / "a" / "new.png").unlink()
    assert (
        run_in_process("mnist_convnet", ["--eval-only", "--checkpoint", run / "final"], env, cwd=tmp_path).returncode
        == 0
    )
    # two files of one class swap names: counts and labels as before, but a held-out row now holds another image
    first, second = sorted((root / "a").glob("*.png"))[:2]
    first.rename(root / "a" / "swap")
    second.rename(first)
    (root / "a" / "swap").rename(second)
    swapped = run_in_process("mnist_convnet", ["--eval-only", "--checkpoint", run / "final"], env, cwd=tmp_path)
    assert swapped.returncode == 2 and "The data differs" in swapped.stderr, swapped.stderr[-3000:]
    assert f"a/{first.name} is another file now" in swapped.stderr, swapped.stderr


def test_a_bad_layout_through_a_recipe_is_one_paragraph_and_exit_2(tmp_path, env):
    root = tmp_path / "d"
    write_image_folder(root / "train", n_per_class=4, classes=("cat", "dog"))
    write_image_folder(root / "test", n_per_class=2, classes=("cat", "dog", "horse"))
    proc = run_in_process("cifar_cnn", ["--dataset", root, "--output-dir", tmp_path / "r"], env, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "horse" in proc.stderr and "which train does not have" in proc.stderr


RANK_VIEW = textwrap.dedent("""
    import json, os, sys
    from common.config import CommonConfig
    from common.data.decoded import data_fingerprint, load_image_data
    data = load_image_data(CommonConfig(dataset=sys.argv[1], cache_dir=sys.argv[2]), "",
                           os.environ["RANK"] == "0")
    print(json.dumps({"rank": int(os.environ["RANK"]), "fingerprint": data_fingerprint(data),
                      "classes": data.class_names, "sizes": [len(data.train), len(data.val), len(data.test)],
                      "test": data.test.labels.tolist()}), flush=True)
""")


def test_two_processes_read_the_same_split_of_a_folder(tmp_path, env):
    root = tmp_path / "qc"
    write_image_folder(root / "train", n_per_class=10, classes=("valid", "invalid", "train"))
    write_image_folder(root / "test", n_per_class=2, classes=("valid", "invalid", "train"), seed=3)
    script = tmp_path / "rank_view.py"
    script.write_text(RANK_VIEW)
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(CONFIGS / "cpu_2proc.yaml"),
        "--main_process_port",
        str(free_port()),
        str(script),
        str(root),
        str(tmp_path / "cache"),
    ]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    views = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(v["rank"] for v in views) == [0, 1], proc.stdout  # really two processes
    assert views[0] | {"rank": 0} == views[1] | {"rank": 0}
    assert views[0]["classes"] == ["invalid", "train", "valid"] and views[0]["sizes"] == [27, 3, 6]
