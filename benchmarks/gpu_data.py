"""The data benchmarks/gpu_report.py carries to the GPU machine: made here once from ../shared/data into gpu-data/
(ignored by git, about 54 MiB, under the 60 MiB it may take of the window's 64), and installed there by the
report into what the recipes read without `datasets`, which that machine lacks.

    python benchmarks/gpu_data.py                          # ../shared/data -> gpu-data/
    python benchmarks/gpu_data.py --from DIR --to DIR      # other folders

gpu-data/ holds:
- mnist.npz: the 60,000 MNIST training images as this project decodes them (the decoded cache's uint8 1x28x28
  pixels, deflated: 9 MiB where the PNGs take 16) and their labels;
- cifar10.npz: the 50,000 CIFAR-10 (JPEG copy) training images' JPEG bytes, as the parquet holds them (44 MiB,
  where the decoded pixels take 150), and labels; decoded on the GPU machine by the recipes' own per-image steps
  (common.data.pixels), the result checked against the SHA-256 of the pixels decoded here;
- flowers/: the first 40 photos of each of the 5 flower classes, copied as they are (an image folder);
- manifest.json: each one's kind, counts, shape, class names, source and sizes.

Installed (``install``, in the report's work folder): each table dataset becomes what a launch on an unchanged local
folder reads without importing `datasets` (common.data.decoded): a folder of its own (a README, no images) and, in
the cache folder, its decoded split in the cache's file format plus the source index naming it for that folder's
state. The recipes, time_to_accuracy.py and airbench94.py then read it through their own loading code. A photo
folder is read where it is. ``toy`` writes the same layout with a few hundred synthetic images (the rehearsal's).
"""

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from harness import REPO, bad_input, synthetic_images  # first: the repo on sys.path
from launching import recipe_config
from PIL import Image

from common.data import cache, table_copies
from common.data.decoded import load_image_data
from common.data.pixels import natural
from common.data.splits import ImageSplit

FORMAT = "accelerate-recipes-gpu-data/1"
MAX_BYTES = 60 * 2**20  # of the window's 64 MiB: the working tree (about 1.3 MiB) travels too
# how each table dataset travels: its decoded pixels deflated, or its files' own bytes, whichever is smaller
KINDS = {"mnist": "pixels", "cifar10": "encoded"}
PHOTOS = "flowers"
# the recipes that read each table dataset: the source index is written for each one's decode settings
READERS = {"mnist": ("mnist_convnet", "fashion_mnist_mlp"), "cifar10": ("cifar_cnn",)}


def sha256(images: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(images).data).hexdigest()


def decode_one(blob: bytes) -> np.ndarray:
    """One encoded image as the recipes decode a table's image (common.data.decoded.decode_split, no --channels
    or --image-size): opened, loaded, made natural (16-bit scaled, transparency flattened, EXIF applied)."""
    with Image.open(io.BytesIO(blob)) as opened:
        opened.load()
        return np.asarray(natural(opened), dtype=np.uint8)


def decode_all(blobs: list, jobs: int) -> np.ndarray:
    """(N, C, H, W) uint8 of the encoded images, in ``jobs`` forked processes when there are many."""
    if jobs > 1 and len(blobs) > 4000:
        with get_context("fork").Pool(jobs) as pool:  # four chunks a process, in order
            arrays = pool.map(decode_one, blobs, chunksize=-(-len(blobs) // (4 * jobs)))
    else:
        arrays = [decode_one(b) for b in blobs]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"the images differ in shape or mode ({sorted({a.shape for a in arrays})[:3]}, ...)")
    images = np.stack(arrays)
    return images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2).copy()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def finish(dest: Path, manifest: dict) -> dict:
    manifest["bytes"] = folder_bytes(dest)
    if manifest["bytes"] > MAX_BYTES:
        raise SystemExit(
            f"error: {dest} holds {manifest['bytes'] / 2**20:.1f} MiB, over the {MAX_BYTES // 2**20} MiB the GPU "
            "window's carry allows the data; pass fewer photos (--photos-per-class)."
        )
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_table(dest: Path, name: str, kind: str, images: np.ndarray, labels, class_names, source, encoded=None):
    """``name``.npz in ``dest`` and its manifest entry: pixels (deflated) or the encoded bytes (+ offsets)."""
    labels = np.asarray(labels, dtype=np.int64)
    entry = {
        "kind": kind,
        "file": f"{name}.npz",
        "count": int(len(labels)),
        "shape": list(images.shape[1:]),
        "class_names": list(class_names),
        "pixels_sha256": sha256(images),
        "source": str(source),
    }
    if kind == "pixels":
        np.savez_compressed(dest / entry["file"], images=images, labels=labels)
    else:
        offsets = np.cumsum([0] + [len(b) for b in encoded], dtype=np.int64)
        raw = np.frombuffer(b"".join(encoded), np.uint8)
        np.savez(dest / entry["file"], encoded=raw, offsets=offsets, labels=labels)
    entry["bytes"] = (dest / entry["file"]).stat().st_size
    return entry


def parquet_column_bytes(folder: Path, image_columns=("image", "img")):
    """The encoded image bytes and labels of a Hub-layout folder's train parquet files, in the order `datasets`
    reads them (files by name, rows in order)."""
    import pyarrow.parquet as pq

    files = sorted(p for p in folder.rglob("*.parquet") if "train" in p.name)
    blobs, labels = [], []
    for f in files:
        table = pq.read_table(f)
        col = next(c for c in image_columns if c in table.column_names)
        blobs += [item["bytes"] for item in table.column(col).to_pylist()]
        labels += table.column("label").to_pylist()
    return blobs, labels


def pack_real(src: Path, dest: Path, photos_per_class: int = 40) -> dict:
    """gpu-data/ from the shared data folder (needs `datasets`, to decode as the recipes do)."""
    dest.mkdir(parents=True, exist_ok=True)
    scratch = dest / ".decode-cache"  # the project's own decode of each set, removed after
    manifest = {"format": FORMAT, "made": time.strftime("%Y-%m-%d %H:%M"), "from": str(src), "datasets": {}}
    try:
        for name, kind in KINDS.items():
            argv = ["--dataset", src / name, "--cache-dir", scratch, "--val-fraction", 0]
            cfg = recipe_config(READERS[name][0], argv)
            data = load_image_data(cfg, cfg.dataset)
            images, labels = data.train.source_images.numpy(), data.train.source_labels.numpy()
            encoded = None
            if kind == "encoded":
                encoded, raw_labels = parquet_column_bytes(src / name)
                if raw_labels != labels.tolist():
                    raise SystemExit(f"error: {src / name}: the parquet rows are not in the order datasets read them")
            entry = write_table(dest, name, kind, images, labels, data.class_names, src / name, encoded)
            manifest["datasets"][name] = entry
            print(f"{name}: {len(labels)} images as {kind}, {entry['bytes'] / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    photos = dest / PHOTOS
    shutil.rmtree(photos, ignore_errors=True)
    classes = sorted(d for d in (src / PHOTOS / "train").iterdir() if d.is_dir())
    for d in classes:
        (photos / d.name).mkdir(parents=True)
        for f in sorted(p for p in d.iterdir() if p.is_file())[:photos_per_class]:
            shutil.copyfile(f, photos / d.name / f.name)
    manifest["datasets"][PHOTOS] = {
        "kind": "folder",
        "dir": PHOTOS,
        "count": photos_per_class * len(classes),
        "class_names": [d.name for d in classes],
        "source": str(src / PHOTOS),
    }
    return finish(dest, manifest)


def pack_toy(dest: Path, n: int = 600, photos_per_class: int = 20, photo_size: int = 40) -> dict:
    """The same layout with synthetic images (smooth noise, random labels): the rehearsal's data."""
    dest.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "made": time.strftime("%Y-%m-%d %H:%M"), "from": "synthetic (toy)", "datasets": {}}
    names = {"mnist": [str(k) for k in range(10)], "cifar10": [f"class_{k}" for k in range(10)]}
    for (name, kind), shape in zip(KINDS.items(), ((1, 28, 28), (3, 32, 32))):
        images, labels = synthetic_images(shape, n, seed=len(name))
        images = images.numpy()
        encoded = None
        if kind == "encoded":  # JPEG, as the CIFAR copy is; the pixels are then what decoding gives
            encoded = []
            for arr in images.transpose(0, 2, 3, 1):
                buf = io.BytesIO()
                Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(buf, format="JPEG", quality=90)
                encoded.append(buf.getvalue())
            images = decode_all(encoded, 1)
        manifest["datasets"][name] = write_table(dest, name, kind, images, labels, names[name], "synthetic", encoded)
    gen = torch.Generator().manual_seed(3)
    classes = ["daisy", "dandelion", "rose", "sunflower", "tulip"]
    for c in classes:
        (dest / PHOTOS / c).mkdir(parents=True, exist_ok=True)
        for k in range(photos_per_class):
            arr = (torch.rand(photo_size, photo_size, 3, generator=gen) * 255).to(torch.uint8).numpy()
            Image.fromarray(arr).save(dest / PHOTOS / c / f"{k:03d}.jpg", quality=90)
    manifest["datasets"][PHOTOS] = {
        "kind": "folder",
        "dir": PHOTOS,
        "count": photos_per_class * len(classes),
        "class_names": classes,
        "source": "synthetic",
    }
    return finish(dest, manifest)


def read_manifest(pack: Path) -> dict:
    path = Path(pack) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        assert manifest["format"] == FORMAT
        return manifest
    except (OSError, ValueError, KeyError, AssertionError):
        bad_input(
            f"{path} is missing or not a gpu_data manifest. Make the data first, where ../shared/data is: "
            f"`python benchmarks/gpu_data.py --to {pack}` (then carry that folder)."
        )


def decode_settings(recipe: str) -> dict:
    """The settings a recipe's default launch keys its source index with (common.data.decoded.load_image_data)."""
    cfg = recipe_config(recipe)
    return {"img": cfg.image_column, "lab": cfg.label_column, "channels": cfg.channels, "size": cfg.image_size}


def installed_paths(pack: Path, work: Path) -> dict:
    """Where ``install`` puts each dataset of a pack, known before it runs: {name: the folder for --dataset}."""
    return {"mnist": work / "data" / "mnist", "cifar10": work / "data" / "cifar10", PHOTOS: Path(pack) / PHOTOS}


def install(pack: Path, work: Path, jobs: int | None = None) -> dict:
    """The pack's datasets, ready to read without `datasets`: {name: folder to pass as --dataset}, plus "notes" (a
    list of lines: the decoded pixels' check, the seconds taken)."""
    t0, manifest = time.perf_counter(), read_manifest(pack)
    cache_dir, out, notes = work / "cache", {}, []
    for name, entry in manifest["datasets"].items():
        if entry["kind"] == "folder":
            out[name] = Path(pack) / entry["dir"]
            continue
        arrays = np.load(Path(pack) / entry["file"])
        if entry["kind"] == "pixels":
            images = arrays["images"]
        else:
            raw, offsets = arrays["encoded"].tobytes(), arrays["offsets"]
            blobs = [raw[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
            images = decode_all(blobs, jobs or os.cpu_count() or 1)
            if sha256(images) != entry["pixels_sha256"]:
                notes.append(
                    f"{name}: the pixels decoded here differ from those decoded where the data was made (another "
                    "Pillow/libjpeg): same files, slightly other pixels"
                )
        split = ImageSplit(torch.from_numpy(images), torch.from_numpy(arrays["labels"]))
        folder = work / "data" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "README.txt").write_text(
            f"{name}: {entry['count']} images from {entry['source']}, pre-decoded by benchmarks/gpu_data.py. This "
            f"folder holds no images: its decoded split is in {cache_dir}, named by the source index for this folder's "
            "state (common.data.cache), which a launch on an unchanged local folder reads without `datasets`.\n"
        )
        identity = table_copies.local_copy(cache_dir, folder)[1].name  # as a launch on this folder names it
        split_file = cache_dir / f"gpu-data-{name}-train.safetensors"
        cache.cached_split(split_file, lambda s=split: s, f"the train split of {name}", entry["class_names"], True)
        for settings in {json.dumps(decode_settings(r), sort_keys=True) for r in READERS[name]}:
            index = cache.source_index_path(cache_dir, identity, json.loads(settings))
            cache.write_source_index(index, {"train": split_file.name}, entry["class_names"])
            if cache.read_source_index(index) is None:
                raise RuntimeError(f"the source index {index} for {folder} could not be read back")
        out[name] = folder
    notes.append(f"data installed in {time.perf_counter() - t0:.1f} s")
    return {**out, "notes": notes, "manifest": manifest}


def read_installed(recipe: str, folder: Path, cache_dir: Path, seed: int):
    """The recipe's data from an installed folder, as its launch reads it (the seeded hold-out included); refuses
    where that would import `datasets`."""
    cfg = recipe_config(recipe, ["--dataset", folder, "--cache-dir", cache_dir, "--seed", seed])
    before = "datasets" in sys.modules
    data = load_image_data(cfg, cfg.dataset)
    if "datasets" in sys.modules and not before:
        raise RuntimeError(f"reading {folder} imported `datasets`: its source index was not found")
    return data


def predict_inputs(data, dest: Path, n: int = 48) -> int:
    """The first ``n`` held-out images as PNG files named <k>-label<L>.png, for predict to read."""
    dest.mkdir(parents=True, exist_ok=True)
    val = data.val
    n = min(n, len(val))
    images, labels = val.images_at(slice(0, n)), val.labels[:n]
    for k, (img, label) in enumerate(zip(images, labels.tolist())):
        arr = img.numpy()
        arr = arr[0] if arr.shape[0] == 1 else arr.transpose(1, 2, 0)
        Image.fromarray(arr).save(dest / f"{k:03d}-label{label}.png")
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src", type=Path, default=REPO.parent / "shared" / "data", help="../shared/data")
    p.add_argument("--to", dest="dest", type=Path, default=REPO / "gpu-data", help="gpu-data/ (ignored by git)")
    p.add_argument("--photos-per-class", type=int, default=40)
    args = p.parse_args(argv)
    missing = [f"{args.src / n}/" for n in (*KINDS, PHOTOS) if not (args.src / n).is_dir()]
    if missing:
        bad_input(f"--from {args.src}: it lacks {', '.join(missing)} (laid out as ../shared/data is).")
    manifest = pack_real(args.src, args.dest, args.photos_per_class)
    print(f"wrote {args.dest}: {manifest['bytes'] / 2**20:.1f} MiB (carry it: see benchmarks/gpu_report.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
