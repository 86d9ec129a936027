"""The decoded-image cache and the data error messages: damage is detected and decoded again, writes are
durable and follow the umask, processes racing for the cache decode once and share one memory-mapped copy,
the held-out split is an index (no copy), and layout mistakes get messages that name their fix."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.config import CommonConfig
from common.data.decoded import DataError, ImageSplit, TensorImages, hold_out, load_image_data, make_loader

from helpers import REPO, recipe_env, write_image_folder, write_parquet_dataset


@pytest.fixture(autouse=True)
def private_hf_cache(tmp_path, monkeypatch):
    """datasets' arrow cache under the test's folder, and no network."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Hub-layout parquet, 1x28x28, 4 classes: train 60 (no validation split), test 20."""
    return write_parquet_dataset(tmp_path_factory.mktemp("small"), {"train": 60, "test": 20})


def config(dataset, cache_dir, **kw) -> CommonConfig:
    return CommonConfig(dataset=str(dataset), cache_dir=str(cache_dir), **kw)


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)


def load(dataset, cache_dir, logs=None, **kw):
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # what common.console.say printed
        data = load_image_data(config(dataset, cache_dir, **kw), "", True)
    if logs is not None:
        logs.extend(said.getvalue().splitlines())
    return data


# --- 11.11: damage, durability, stale temporary files ---------------------------------------------


@pytest.mark.parametrize("keep", [0, 7, 1000])
def test_damaged_cache_is_reported_once_and_decoded_again(small, tmp_path, keep):
    first = load(small, tmp_path / "c")
    ref = first.train.images, first.val.labels  # gathered copies: truncating a mapped file would fault its pages
    del first
    train_file = cache_files(tmp_path / "c")[-1]  # the larger file is train
    with open(train_file, "r+b") as f:
        f.truncate(keep)
    stale = train_file.with_name(train_file.name + ".otherhost.4242.tmp")
    stale.write_bytes(b"half a file from a killed run")
    logs = []
    again = load(small, tmp_path / "c", logs)
    damaged = [line for line in logs if "is damaged" in line]
    assert len(damaged) == 1 and str(train_file) in damaged[0], logs
    assert torch.equal(again.train.images, ref[0]) and torch.equal(again.val.labels, ref[1])
    assert not stale.exists()
    logs.clear()
    load(small, tmp_path / "c", logs)  # repaired: read, not decoded
    assert not any("decoding" in line or "is damaged" in line for line in logs), logs


def test_a_cache_folder_truncated_whole_recovers(small, tmp_path):
    """A kill or a full disk can leave every file of the cache folder cut short, the datasets arrow copy kept there
    too: the next load decodes again from the dataset's files (the arrow copy rebuilt, said so) instead of exiting 2
    and telling the user to lay out their dataset like the Hub repo."""
    first = load(small, tmp_path / "c")
    ref = first.train.images.clone(), first.val.labels.clone()
    del first
    cut = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and p.stat().st_size > 64]
    assert any(p.suffix == ".arrow" for p in cut), cut
    for p in cut:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 3)
    logs = []
    again = load(small, tmp_path / "c", logs)
    assert torch.equal(again.train.images, ref[0]) and torch.equal(again.val.labels, ref[1])


def test_cache_is_fsynced_before_it_is_renamed_into_place(small, tmp_path, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    load(small, tmp_path / "c")
    for target in cache_files(tmp_path / "c"):
        rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(target))
        assert ("fsync", events[rename][1]) in events[:rename], events


def test_a_symlink_planted_at_a_temporary_name_is_not_followed(small, tmp_path, monkeypatch):
    """In a group-shared cache folder someone plants symlinks where this process will write its temporary
    files (the names are predictable: file, host, PID), while it decodes (after its clean-up of stale
    temporary files): the write replaces the link, the file it pointed at is untouched, and the cache is
    written and read back as usual."""
    import socket

    import common.data.decoded as decoded_module

    first = load(small, tmp_path / "c")
    names = [p.name for p in cache_files(tmp_path / "c")]
    ref = first.train.images.clone()
    del first
    for p in (tmp_path / "c").iterdir():
        if p.is_file():  # the decoded splits and their index (datasets/ holds datasets' own arrow copy)
            p.unlink()
    victim = tmp_path / "someone_elses_file"
    victim.write_text("precious")
    real_decode = decoded_module.decode_split

    def decode_while_someone_plants_links(*args, **kwargs):
        for name in names:
            link = tmp_path / "c" / f"{name}.{socket.gethostname()}.{os.getpid()}.tmp"
            if not link.is_symlink():
                link.symlink_to(victim)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(decoded_module, "decode_split", decode_while_someone_plants_links)
    again = load(small, tmp_path / "c")
    assert victim.read_text() == "precious"
    assert torch.equal(again.train.images, ref)
    assert sorted(p.name for p in cache_files(tmp_path / "c")) == sorted(names)


def test_the_cache_is_a_plain_safetensors_file(small, tmp_path):
    """The decoded split is stored in a library's format: any safetensors reader gets the images and labels back."""
    from safetensors.torch import load_file

    data = load(small, tmp_path / "c", val_fraction=0.0)
    saved = load_file(str(cache_files(tmp_path / "c")[-1]))
    assert torch.equal(saved["images"], data.train.images) and torch.equal(saved["labels"], data.train.labels)


# --- 11.13: permissions follow the umask ------------------------------------------------------------


def test_cache_and_lock_files_follow_the_umask(small, tmp_path):
    old = os.umask(0o002)  # a group-shared cache
    try:
        load(small, tmp_path / "c")
    finally:
        os.umask(old)
    files = cache_files(tmp_path / "c")
    locks = sorted((tmp_path / "c").glob("*.lock"))
    assert len(files) == 2 and len(locks) == 2
    for p in files + locks:
        assert p.stat().st_mode & 0o777 == 0o664, (p, oct(p.stat().st_mode))


# --- launch cost: an unchanged local folder is read from the cache without importing datasets ------------

SECOND_LOAD = textwrap.dedent("""
    import sys
    from common.config import CommonConfig
    from common.data.decoded import load_image_data

    data = load_image_data(CommonConfig(dataset=sys.argv[1], cache_dir=sys.argv[2]), "", True)
    print("datasets imported:", "datasets" in sys.modules, "train", len(data.train), "test", len(data.test),
          "classes", ",".join(data.class_names), "sum", int(data.train.images.sum()))
""")


def test_an_unchanged_folder_is_read_without_datasets_and_a_changed_one_is_decoded_again(tmp_path):
    source = write_parquet_dataset(tmp_path / "src", {"train": 40, "test": 12})

    def second_load():
        proc = subprocess.run(
            [sys.executable, "-c", SECOND_LOAD, str(source), str(tmp_path / "c")],
            cwd=str(REPO),
            env=recipe_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    first = second_load()
    assert "datasets imported: True" in first and "decoding" in first
    again = second_load()
    assert "datasets imported: False" in again and "decoding" not in again
    assert again.splitlines()[-1].split(" train ")[1] == first.splitlines()[-1].split(" train ")[1]  # same data
    # the data changes (a new file with more rows): the shortcut must not serve the old images
    write_parquet_dataset(tmp_path / "src", {"train": 48, "test": 12}, seed=5)
    changed = second_load()
    assert "datasets imported: True" in changed and "(48 images)" in changed, changed


def test_a_table_folder_is_one_identity_kept_by_a_chmod_or_a_readme_and_its_own_per_folder(tmp_path):
    """The small-image recipes key a local table folder as the photo recipe does (``common.data.table_copies``: its
    data files and its resolved path): a chmod or an added README.md keeps the decoded cache (read, not decoded, with
    datasets' arrow copy shared with the photo recipe), a rewritten table is read again, and two folders holding the
    same tables (or none, only a README, as benchmarks/gpu_data.py installs them) have indexes of their own."""
    from common.data import cache, table_copies

    source = write_parquet_dataset(tmp_path / "src", {"train": 40, "test": 12})
    first = load(source, tmp_path / "c")
    os.chmod(source / "data", 0o755)  # a new change time
    (source / "README.md").write_text("# my dataset\n")
    logs = []
    again = load(source, tmp_path / "c", logs)
    assert not any("decoding" in line for line in logs), logs
    assert torch.equal(again.train.images, first.train.images)
    copies = sorted(p.name for p in (tmp_path / "c" / "datasets").iterdir() if p.is_dir())
    assert copies == [table_copies.copy_dir(tmp_path / "c", source, table_copies.table_state(source)).name]
    write_parquet_dataset(source, {"train": 48, "test": 12}, seed=5)  # rows rewritten
    logs.clear()
    assert len(load(source, tmp_path / "c", logs, val_fraction=0.0).train) == 48
    assert any("decoding the train split" in line for line in logs), logs
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
        (folder / "README.txt").write_text("no images here\n")
    identities = [table_copies.copy_dir(tmp_path / "c", f, table_copies.table_state(f)).name for f in folders]
    indexes = {cache.source_index_path(tmp_path / "c", i, {"size": 0}) for i in identities}
    assert len(indexes) == 2


# --- 11.12: every process calls at once; one decodes per cache file, the others wait on its lock -------

RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import common.data.decoded as data
    from common.config import CommonConfig

    cache, rank, out, go, *datasets = sys.argv[1:]
    real = data.decode_split

    def counted(split, *args, **kw):
        with open(Path(out) / "decodes", "a") as f:
            f.write(f"{Path(dataset).name}:{args[-1].split()[1]}\\n")  # `what` is "the <split> split of ..."
        time.sleep(1.0)  # hold the lock long enough that the peer really waits on it
        return real(split, *args, **kw)

    data.decode_split = counted
    # a two-party barrier: each process, once imported, says it is ready, then waits until both are (its imports and
    # the peer's take seconds, which a fixed head start would not cover), so the loads below really start together
    ready = Path(go) / f"ready-{rank}"
    ready.write_text(repr(time.time()))
    while not all((Path(go) / f"ready-{r}").exists() for r in "01"):
        time.sleep(0.005)
    (Path(go) / f"passed-{rank}").write_text(repr(time.time()))
    results = []
    for dataset in datasets:
        try:
            d = data.load_image_data(CommonConfig(dataset=dataset, cache_dir=cache), "", rank == "0")
            results.append({"train": d.train.images.sum().item(), "val": d.val.labels.tolist(),
                            "test": d.test.images.sum().item()})
        except data.DataError as err:
            results.append({"error": str(err)})
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def raced(small, tmp_path_factory):
    """Two processes load the same two datasets at the same moment with one cache directory: a good one
    (train and test splits), then an image folder with a corrupt image."""
    tmp = tmp_path_factory.mktemp("race")
    bad = write_image_folder(tmp / "bad", n_per_class=3)
    (bad / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    go = tmp / "go"
    go.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp / "c"), str(rank), str(tmp), str(go), str(small), str(bad)],
            env=recipe_env(tmp),
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    decodes = (tmp / "decodes").read_text().split() if (tmp / "decodes").exists() else []
    # when each process said it was ready and when it passed the barrier (None: it never did)
    times = {
        what: [float((go / f"{what}-{r}").read_text()) if (go / f"{what}-{r}").exists() else None for r in (0, 1)]
        for what in ("ready", "passed")
    }
    return [o[0] for o in outs], [json.loads(o[0].strip().splitlines()[-1]) for o in outs], decodes, small.name, times


def test_two_processes_racing_for_the_cache_decode_each_split_once(raced):
    """Both processes passed the start barrier, each only once both were ready (so their loads raced); each split was
    decoded once, and both got the same data."""
    stdouts, results, decodes, good, times = raced
    assert None not in times["passed"], times  # both passed it
    assert min(times["passed"]) >= max(times["ready"]), times  # neither went on before the other was ready
    assert results[0][0] == results[1][0] and "error" not in results[0][0]
    assert sorted(d for d in decodes if d.startswith(good)) == [f"{good}:test", f"{good}:train"], decodes
    assert stdouts[1].strip().count("\n") == 0  # only the main process prints: here the results line alone


def test_a_waiting_process_raises_its_peers_data_error(raced):
    stdouts, results, decodes, good, _ = raced
    for r in results:
        assert "broken.png" in r[1]["error"], r
    assert decodes.count("bad:train") == 1, decodes  # the waiter took the peer's error instead of failing alike


# --- 11.14: one memory-mapped copy per node; the held-out split is an index ------------------------------


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def test_images_are_memory_mapped_and_the_hold_out_copies_nothing(small, tmp_path):
    data = load(small, tmp_path / "c", val_fraction=0.25, seed=3)
    full = load(small, tmp_path / "c", val_fraction=0.0).train
    train_file = cache_files(tmp_path / "c")[-1]
    if Path("/proc/self/maps").exists():
        assert str(train_file) in mapped_files()
    assert data.train.source_images.data_ptr() == data.val.source_images.data_ptr()  # one tensor, two indexes
    assert data.train.index is not None and len(data.train.source_images) == 60
    assert len(data.train) == 45 and len(data.val) == 15

    # the same rows, in the same order, as the copying hold-out gave
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(3))
    val_idx, train_idx = perm[:15].sort().values, perm[15:].sort().values
    assert torch.equal(data.train.images, full.images[train_idx])
    assert torch.equal(data.val.labels, full.labels[val_idx])
    assert torch.equal(data.train.images_at(slice(0, 5)), full.images[train_idx[:5]])
    for split in (data.train, data.val):
        for device in (None, "cpu"):
            got = list(make_loader(split, 7, train=False, device=device))
            assert torch.equal(torch.cat([b[0] for b in got]), split.images)
            assert torch.equal(torch.cat([b[1] for b in got]), split.labels)
        ds = TensorImages(split)
        assert torch.equal(ds.__getitems__([4, 0, 4])[0], torch.stack([ds[4][0], ds[0][0], ds[4][0]]))
    assert sum(len(b[1]) for b in make_loader(data.train, 8, train=True)) == 40  # drop_last over 45

    # copy-on-write: writing to the mapped images never changes the cache
    data.train.source_images[0] += 1
    assert torch.equal(load(small, tmp_path / "c", val_fraction=0.0).train.images, full.images)


def test_hold_out_of_an_indexed_split_and_of_a_plain_one():
    images = torch.arange(20 * 2 * 2, dtype=torch.uint8).view(20, 1, 2, 2)  # image i holds 4i .. 4i+3
    plain = ImageSplit(images, torch.arange(20) % 2)
    a_train, a_val = hold_out(plain, 0.25, 0)
    sub = plain.select(torch.arange(10, 20))
    b_train, b_val = hold_out(sub, 0.2, 1)
    assert len(a_train) + len(a_val) == 20 and a_train.source_images is images
    rows = lambda split: (split.images[:, 0, 0, 0] // 4).tolist()  # noqa: E731  (which source image each row is)
    assert b_val.index.tolist() == rows(b_val) and b_val.labels.tolist() == [r % 2 for r in rows(b_val)]
    assert sorted(rows(b_train) + rows(b_val)) == list(range(10, 20))


# --- 12.9: messages that name the fix ----------------------------------------------------------------


def test_flat_image_folder_says_one_sub_folder_per_class(tmp_path):
    from PIL import Image

    root = tmp_path / "flat"
    root.mkdir()
    for i in range(6):
        Image.new("L", (8, 8), i * 20).save(root / f"{i}.png")
    with pytest.raises(DataError, match="sub-folder named after the class") as err:
        load(root, tmp_path / "c")
    assert "--label-column" not in str(err.value)


def test_class_folders_without_images_say_no_images_and_the_extensions_read(tmp_path):
    for cls in ("cat", "dog"):
        (tmp_path / "d" / cls).mkdir(parents=True)
        (tmp_path / "d" / cls / "notes.txt").write_text("not an image\n")
    with pytest.raises(DataError, match="No images were found") as err:
        load(tmp_path / "d", tmp_path / "c")
    assert ".png" in str(err.value) and ".jpg" in str(err.value) and ".txt" in str(err.value)


def test_parquet_files_that_are_git_lfs_pointers_say_git_lfs_pull(tmp_path):
    (tmp_path / "d" / "data").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "d" / "data" / f"{split}-00000-of-00001.parquet").write_text(
            "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n"
        )
    with pytest.raises(DataError, match="git lfs pull") as err:
        load(tmp_path / "d", tmp_path / "c")
    assert "git-lfs" in str(err.value) and "magic bytes" not in str(err.value)


def test_a_table_is_checked_before_any_image_is_decoded(tmp_path, monkeypatch):
    """A column of no images, a test row with no label, a test label train lacks: each one paragraph, said before a
    single image is decoded (the labels are read alone, by the rule the photo recipe follows)."""
    from datasets import Dataset, Features, Image, Value
    from PIL import Image as PILImage

    import common.data.decoded as decoded_module

    monkeypatch.setattr(decoded_module, "decode_split", lambda *a, **kw: pytest.fail("decoded before the checks"))
    img, feats = PILImage.new("L", (8, 8)), Features({"image": Image(), "label": Value("int64"), "n": Value("int64")})
    for case, test_labels, needle in (
        ("column", [0, 1], r"holds Value\('int64'\), not images"),
        ("unlabelled", [0, None], "Row 1 of the test split of .* has no label"),
        ("unknown", [0, 5], "the label 5, which train does not have .*row 1.*outside the 2 classes"),
    ):
        root = tmp_path / case / "data"
        root.mkdir(parents=True)
        for split, labels in (("train", [0, 1] * 3), ("test", test_labels)):
            Dataset.from_dict(
                {"image": [img] * len(labels), "label": labels, "n": list(range(len(labels)))}, features=feats
            ).to_parquet(str(root / f"{split}-00000-of-00001.parquet"))
        with pytest.raises(DataError, match=needle):
            load(root.parent, tmp_path / "c", image_column="n" if case == "column" else "")


def test_every_corrupt_image_of_a_split_is_reported_in_one_pass(tmp_path):
    root = write_image_folder(tmp_path / "imgs", n_per_class=3)
    bad = [root / "dog" / "broken.png", root / "cat" / "empty.png", root / "frog" / "text.png"]
    bad[0].write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    bad[1].write_bytes(b"")
    bad[2].write_text("hello")
    with pytest.raises(DataError) as err:
        load(root, tmp_path / "c")
    msg = str(err.value)
    assert "3 of the 12 images" in msg and "Remove or replace" in msg
    assert all(p.name in msg for p in bad), msg
    assert not list((tmp_path / "c").glob("*.safetensors"))  # nothing cached for a split that failed


def test_on_a_gpu_the_decoded_data_goes_to_the_device_when_it_fits(small, tmp_path, monkeypatch):
    """Without --data-on-device: on the GPU when the decoded images take under a quarter of its free memory, in
    host memory otherwise; an explicit flag decides; a CPU run is unchanged."""
    from types import SimpleNamespace

    from common.data.decoded import place_on_device

    data = load(small, tmp_path / "c")
    need = data.train.source_images.numel() + data.test.source_images.numel()
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    for free, expect in ((need * 5, True), (need * 3, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 2 * f))
        cfg = config(small, tmp_path / "c")
        data.on_device = False
        note = place_on_device(cfg, gpu, data)
        assert cfg.data_on_device is False  # the setting stays as parsed; the decision is the data's
        assert data.on_device is expect and ("data on the GPU" in note) is expect, note
    cfg = config(small, tmp_path / "c")
    cfg.explicit = {"data_on_device"}
    data.on_device = False
    assert place_on_device(cfg, gpu, data) == "" and data.on_device is False
    cfg = config(small, tmp_path / "c")
    assert place_on_device(cfg, SimpleNamespace(device=torch.device("cpu")), data) == "" and not data.on_device


def test_the_hold_out_keeps_a_training_image_of_every_class():
    """Before, the seeded hold-out could put a class wholly into validation (every one-image class it drew: with
    10,000 one-image classes, all 1,000 validation images were of classes never trained on), without a word. Now each
    such class gets its first drawn image back; where nothing would be left to validate on, one paragraph says so."""
    import torch

    from common.data.splits import ImageSplit, hold_out
    from common.errors import DataError

    labels = torch.tensor([0] * 30 + [1] * 30 + list(range(2, 42)))  # 40 one-image classes
    split = ImageSplit(torch.zeros(len(labels), 1, 2, 2, dtype=torch.uint8), labels)
    for seed in range(5):
        train, val = hold_out(split, 0.1, seed)
        assert set(train.labels.tolist()) == set(range(42)), seed
        assert len(train) + len(val) == len(split) and len(val) >= 1
        assert not set(train.index.tolist()) & set(val.index.tolist())
        assert set(val.labels.tolist()) <= {0, 1}
    one_each = ImageSplit(torch.zeros(50, 1, 2, 2, dtype=torch.uint8), torch.arange(50))
    with pytest.raises(DataError, match="only one"):
        hold_out(one_each, 0.1, 0)
    # a split with no such class is drawn as before (the same images held out: runs and their resumes unchanged)
    plain = ImageSplit(torch.zeros(60, 1, 2, 2, dtype=torch.uint8), torch.arange(60) % 3)
    _, val = hold_out(plain, 0.1, 0)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(0))
    assert val.index.tolist() == perm[:6].sort().values.tolist()
