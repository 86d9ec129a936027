"""The photo recipe on Hugging Face image datasets: parquet files with an image column of encoded photos and a label
column (the layout of beans, food101, cats_vs_dogs), written here, read per batch like a folder of the same photos."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

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
    # a damaged photo in row 5: named by its row, before training, with the others
    tables = folder_to_parquet(folder, tmp_path / "damaged", replace={5: b"\xff\xd8 not a photo"})
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", tables, "--output-dir", tmp_path / "r1", "--cache-dir", tmp_path / "c", *ARGS],
        env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "row 5 of the train split" in proc.stderr and "could not be read" in proc.stderr, proc.stderr[-2000:]
    # string labels: a validation label train does not have
    strings = folder_to_parquet(folder, tmp_path / "strings", string_labels=True)
    write_photo_folder(tmp_path / "val_photos", 2, classes=("ant", "hornet"))
    folder_to_parquet(tmp_path / "val_photos", tmp_path / "strings", split="validation", string_labels=True)
    proc = run_in_process(
        "finetune_folder",
        ["--dataset", strings, "--output-dir", tmp_path / "r2", "--cache-dir", tmp_path / "c", *ARGS],
        env,
    )
    assert proc.returncode == 2 and "'hornet'" in proc.stderr and "outside the 3 classes" in proc.stderr
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
    for images, labels in loader:  # every photo decoded once, per batch
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
