"""Finding a photo dataset and listing it as ``PhotoSplit`` file lists (``load_photos``, the photo recipe's
reader): an image folder, scanned once per node and kept in the cache folder (``common.data.scan_cache``), or a
table dataset (``common.data.photo_tables``); the photos checked once per state of their files
(``common.data.photo_check``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

from common.data import folders, photo_check, scan_cache, sources
from common.data.cache import default_cache_dir
from common.data.photo_tables import load_table_photos
from common.data.photos import Paths, PhotoSplit, photo_loader, resize_side
from common.data.splits import ImageData, hold_out
from common.errors import DataError


def load_photos(cfg, default_dataset: str = "") -> ImageData:
    """An image folder (``common.data.folders`` rules), or a table dataset (``common.data.photo_tables``: a Hugging Face
    image dataset, parquet files), as PhotoSplits at ``cfg.image_size``; validation held out of train
    (``--val-fraction``, seeded) when there is no validation split. A folder is scanned once per node (``node_shared``);
    the photos are checked once per state of their files (``common.data.photo_check``)."""
    name = cfg.dataset or default_dataset
    if not name:
        raise DataError(
            "No --dataset given. Pass a folder of photos (<dir>/<class>/<image>, optionally under train/ "
            "val/ test/), a folder of parquet files, or a Hugging Face image dataset id (e.g. beans)."
        )
    path = sources.local_folder(name)
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    fresh = not (cfg.resume_from or cfg.eval_only)  # a resume and --eval-only compare the files: they walk

    def walk():
        kept = scan_cache.read(cache_dir, path) if fresh else None
        if kept is not None:
            return kept
        scan = folders.scan(path, name)
        if not scan.tables:
            scan_cache.write(cache_dir, scan)
        return scan

    scan = node_shared(walk) if path is not None else None
    local_main = PartialState().is_local_main_process
    verify = scan_cache.Verify(cache_dir, scan, name) if scan is not None and scan.kept and local_main else None
    splits, checks, identity, table_note = {}, [], "", ""
    if scan is None or scan.tables:  # a Hub id, or a folder of parquet/arrow files: read through `datasets`
        splits, class_names, identity, table_note = load_table_photos(cfg, name, cache_dir)
        checks = [(split, cache_dir / f"photos-checked-{identity}-{k}", split.where) for k, split in splits.items()]
    else:
        class_names = scan.class_names
        for split_name, fs in scan.splits.items():
            prefix = os.path.join(str(fs.base), "")
            split = PhotoSplit(Paths(prefix, fs.files), torch.tensor(fs.labels, dtype=torch.int64), cfg.image_size)
            split.provenance = fs.provenance()
            splits[split_name] = split
            # a marker in the cache folder says these very files (the fingerprint: every file's size and times)
            # were decoded whole once
            checks.append((split, cache_dir / f"photos-checked-{fs.fingerprint}", f"the {split_name} split of {name}"))
    held = {}  # the local main process's running check, when it runs beside training

    def check_first():  # a DataError of the check made before training reaches the node's other processes too
        held["check"] = photo_check.check_splits(checks, resize_side(cfg.image_size))

    node_shared(check_first)
    check = held.get("check")
    train, val = splits["train"], splits.get("validation")
    if val is None and cfg.val_fraction > 0:
        train, val = hold_out(train, cfg.val_fraction, cfg.seed)
    notes = [scan.skipped_line() if scan and not scan.tables else table_note]
    if check is not None:
        which = f"{check.total:,} of its {check.total + check.already:,}" if check.already else f"its {check.total:,}"
        earlier = "; the others were, by an earlier launch" if check.already else ""
        notes.append(
            f"{which} photos are checked while training runs (a damaged one stops the run at the next step{earlier})"
        )
    return ImageData(
        train,
        val,
        splits.get("test"),
        class_names,
        name,
        "; ".join(n for n in notes if n),
        make_loader=photo_loader,
        check=check,
        identity=identity,
        verify=verify,
    )


_NODE_GROUPS: dict = {}


def node_shared(compute):
    """``compute()`` on the local main process of each node, its result (or its DataError) handed to the node's
    other processes: one folder scan per node, not one per rank."""
    state = PartialState()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if state.num_processes == 1 or local <= 1 or state.num_processes % local:
        return compute()
    if _NODE_GROUPS.get("world") is not dist.group.WORLD:  # made once per process group: every rank makes them all
        _NODE_GROUPS.update(world=dist.group.WORLD, group=dist.new_subgroups(group_size=local, backend="gloo")[0])
    group = _NODE_GROUPS["group"]
    box = [None]
    if state.is_local_main_process:
        try:
            box[0] = compute()
        except DataError as err:
            box[0] = err
    dist.broadcast_object_list(box, src=state.process_index - state.local_process_index, group=group)
    if isinstance(box[0], DataError):
        raise box[0]
    return box[0]
