"""A photo folder's scan kept in the cache folder (common.data.scan_cache): a later new run reads it instead of walking
(one stat per file: seconds on a million files) while the folders are unchanged; a resume walks; a photo replaced in
place, which leaves its folder's times alone, is caught by the walk beside training and stops the run."""

import json
import os

import pytest

from common.data import folders

from helpers import run_in_process, write_photo_folder

ARGS = ["--image-size", 32, "--batch-size", 8, "--workers", 0]


@pytest.fixture
def walks(monkeypatch):
    """How many times this process walked a folder."""
    count = {"n": 0}
    walk = folders.scan

    def counted(*args, **kwargs):
        count["n"] += 1
        return walk(*args, **kwargs)

    monkeypatch.setattr(folders, "scan", counted)
    return count


def train_count(run_dir) -> int:
    return json.loads((run_dir / "final" / "model.json").read_text())["data"]["train"]


def test_a_later_run_reads_the_kept_scan_until_a_folder_changes_and_a_resume_walks(tmp_path, env, walks):
    root = write_photo_folder(tmp_path / "d", 6)
    base = ["--dataset", root, "--cache-dir", tmp_path / "cache", *ARGS]
    args = [*base, "--epochs", 1]
    assert run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "r1"], env).returncode == 0
    assert walks["n"] == 1 and len(list((tmp_path / "cache").glob("scan-*.json"))) == 1
    assert run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "r2"], env).returncode == 0
    assert walks["n"] == 1  # read back: no walk
    assert train_count(tmp_path / "r2") == train_count(tmp_path / "r1")
    # a resume compares the files with the run's record: it walks
    proc = run_in_process(
        "finetune_folder", [*base, "--epochs", 2, "--output-dir", tmp_path / "r2", "--resume-from", "latest"], env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert walks["n"] == 2
    # a photo added (its folder's times change): walked again, and trained on
    (root / "ant" / "new.jpg").write_bytes((root / "ant" / "0.jpg").read_bytes())
    assert run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "r3"], env).returncode == 0
    assert (
        walks["n"] == 3
        and train_count(tmp_path / "r3")
        + int(json.loads((tmp_path / "r3" / "final" / "model.json").read_text())["data"]["val"])
        == 19
    )


def test_a_photo_replaced_in_place_stops_a_run_started_from_the_kept_scan(tmp_path, env, walks):
    """Same name, same modification time (``cp -p`` of another photo over it), the folder's times untouched: the
    kept scan still reads as current, so the walk beside training is what notices it, stops the run in one paragraph
    and drops the kept scan; the next launch walks and trains."""
    root = write_photo_folder(tmp_path / "d", 6)
    base = ["--dataset", root, "--cache-dir", tmp_path / "cache", *ARGS]
    args = [*base, "--epochs", 30, "--max-steps", 40]
    first = run_in_process("finetune_folder", [*base, "--epochs", 1, "--output-dir", tmp_path / "r1"], env)
    assert first.returncode == 0
    victim, other = root / "ant" / "0.jpg", root / "bee" / "0.jpg"
    folder_times = os.stat(victim.parent)
    st = os.stat(victim)
    victim.write_bytes(other.read_bytes())  # in place: the folder's entries are unchanged
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(victim.parent).st_mtime_ns == folder_times.st_mtime_ns
    proc = run_in_process("finetune_folder", [*args, "--output-dir", tmp_path / "r2"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "replaced in place" in paragraph and "ant/0.jpg" in paragraph
    assert not list((tmp_path / "cache").glob("scan-*"))
    assert walks["n"] == 1
    again = run_in_process("finetune_folder", [*base, "--epochs", 1, "--output-dir", tmp_path / "r3"], env)
    assert again.returncode == 0
    assert walks["n"] == 2


# --- a cache folder someone else can write: the kept scan is checked, never trusted -----------------------------


def kept_scan(cache):
    """The kept scan's index entry and arrays, to be changed and written back by ``rewrite``."""
    import numpy as np

    [index] = cache.glob("scan-*.json")
    entry = json.loads(index.read_text())
    with np.load(cache / entry["arrays"], allow_pickle=False) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    return index, entry, arrays


def rewrite(cache, index, entry, arrays=None):
    import numpy as np

    if arrays is not None:
        np.savez(cache / entry["arrays"], **arrays)
    index.write_text(json.dumps(entry))


def paths_of(arrays, split="train"):
    return arrays[f"{split}.files"].tobytes().decode().split("\0")


def with_paths(arrays, paths, split="train"):
    import numpy as np

    return {**arrays, f"{split}.files": np.frombuffer("\0".join(paths).encode(), np.uint8)}


def first_run(tmp_path, env, walks):
    root = write_photo_folder(tmp_path / "d", 6)
    base = ["--dataset", root, "--cache-dir", tmp_path / "cache", *ARGS, "--epochs", 1]
    assert run_in_process("finetune_folder", [*base, "--output-dir", tmp_path / "r1"], env).returncode == 0
    assert walks["n"] == 1
    return root, base


def crafted_labels(arrays):
    labels = arrays["train.labels"]
    return {**arrays, "train.labels": (labels + 1) % 3}


def crafted_parent_path(arrays):
    paths = paths_of(arrays)
    return with_paths(arrays, ["ant/../../outside.jpg", *paths[1:]])


def crafted_absolute_path(arrays):
    paths = paths_of(arrays)
    return with_paths(arrays, [os.path.abspath("/etc/hostname"), *paths[1:]])


CRAFTED_ARRAYS = {
    "labels flipped": crafted_labels,
    "../ path": crafted_parent_path,
    "absolute path": crafted_absolute_path,
}


def kept_directly(tmp_path):
    """A photo folder and its scan kept in a cache folder, as a first launch leaves them (without training)."""
    from common.data import scan_cache

    root = write_photo_folder(tmp_path / "d", 6)
    scan_cache.write(tmp_path / "cache", folders.scan(root, "d"))
    return root, tmp_path / "cache"


@pytest.mark.parametrize("case", list(CRAFTED_ARRAYS))
def test_a_crafted_kept_scan_decides_no_label_and_no_file(case, tmp_path):
    """Before, a crafted kept scan was taken whole: flipped labels (all of them) or a path outside the dataset were
    trained on, exit 0. Now the scan is checked against the folder (labels read from each path, paths inside their
    class folders) and, failing, not taken: the folder is walked."""
    from common.data import scan_cache

    root, cache = kept_directly(tmp_path)
    assert scan_cache.read(cache, root) is not None  # the honest one is taken
    index, entry, arrays = kept_scan(cache)
    rewrite(cache, index, entry, CRAFTED_ARRAYS[case](arrays))
    assert scan_cache.read(cache, root) is None


def test_a_run_on_a_scan_with_flipped_labels_trains_on_the_folders_classes(tmp_path, env, walks):
    """The same through a launch: the crafted scan is not taken, the folder is walked and its scan kept anew."""
    root, base = first_run(tmp_path, env, walks)
    cache = tmp_path / "cache"
    index, entry, arrays = kept_scan(cache)
    rewrite(cache, index, entry, crafted_labels(arrays))
    proc = run_in_process("finetune_folder", [*base, "--output-dir", tmp_path / "r2"], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert walks["n"] == 2
    _, _, again = kept_scan(cache)
    assert (again["train.labels"] == arrays["train.labels"]).all() and paths_of(again) == paths_of(arrays)


def test_a_huge_declared_array_is_not_read(tmp_path):
    """An arrays file whose header declares a terabyte: refused before numpy allocates anything."""
    import zipfile

    import numpy as np

    from common.data import scan_cache

    root, cache = kept_directly(tmp_path)
    index, entry, arrays = kept_scan(cache)
    with zipfile.ZipFile(cache / entry["arrays"], "w") as archive:
        for key, value in arrays.items():
            with archive.open(f"{key}.npy", "w") as member:
                if key == "train.files":
                    header = {"descr": "|u1", "fortran_order": False, "shape": (10**12,)}
                    np.lib.format.write_array_header_1_0(member, header)
                    member.write(b"x" * 64)
                else:
                    np.lib.format.write_array(member, value)
    assert scan_cache.read(cache, root) is None


@pytest.mark.parametrize("target", ["relative", "absolute"])
def test_the_arrays_field_never_names_a_file_to_delete(target, tmp_path):
    """Before, the next launch unlinked whatever the index's "arrays" field named: `../thesis.tex` or an absolute
    path was deleted (on a new scan kept, and on a dropped one). Now only names this module makes, in the cache
    folder, are read or removed."""
    from common.data import scan_cache

    root, cache = kept_directly(tmp_path)
    thesis = tmp_path / "thesis.tex"
    thesis.write_text("years of work")
    index, entry, _ = kept_scan(cache)
    entry["arrays"] = "../thesis.tex" if target == "relative" else str(thesis)
    rewrite(cache, index, entry)
    assert scan_cache.read(cache, root) is None
    scan_cache.write(cache, folders.scan(root, "d"))  # what the walk that follows does
    assert thesis.read_text() == "years of work"
    assert len(list(cache.glob("scan-*.npz"))) == 1  # the new one; the earlier one pruned by its name
    index, entry, _ = kept_scan(cache)
    entry["arrays"] = "../thesis.tex" if target == "relative" else str(thesis)
    rewrite(cache, index, entry)
    scan_cache.drop(cache, root)  # what a run that finds a changed folder does
    assert thesis.read_text() == "years of work" and not list(cache.glob("scan-*"))


@pytest.mark.parametrize("dirs", ["empty", "foreign", "class folder left out"])
def test_an_empty_or_foreign_folder_list_is_refused(dirs, tmp_path):
    """Before, an empty `dirs` list counted as "unchanged" (every listed folder was). Now the dataset folder must
    come first and every split and class folder be among those compared."""
    from common.data import scan_cache

    root, cache = kept_directly(tmp_path)
    index, entry, _ = kept_scan(cache)
    if dirs == "empty":
        entry["dirs"] = []
    elif dirs == "foreign":
        other = tmp_path / "elsewhere"
        other.mkdir()
        st = os.stat(other)
        entry["dirs"] = [[str(other), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns], *entry["dirs"]]
    else:
        entry["dirs"] = [d for d in entry["dirs"] if not d[0].endswith("/bee")]
    rewrite(cache, index, entry)
    assert scan_cache.read(cache, root) is None


def test_a_kept_scan_that_leaves_files_out_stops_the_run_and_a_photo_added_after_launch_does_not(
    tmp_path, env, walks, monkeypatch
):
    """A kept scan that lists fewer files than the folder held (consistent otherwise) is caught by the walk beside
    training, which names the file it left out. A photo added to the folder after launch is not a reason to stop
    (before, it was blamed on a photo replaced in place)."""
    import numpy as np

    root, base = first_run(tmp_path, env, walks)
    cache = tmp_path / "cache"
    index, entry, arrays = kept_scan(cache)
    long = [*base[:-2], "--epochs", 30, "--max-steps", 40]
    # a photo added after the kept scan was read: the run goes on
    from common.data import scan_cache

    read = scan_cache.read

    def read_then_add(*args):
        found = read(*args)
        (root / "ant" / "added.jpg").write_bytes((root / "ant" / "0.jpg").read_bytes())
        return found

    with monkeypatch.context() as mp:
        mp.setattr(scan_cache, "read", read_then_add)
        ok = run_in_process("finetune_folder", [*long, "--output-dir", tmp_path / "r2"], env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert walks["n"] == 1
    (root / "ant" / "added.jpg").unlink()
    index, entry, arrays = kept_scan(cache)
    stats = [os.stat(d[0]) for d in entry["dirs"]]  # the folders' times now (the photo came and went)
    entry["dirs"] = [
        [d[0], st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns] for d, st in zip(entry["dirs"], stats)
    ]
    paths = paths_of(arrays)
    left_out = paths[0]
    keep = np.arange(1, len(paths))
    crafted = with_paths(arrays, paths[1:])
    crafted["train.labels"] = arrays["train.labels"][keep]
    crafted["train.stats"] = arrays["train.stats"][keep]
    entry["splits"]["train"] = "0" * 32
    rewrite(cache, index, entry, crafted)
    proc = run_in_process("finetune_folder", [*long, "--output-dir", tmp_path / "r3"], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [paragraph] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert left_out in paragraph and "not in the kept scan" in paragraph
