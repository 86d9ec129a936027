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
    assert "changed since its scan was kept" in paragraph and "ant/0.jpg" in paragraph
    assert not list((tmp_path / "cache").glob("scan-*"))
    assert walks["n"] == 1
    again = run_in_process("finetune_folder", [*base, "--epochs", 1, "--output-dir", tmp_path / "r3"], env)
    assert again.returncode == 0
    assert walks["n"] == 2
