"""The photo recipe on Hugging Face image datasets: parquet files with an image column of encoded photos and a label
column (the layout of beans, food101, cats_vs_dogs), written here, read per batch like a folder of the same photos."""

import errno
import io
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from common.errors import DataError

from helpers import REPO, read_jsonl, run_in_process, write_photo_folder


def folder_to_parquet(
    folder: Path, out: Path, split: str = "train", string_labels: bool = False, replace: dict | None = None
) -> Path:
    """The photos of ``folder`` (<class>/<file>) as out/data/<split>-00000-of-00001.parquet: the image column holds
    each file's bytes (as on the Hub), the label a ClassLabel (or the class name, ``string_labels``). ``replace``:
    {row: bytes} written instead of that row's photo."""
    from datasets import ClassLabel, Dataset, Features, Image, Value

    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files = sorted(f for c in classes for f in (folder / c).iterdir())
    images = [{"bytes": (replace or {}).get(i, f.read_bytes()), "path": f.name} for i, f in enumerate(files)]
    labels = [f.parent.name if string_labels else classes.index(f.parent.name) for f in files]
    label = Value("string") if string_labels else ClassLabel(names=classes)
    ds = Dataset.from_dict({"image": images, "label": labels}, features=Features({"image": Image(), "label": label}))
    (out / "data").mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out / "data" / f"{split}-00000-of-00001.parquet"))
    return out


ARGS = ["--image-size", 32, "--batch-size", 8, "--epochs", 2, "--log-every", 1, "--workers", 1]
ONE_EPOCH = ["--image-size", 32, "--batch-size", 8, "--epochs", 1, "--workers", 0]


def test_a_parquet_image_dataset_trains_exactly_as_the_same_photos_in_a_folder(tmp_path, env):
    """Same photos, same order, same labels: the same per-step losses, the same held-out validation and score, the
    same preprocessing recorded for predict; decoded per batch (no decoded cache is written)."""
    folder = write_photo_folder(tmp_path / "photos", 8)
    tables = folder_to_parquet(folder, tmp_path / "hub_clone")
    runs = {}
    for kind, data in (("folder", folder), ("tables", tables)):
        cache = tmp_path / f"cache-{kind}"
        proc = run_in_process(
            "finetune_folder", ["--dataset", data, "--output-dir", tmp_path / kind, "--cache-dir", cache, *ARGS], env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[kind] = tmp_path / kind
        assert not list(cache.glob("*.safetensors"))  # nothing decoded kept
    losses = {
        k: [r["train/loss"] for r in read_jsonl(p / "metrics.jsonl") if "train/loss" in r] for k, p in runs.items()
    }
    assert len(losses["folder"]) == 2 * 3 and losses["tables"] == losses["folder"]
    finals = {k: json.loads((p / "summary.json").read_text())["final"] for k, p in runs.items()}
    assert finals["tables"] == finals["folder"] and finals["tables"]["val/count"] == 2
    cards = {k: json.loads((p / "final" / "model.json").read_text()) for k, p in runs.items()}
    assert cards["tables"]["preprocess"] == cards["folder"]["preprocess"]
    assert cards["tables"]["class_names"] == cards["folder"]["class_names"] == ["ant", "bee", "wasp"]


def test_a_resume_on_changed_tables_is_refused(tmp_path, env):
    """The tables' files (size and times) are in the data fingerprint: one photo's bytes changed, labels the same,
    and the resume is refused instead of training on other images than the run did."""
    folder = write_photo_folder(tmp_path / "photos", 6)
    tables = folder_to_parquet(folder, tmp_path / "clone")
    args = ["--dataset", tables, "--output-dir", tmp_path / "run", "--cache-dir", tmp_path / "cache", *ARGS]
    assert run_in_process("finetune_folder", [*args[:-6], "--epochs", 1, "--workers", 0], env).returncode == 0
    other = (folder / "ant" / "0.jpg").read_bytes()[:-2] + b"\xff\xd9"  # a photo with other bytes, same label
    folder_to_parquet(folder, tmp_path / "clone", replace={1: other})
    proc = run_in_process("finetune_folder", [*args, "--resume-from", "latest"], env)
    assert proc.returncode == 2 and "The data differs" in proc.stderr, proc.stderr[-2000:]


def test_labels_and_damaged_rows_of_tables_are_one_paragraph(tmp_path, env):
    folder = write_photo_folder(tmp_path / "photos", 4)
    # a damaged photo in row 5: skipped with a warning naming its row; 1 of 12 is past --max-damaged's 1%
    tables = folder_to_parquet(folder, tmp_path / "damaged", replace={5: b"\xff\xd8 not a photo"})
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", tables, "--output-dir", tmp_path / "r1", "--cache-dir", tmp_path / "c", *ARGS],
        env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "warning: skipped a damaged photo, row 5 of the train split" in proc.stderr, proc.stderr[-2000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "1 damaged photo met" in paragraph and "row 5 of the train split" in paragraph, paragraph
    # string labels: a validation label train does not have
    strings = folder_to_parquet(folder, tmp_path / "strings", string_labels=True)
    write_photo_folder(tmp_path / "val_photos", 2, classes=("ant", "hornet"))
    folder_to_parquet(tmp_path / "val_photos", tmp_path / "strings", split="validation", string_labels=True)
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", strings, "--output-dir", tmp_path / "r2", "--cache-dir", tmp_path / "c", *ARGS],
        env,
    )
    assert proc.returncode == 2 and "'hornet'" in proc.stderr and "which train does not have" in proc.stderr
    assert "Traceback" not in proc.stderr


LOAD = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {repo!r} + "/recipes")
    from accelerate import Accelerator
    from common.data.photo_sources import load_photos
    from common.data.photos import photo_loader
    from finetune_folder import Config
    cfg = Config(dataset=sys.argv[1], image_size=32, batch_size=16, workers=0, cache_dir=sys.argv[2])
    data = load_photos(cfg)
    loader = photo_loader(cfg, Accelerator(cpu=True), data.train)
    for images, labels, damaged in loader:  # every photo decoded once, per batch (damaged: those skipped)
        pass
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
""")


def test_memory_stays_flat_in_the_number_of_photos(tmp_path, env):
    """Peak memory reading and iterating 600 photos of 256x256 (113 MB decoded) is within 40 MB of reading 60: the
    photos are decoded per batch from the memory-mapped tables, never all at once."""
    from PIL import Image

    ramp = np.arange(256)
    peaks = {}
    for n in (60, 600):
        folder = tmp_path / f"p{n}"
        for i in range(n):
            (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            arr = np.stack([np.add.outer(ramp, ramp * (i % 7)) % 256] * 3, axis=-1).astype(np.uint8)
            Image.fromarray(arr).save(folder / f"c{i % 2}" / f"{i}.jpg", quality=85)
        tables = folder_to_parquet(folder, tmp_path / f"t{n}")
        proc = subprocess.run(
            [sys.executable, "-c", LOAD.format(repo=str(REPO)), str(tables), str(tmp_path / "c")],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[n] = int(proc.stdout.split()[-1])
    assert peaks[600] - peaks[60] < 40, peaks


# --- tables by the folder rules (issue 45) -------------------------------------------------------------------------


def photo_bytes(k: int) -> bytes:
    """A small PNG photo, its colour by ``k``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 32), ((53 * k) % 256, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


def write_table(out: Path, split: str, labels: list, label=None, cells: list | None = None) -> Path:
    """out/data/<split>-00000-of-00001.parquet written with pyarrow, as the Hub's files are: ``labels`` under the
    feature ``label`` (a ClassLabel of ant, bee, wasp unless given); ``cells`` the image column ({"bytes", "path"}
    each, a path without bytes allowed), else one embedded photo a row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import ClassLabel, Features, Image

    features = Features({"image": Image(), "label": label or ClassLabel(names=["ant", "bee", "wasp"])})
    schema = features.arrow_schema
    cells = cells or [{"bytes": photo_bytes(i), "path": f"{i}.png"} for i in range(len(labels))]
    table = pa.table(
        {
            "image": pa.array(cells, type=schema.field("image").type),
            "label": pa.array(labels, type=schema.field("label").type),
        },
        schema=schema,
    )
    (out / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "data" / f"{split}-00000-of-00001.parquet")
    return out


def load_tables(folder: Path, cache: Path):
    """(splits, class names, identity, note) of the table dataset ``folder``, as the photo recipe reads it."""
    from common.data.photo_tables import load_table_photos

    return load_table_photos(SimpleNamespace(image_column="", label_column="", image_size=32), str(folder), cache)


def arrow_copies(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "datasets").iterdir() if p.is_dir())


def test_copied_chmodded_or_documented_tables_resume_with_one_arrow_copy(tmp_path, env):
    """The tables' identity is their data files' relative paths, sizes, modification times and footers: the same mode
    set again (a new ctime), a README.md added and the clone restored from a `cp -a` copy resume, keeping one arrow
    copy in the cache. Before: "The data differs", and one more full arrow copy per state."""
    folder = write_photo_folder(tmp_path / "photos", 6)
    tables = folder_to_parquet(folder, tmp_path / "clone")
    cache = tmp_path / "cache"
    # one epoch: the resume of a finished run checks the data, and trains nothing more
    args = ["--dataset", tables, "--output-dir", tmp_path / "run", "--cache-dir", cache, *ONE_EPOCH]
    first = run_in_process("finetune_folder", args, env)
    assert first.returncode == 0, first.stderr[-2000:]
    for path in (tables / "data").iterdir():
        os.chmod(path, stat.S_IMODE(path.stat().st_mode))  # the same mode: only the change time moves
    (tables / "README.md").write_text("---\nlicense: mit\n---\n# my photos\n")
    subprocess.run(["cp", "-a", str(tables), str(tmp_path / "backup")], check=True)
    subprocess.run(["rm", "-r", str(tables)], check=True)
    subprocess.run(["cp", "-a", str(tmp_path / "backup"), str(tables)], check=True)  # restored: new inodes, ctimes
    proc = run_in_process("finetune_folder", [*args, "--resume-from", "latest"], env)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    assert len(arrow_copies(cache)) == 1, arrow_copies(cache)


def test_changed_tables_change_the_identity_and_their_arrow_copy(tmp_path):
    """Changed rows give another identity and another arrow copy (a chmod and an added README.md do not), so a copy
    made of the old rows is never read for the new ones."""
    tables, cache = tmp_path / "clone", tmp_path / "cache"
    write_table(tables, "train", [0, 1, 2, 0, 1, 2])
    first = load_tables(tables, cache)
    os.chmod(tables / "data" / "train-00000-of-00001.parquet", 0o644)
    (tables / "README.md").write_text("# notes\n")
    again = load_tables(tables, cache)
    assert again[2] == first[2] and len(arrow_copies(cache)) == 1
    write_table(tables, "train", [0, 1, 2, 0, 1, 1])  # one row's label changed
    changed = load_tables(tables, cache)
    assert changed[2] != first[2] and len(arrow_copies(cache)) == 2
    assert changed[0]["train"].labels.tolist() == [0, 1, 2, 0, 1, 1]


def test_the_identity_counts_the_files_datasets_reads_rows_from(tmp_path):
    """A folder of csv tables: a row rewritten under the old modification time changes the identity. A repository's
    parquet files are its rows; a json file beside them (dataset_infos.json) is not, and a changed one keeps it."""
    from common.data.table_copies import table_state

    csvs = tmp_path / "csvs"
    csvs.mkdir()
    (csvs / "train.csv").write_text("image,label\na.png,0\nb.png,1\n")
    before = table_state(csvs)
    mtime = (csvs / "train.csv").stat().st_mtime_ns
    (csvs / "train.csv").write_text("image,label\na.png,1\nb.png,1\n")
    os.utime(csvs / "train.csv", ns=(mtime, mtime))  # `cp -p`, `touch -r`: same size, same modification time
    assert table_state(csvs) != before
    repo = tmp_path / "clone"
    write_table(repo, "train", [0, 1, 2, 0, 1, 2])
    state = table_state(repo)
    (repo / "dataset_infos.json").write_text('{"default": {}}')
    assert table_state(repo) == state


NAMES = None  # a ClassLabel of ant, bee, wasp


@pytest.mark.parametrize(
    "case, splits, label, refused",
    [
        ("validation class not in train", {"train": [0, 1, 0, 1], "validation": [2, 0]}, NAMES, "'wasp', which train"),
        (
            "a class with no training row",
            {"train": [0, 1, 0, 1]},
            NAMES,
            r"class\(es\) wasp of .* have no row in train",
        ),
        ("one class in train", {"train": ["ant"] * 4}, "string", "single class"),
        ("labels with a gap", {"train": [0, 3, 0, 3]}, "int64", "make 4 classes, 2 of them with no training row"),
        ("a huge label", {"train": [0, 1, 999999, 0]}, "int64", "make 1,000,000 classes"),
        ("contiguous integers", {"train": [0, 1, 2, 1], "test": [2, 0]}, "int64", None),
        ("names as strings", {"train": ["ant", "bee", "ant"], "validation": ["bee"]}, "string", None),
        ("every name in train", {"train": [0, 1, 2], "validation": [1]}, NAMES, None),
    ],
)
def test_table_labels_follow_the_folder_rules(tmp_path, case, splits, label, refused):
    """Every class has a training row, train has two or more, no split has a class train lacks, integer labels are
    0..K-1 or named: what a folder refuses, a table refuses, in one paragraph. Before: all were read (labels {0, 3}
    made 4 classes, a label of 999999 a million, a validation class no training row)."""
    from datasets import Value

    for split, labels in splits.items():
        write_table(tmp_path / "t", split, labels, Value(label) if label else None)
    if refused is None:
        data, names = load_tables(tmp_path / "t", tmp_path / "cache")[:2]
        assert set(data) == {"validation" if s == "validation" else s for s in splits} and len(names) >= 2
        return
    with pytest.raises(DataError, match=refused) as err:
        load_tables(tmp_path / "t", tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_an_unlabelled_test_split_is_skipped_with_a_note_and_the_rest_trains(tmp_path, env):
    """A test split the Hub keeps unlabelled (every label -1, as ImageNet-1k's) is skipped with a note, and the run
    trains and validates on the rest; a split with only some rows unlabelled is refused, naming a row. Before: the
    whole dataset was refused ("outside the 3 classes ... Make every split use the training classes")."""
    tables = write_table(tmp_path / "clone", "train", [0, 1, 2] * 5)
    write_table(tables, "test", [-1] * 4)
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", tables, "--output-dir", tmp_path / "run", "--cache-dir", tmp_path / "c", *ONE_EPOCH]
        + ["--val-fraction", 0.2],
        env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the test split (4 rows) is skipped: none of its rows has a label" in proc.stdout, proc.stdout[-2000:]
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert final["val/count"] == 3 and not any(k.startswith("test/") for k in final), final
    partly = write_table(tmp_path / "partly", "train", [0, 1, 2] * 3)
    write_table(partly, "validation", [0, -1, 2, -1])
    with pytest.raises(DataError, match="Row 1 of the validation split of .* has no label .* and so do 1 other"):
        load_tables(partly, tmp_path / "c")


def test_a_full_cache_disk_is_named_not_blamed_on_the_layout(tmp_path, env, monkeypatch):
    """No space left while datasets writes its arrow copy: one paragraph naming the full cache folder and
    --cache-dir, the partial copy removed. Before: "datasets could not read ...: DatasetGenerationError. Pass a
    directory laid out like the Hub repo", and the retry wrote the copy once more."""
    from datasets.arrow_writer import ArrowWriter

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ArrowWriter, "write_table", full)
    monkeypatch.setattr(ArrowWriter, "write_row", full)
    tables, cache = write_table(tmp_path / "clone", "train", [0, 1, 2] * 2), tmp_path / "cache"
    proc = run_in_process(
        "finetune_folder", ["--dataset", tables, "--output-dir", tmp_path / "run", "--cache-dir", cache, *ARGS], env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"The disk holding the cache folder {cache} is full" in proc.stderr and "--cache-dir" in proc.stderr
    assert "laid out" not in proc.stderr and "could not read" not in proc.stderr, proc.stderr[-2000:]
    assert not list((cache / "datasets").rglob("*.arrow"))


def test_image_cells_holding_a_path_are_read_inside_the_dataset_folder_only(tmp_path, monkeypatch):
    """A cell with a path and no bytes is a file inside the dataset folder (a relative path is relative to it, not to
    the working directory); a path outside it, by name ('/...', '../') or through a link, is refused in one paragraph.
    A Hub dataset's cells may name the files datasets downloaded, nothing else. Before: any file the user can read was
    read (and a relative path from the working directory)."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # not the dataset folder
    secret = tmp_path / "private.png"
    Image.new("RGB", (40, 32), (250, 0, 0)).save(secret)
    tables = tmp_path / "clone"
    (tables / "images").mkdir(parents=True)
    for i in range(4):
        (tables / "images" / f"{i}.png").write_bytes(photo_bytes(i))
    (tables / "images" / "link.png").symlink_to(secret)
    inside = [{"bytes": None, "path": f"images/{i}.png"} for i in range(3)]
    inside.append({"bytes": None, "path": str(tables / "images" / "3.png")})  # absolute, inside: read
    for outside in (str(secret), "../private.png", "images/../../private.png"):
        write_table(tables, "train", [0, 1, 2, 0], cells=[*inside[:3], {"bytes": None, "path": outside}])
        with pytest.raises(DataError, match=r"1 image cell\(s\) of the train split .* outside the dataset folder"):
            load_tables(tables, tmp_path / "cache")
    write_table(tables, "train", [0, 1, 2, 0], cells=[*inside[:3], {"bytes": None, "path": "images/link.png"}])
    linked = load_tables(tables, tmp_path / "cache")[0]["train"]
    with pytest.raises(DataError, match="outside the dataset folder"):
        linked.source_at(3)
    write_table(tables, "train", [0, 1, 2, 0], cells=inside)
    data = load_tables(tables, tmp_path / "cache")[0]["train"]
    assert data.source_at(0) == str((tables / "images" / "0.png").resolve())
    assert data.try_read(0, 32)[0].shape[0] == 3 and data.try_read(3, 32)[0].shape[0] == 3
    from common.data.photo_tables import _inside, files_at

    hub = files_at(None)  # a Hub id: the folders datasets and the Hub download to
    assert _inside(hub, os.path.join(hub[1][0], "downloads", "a.png")) and not _inside(hub, str(secret))
    assert not _inside(hub, "images/0.png")
