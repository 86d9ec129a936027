"""Finding a photo dataset and listing it as ``PhotoSplit`` file lists (``load_photos``, the photo recipe's
reader): an image folder, walked once per node by torchvision's ``ImageFolder`` rule (``common.data.folders``), or a
table dataset (``common.data.photo_tables``). Photos are decoded per batch by the loader's workers; a damaged one is
skipped and counted (``common.data.damaged``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

from common.data import sources
from common.data.cache import default_cache_dir
from common.data.damaged import DamagedPhotos
from common.data.photo_tables import load_table_photos
from common.data.photos import Paths, PhotoSplit, photo_loader
from common.data.splits import ImageData, hold_out
from common.errors import DataError


def load_photos(cfg, default_dataset: str = "") -> ImageData:
    """An image folder (``common.data.folders`` rules), or a table dataset (``common.data.photo_tables``: a Hugging Face
    image dataset, parquet files), as PhotoSplits at ``cfg.image_size``; validation held out of train
    (``--val-fraction``, seeded) when there is no validation split. A folder is walked once per node
    (``node_shared``); the splits share one tally of damaged photos (``common.data.damaged``, ``--max-damaged``)."""
    name = cfg.dataset or default_dataset
    if not name:
        raise DataError(
            "No --dataset given. Pass a folder of photos (<dir>/<class>/<image>, optionally under train/ "
            "val/ test/), a folder of parquet files, or a Hugging Face image dataset id (e.g. beans)."
        )
    scan = node_shared(lambda: sources.image_folder(name))
    splits, identity, table_note = {}, "", ""
    if scan is None:  # a Hub id, or a folder of tables: read through `datasets`
        cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        splits, class_names, identity, table_note = load_table_photos(cfg, name, cache_dir)
    else:
        class_names = scan.class_names
        for split_name, fs in scan.splits.items():
            prefix = os.path.join(str(fs.base), "")
            split = PhotoSplit(Paths(prefix, fs.files), torch.tensor(fs.labels, dtype=torch.int64), cfg.image_size)
            split.provenance = fs.provenance()
            splits[split_name] = split
    train, val = splits["train"], splits.get("validation")
    if val is None and cfg.val_fraction > 0:
        train, val = hold_out(train, cfg.val_fraction, cfg.seed)
    test = splits.get("test")
    damaged = DamagedPhotos(sum(len(s) for s in splits.values()), cfg.max_damaged, PartialState().num_processes)
    for split in (train, val, test):
        if split is not None:
            split.damaged = damaged
    note = scan.skipped_line() if scan else table_note
    return ImageData(
        train, val, test, class_names, name, note, make_loader=photo_loader, damaged=damaged, identity=identity
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
