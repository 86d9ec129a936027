"""Shared fixtures: tiny datasets written to disk in the layouts users have (session-wide), a test's own
environment for recipe subprocesses, foreground signal handling, and the reference runs: one full run per recipe and
process count, shared by the tests that only read it or compare against it. Everything else the tests share is in
helpers.py."""

from __future__ import annotations

import signal

import pytest

from helpers import (
    REFERENCE_EXTRA,
    REFERENCE_TRAIN,
    ReferenceRun,
    kept_result,
    launch,
    recipe_env,
    run_in_process,
    shared_once,
    write_parquet_dataset,
    write_photo_folder,
)


@pytest.fixture
def env(tmp_path):
    return recipe_env(tmp_path)


@pytest.fixture
def foreground_signals():
    """SIGINT and SIGQUIT as a foreground terminal gives them. A shell without job control starts a
    background job (`pytest ... &`) with both ignored, and the recipes keep an ignored signal ignored, so a
    test that sends them to its own process sets them first."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGQUIT)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session")
def mnist_like(tmp_path_factory):
    """Hub-layout parquet, 1x28x28, 4 classes: train 320 (no validation split), test 99."""
    return shared_once(tmp_path_factory, "mnist_like", lambda d: write_parquet_dataset(d, {"train": 320, "test": 99}))


@pytest.fixture(scope="session")
def cifar_like(tmp_path_factory):
    """Hub-layout parquet with CIFAR's column name `img`, 3x32x32, 4 classes."""
    return shared_once(
        tmp_path_factory,
        "cifar_like",
        lambda d: write_parquet_dataset(d, {"train": 256, "test": 64}, shape=(3, 32, 32), image_col="img"),
    )


@pytest.fixture(scope="session")
def photos_like(tmp_path_factory):
    """A photo folder with train/ (3 classes x 60) and test/ (3 x 8): mixed sizes, formats and modes."""

    def make(root):
        write_photo_folder(root / "train", 60)
        write_photo_folder(root / "test", 8, seed=1)

    return shared_once(tmp_path_factory, "photos_like", make)


@pytest.fixture(scope="session")
def awkward(tmp_path_factory):
    """Hub-layout parquet with its own validation split of an awkward size: train 256, validation 99, test 82."""
    splits = {"train": 256, "validation": 99, "test": 82}
    return shared_once(tmp_path_factory, "awkward", lambda d: write_parquet_dataset(d, splits))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, mnist_like, cifar_like, awkward, photos_like):
    """reference_run(recipe, nproc) -> ReferenceRun, run once per session (by whichever worker asks first, see
    ``shared_once``): in that process for 1 process, `accelerate launch` with real gloo processes for 2."""
    root = shared_once(tmp_path_factory, "reference", lambda d: d.mkdir())
    env = recipe_env(root)
    done: dict = {}
    datasets = {"mnist_like": mnist_like, "cifar_like": cifar_like, "awkward": awkward, "photos_like": photos_like}

    def get(recipe: str, nproc: int) -> ReferenceRun:
        key = (recipe, nproc)
        if key not in done:
            fixture, flags = REFERENCE_TRAIN[key]
            data = datasets[fixture]
            train_args = ["--dataset", data, *flags]
            run = root / f"{recipe}-{nproc}proc"
            args = [*train_args, *REFERENCE_EXTRA.get(key, []), "--output-dir", run]

            def make(result):
                proc = run_in_process(recipe, args, env) if nproc == 1 else launch(recipe, args, env, nproc=nproc)
                kept_result(result, proc)

            proc = kept_result(shared_once(tmp_path_factory, f"reference-{recipe}-{nproc}proc.json", make))
            done[key] = ReferenceRun(run, proc, data, train_args)
        return done[key].ok()

    return get
