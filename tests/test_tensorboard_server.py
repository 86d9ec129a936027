"""TensorBoard as users open it: a real 2-process run (the fashion_mnist_mlp reference run of conftest:
train 256, a validation split of its own, 2 epochs of batch 32, one log line per step), then a real
`tensorboard` server on its run directory, read back over the HTTP API the TensorBoard frontend uses
(Scalars, Images and HParams tabs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from helpers import free_port, read_scalars, recipe_env

N_TRAIN, BATCH, EPOCHS = 256, 32, 2
STEPS = EPOCHS * (N_TRAIN // BATCH)  # a validation split is given, so nothing is held out of train
TRAIN_TAGS = {
    "train/loss",
    "train/lr",
    "train/samples_per_sec",
    "train/data_wait_fraction",
    "train/grad_norm",
    "train/peak_memory_mb",
}
SERVER_DEADLINE_S = 90


def _get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _get_json(url: str, timeout: float = 10):
    return json.loads(_get(url, timeout))


def _post_json(url: str, body: dict):
    # what the HParams dashboard sends: a POST whose body is the JSON request, content type text/plain
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def tb(tmp_path_factory, reference_run):
    """(server base URL, run dir, the run's model.json, the run's summary.json, scalars read from disk)."""
    root = tmp_path_factory.mktemp("tb")
    run = reference_run("fashion_mnist_mlp", 2).run
    args = [str(a) for a in reference_run("fashion_mnist_mlp", 2).train_args]
    assert [args[args.index(f) + 1] for f in ("--epochs", "--batch-size", "--log-every", "--hidden")] == [
        str(EPOCHS),
        str(BATCH),
        "1",
        "32",
    ]
    on_disk = read_scalars(run)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(root / "tensorboard.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(run), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=recipe_env(root),
        start_new_session=True,  # its own process group: the data server child dies with it
    )
    try:
        # Ready when the server answers AND has loaded everything the event file holds (it loads in the
        # background, so the first answers can be partial).
        deadline, seen = time.monotonic() + SERVER_DEADLINE_S, None
        while True:
            assert server.poll() is None, (
                f"tensorboard exited {server.returncode}: {(root / 'tensorboard.log').read_text()}"
            )
            try:
                seen = _get_json(f"{base}/data/plugin/scalars/tags", timeout=2)
                if set(seen.get("tensorboard", {})) == set(on_disk):
                    points = _get_json(f"{base}/data/plugin/scalars/scalars?run=tensorboard&tag=test%2Faccuracy")
                    if points:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            assert time.monotonic() < deadline, (
                f"tensorboard did not serve the run's {len(on_disk)} scalar tags within {SERVER_DEADLINE_S} s; "
                f"last answer: {seen}\n{(root / 'tensorboard.log').read_text()[-3000:]}"
            )
            time.sleep(0.5)
        yield {
            "base": base,
            "run": run,
            "card": json.loads((run / "final" / "model.json").read_text()),
            "summary": json.loads((run / "summary.json").read_text()),
            "on_disk": on_disk,
        }
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        log.close()


def test_one_run_named_after_the_event_folder(tb):
    assert _get_json(f"{tb['base']}/data/runs") == ["tensorboard"]
    plugins = _get_json(f"{tb['base']}/data/plugins_listing")
    for tab in ("scalars", "images", "hparams"):
        assert plugins[tab]["enabled"], f"{tab} tab is not active: {plugins[tab]}"


def test_scalars_tab(tb):
    classes = tb["card"]["class_names"]
    assert classes == ["class_0", "class_1", "class_2", "class_3"]
    tags = set(_get_json(f"{tb['base']}/data/plugin/scalars/tags")["tensorboard"])
    expected = TRAIN_TAGS | {"eval/loss", "eval/accuracy", "test/loss", "test/accuracy"}
    expected |= {f"{split}/accuracy_class/{name}" for split in ("eval", "test") for name in classes}
    assert expected <= tags, f"missing: {sorted(expected - tags)}"

    def points(tag):  # [[wall_time, step, value], ...]
        q = urllib.parse.urlencode({"run": "tensorboard", "tag": tag})
        return _get_json(f"{tb['base']}/data/plugin/scalars/scalars?{q}")

    # --log-every 1: one train/loss point per optimizer step, steps 1..STEPS, the same as on disk
    loss = points("train/loss")
    assert tb["summary"]["global_step"] == STEPS
    assert [step for _, step, _ in loss] == list(range(1, STEPS + 1))
    assert [(s, pytest.approx(v, rel=1e-6)) for _, s, v in loss] == tb["on_disk"]["train/loss"]
    for tag in TRAIN_TAGS:
        assert len(points(tag)) == STEPS, tag
    lr = [v for _, _, v in points("train/lr")]  # no warm-up step at this length (2% of 16), then cosine decay
    peak = json.loads((tb["run"] / "config.json").read_text())["lr"]
    assert lr[0] == pytest.approx(peak)  # the LR each step used: the first step runs at the peak
    assert all(0 <= v <= peak * (1 + 1e-6) for v in lr) and lr == sorted(lr, reverse=True) and lr[-1] < lr[0]
    assert all(v > 0 for _, _, v in points("train/peak_memory_mb"))
    assert all(0 <= v <= 1 for _, _, v in points("train/data_wait_fraction"))
    # one eval per epoch (at each epoch's last step), the final test once at the end
    epoch_ends = [STEPS // EPOCHS * (e + 1) for e in range(EPOCHS)]
    for tag in ("eval/loss", "eval/accuracy", *(f"eval/accuracy_class/{n}" for n in classes)):
        assert [s for _, s, _ in points(tag)] == epoch_ends, tag
    final = points("test/accuracy")
    assert [s for _, s, _ in final] == [STEPS]
    assert final[0][2] == pytest.approx(tb["summary"]["final"]["test/accuracy"])
    assert all(0 <= v <= 1 for n in classes for _, _, v in points(f"test/accuracy_class/{n}"))


def test_images_tab(tb):
    tags = _get_json(f"{tb['base']}/data/plugin/images/tags")["tensorboard"]
    expected = {f"test/{what}" for what in ("confusion_matrix", "misclassified")}  # the final evaluation's
    assert set(tags) == expected, sorted(tags)
    for tag in sorted(expected):
        q = urllib.parse.urlencode({"run": "tensorboard", "tag": tag, "sample": 0})
        entries = _get_json(f"{tb['base']}/data/plugin/images/images?{q}")  # [{wall_time, step, query}, ...]
        assert [e["step"] for e in entries] == [STEPS], tag
        blob = _get(f"{tb['base']}/data/plugin/images/individualImage?{entries[-1]['query']}")
        assert blob[:8] == b"\x89PNG\r\n\x1a\n", f"{tag}: not a PNG ({blob[:16]!r})"
        assert len(blob) > 200, tag


def test_hparams_tab(tb):
    base = f"{tb['base']}/data/plugin/hparams"
    # the requests the HParams dashboard (tf-hparams-dashboard) sends, from tensorboard's webfiles
    experiment = _post_json(f"{base}/experiment", {"experimentName": "", "hparamsLimit": 1000})
    hparams = {h["name"]: h for h in experiment["hparamInfos"]}
    config = json.loads((tb["run"] / "config.json").read_text())
    assert {"lr", "batch_size", "epochs", "hidden", "seed", "dataset"} <= set(hparams)
    assert set(hparams) == {k for k, v in config.items() if v is not None}  # the whole resolved config
    assert hparams["lr"]["type"] == "DATA_TYPE_FLOAT64" and hparams["hidden"]["type"] == "DATA_TYPE_STRING"
    metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
    assert metrics == {"test/accuracy", "test/loss"}

    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
    cols = [{"hparam": h["name"], "includeInResult": True} for h in experiment["hparamInfos"]]
    cols += [{"metric": m["name"], "includeInResult": True} for m in experiment["metricInfos"]]
    groups = _post_json(
        f"{base}/session_groups",
        {"experimentName": "", "allowedStatuses": statuses, "colParams": cols, "startIndex": 0, "sliceSize": 100},
    )
    assert groups["totalSize"] == 1 and len(groups["sessionGroups"]) == 1
    group = groups["sessionGroups"][0]
    assert group["hparams"]["lr"] == pytest.approx(config["lr"])
    assert group["hparams"]["batch_size"] == BATCH and group["hparams"]["epochs"] == EPOCHS
    assert group["hparams"]["hidden"] == "32"
    values = {m["name"]["tag"]: m for m in group["metricValues"]}
    assert values["test/accuracy"]["value"] == pytest.approx(tb["summary"]["final"]["test/accuracy"])
    assert values["test/loss"]["value"] == pytest.approx(tb["summary"]["final"]["test/loss"])
    assert values["test/accuracy"]["trainingStep"] == STEPS
    assert [s["status"] for s in group["sessions"]] == ["STATUS_SUCCESS"]
