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

# The long tests, marked integration here by node id (a whole test, or one case of a parametrized test whose other
# cases stay quick): each took about 12 s or more on a 2-core CPU (launches of 2 processes, SLURM, two nodes, the
# benchmarks' own runs). With them out, `pytest -m "not integration"` is the quick tier CI runs; `pytest -m
# integration` runs them (and the tests marked in their files: a real compile, the GPU script's rehearsal).
LONG = {
    "tests/test_bad_input.py::test_a_batch_larger_than_the_split_is_refused_on_two_processes_too",
    "tests/test_bad_input.py::test_bad_input_on_two_processes_is_said_once[data]",
    "tests/test_bad_input.py::test_bad_input_on_two_processes_is_said_once[flag]",
    "tests/test_bad_input.py::test_bad_input_on_two_processes_is_said_once[photo]",
    "tests/test_bad_input.py::test_bad_input_that_differs_by_process_is_said_by_each[differ]",
    "tests/test_bad_input.py::test_bad_input_that_differs_by_process_is_said_by_each[only_rank_1]",
    "tests/test_benchmark.py::test_scaling_runs_one_and_two_processes_through_accelerate_and_raw_ddp",
    "tests/test_data.py::test_an_unchanged_folder_is_read_without_datasets_and_a_changed_one_is_decoded_again",
    "tests/test_data.py::test_two_processes_racing_for_the_cache_decode_each_split_once",
    "tests/test_fault_tolerance.py::test_a_kill_during_a_checkpoint_write_and_a_damaged_complete_checkpoint",
    "tests/test_fault_tolerance.py::test_mid_epoch_resume_is_exact[2]",
    "tests/test_fault_tolerance.py::test_one_failing_rank_ends_the_job",
    "tests/test_fault_tolerance.py::test_port_in_use",
    "tests/test_fault_tolerance.py::test_sync_bn_two_processes_equals_one_process_full_batch",
    "tests/test_fault_tolerance.py::test_two_nodes_over_loopback_train_together",
    "tests/test_finetune_folder.py::test_a_weights_file_with_a_1000_class_head_loads_into_a_3_class_model",
    "tests/test_finetune_folder.py::test_mixup_cutmix_and_ema_train_and_the_ema_is_what_is_saved",
    "tests/test_finetune_folder.py::test_the_recipes_own_augmentation_trains_and_resumes_exactly",
    "tests/test_finetune_folder.py::test_trains_on_photos_of_any_size_and_mode_at_1_and_2_processes",
    "tests/test_fsdp.py::test_a_sharded_checkpoint_is_resumed_only_sharded",
    "tests/test_gpu_paths.py::test_compiled_run_files_load_everywhere[finetune_folder]",
    "tests/test_gpu_paths.py::test_compiled_run_files_load_everywhere[mnist_convnet]",
    "tests/test_gpu_paths.py::test_fp16_with_and_without_clipping[finetune_folder-extra5]",
    "tests/test_hot_path.py::test_no_sync_between_log_steps[finetune_folder-photos_like-extra4]",
    "tests/test_image_folders.py::test_two_processes_read_the_same_split_of_a_folder",
    "tests/test_launcher_promises.py::test_a_cpu_launch_that_leaves_cores_idle_says_what_to_run",
    "tests/test_launcher_promises.py::test_a_nohup_run_survives_the_logout_of_its_shell",
    "tests/test_launcher_promises.py::test_no_shared_filesystem_is_refused_on_every_node",
    "tests/test_launcher_promises.py::test_one_writer_per_run_directory_and_a_terminated_launcher",
    "tests/test_loop_edits.py::test_break_and_continue_on_two_processes_through_the_launcher",
    "tests/test_loop_edits.py::test_continue_before_the_step_skips_the_batch[finetune_folder]",
    "tests/test_model_families.py::test_a_transformers_folder_trains_resumes_exactly_and_predict_export_and_eval_only_load_it",
    "tests/test_photo_tables.py::test_a_parquet_image_dataset_trains_exactly_as_the_same_photos_in_a_folder",
    "tests/test_photo_tables.py::test_memory_stays_flat_in_the_number_of_photos",
    "tests/test_photo_trust.py::test_a_weights_run_resumes_without_its_file_and_keeps_its_normalisation",
    "tests/test_photo_trust.py::test_eval_only_normalises_as_the_scored_run_did_on_any_data",
    "tests/test_photo_trust.py::test_every_path_scores_large_photos_of_odd_sizes_alike",
    "tests/test_photo_trust.py::test_the_ema_is_one_model_on_every_rank_and_resumes_exactly_at_2_processes",
    "tests/test_predict.py::test_cli_folder_table_csv_and_output_file",
    "tests/test_predict.py::test_model_class_of_a_users_own_recipe_file",
    "tests/test_recipes.py::test_eval_only_on_two_processes",
    "tests/test_recipes.py::test_recipe_end_to_end[2-cifar_cnn]",
    "tests/test_recipes.py::test_recipe_end_to_end[2-fashion_mnist_mlp]",
    "tests/test_slurm.py::test_batch_script_checkpoints_requeues_and_resumes",
    "tests/test_slurm.py::test_real_slurm_requeue_and_resume",
    "tests/test_techniques.py::test_cifar_resume_with_lookahead_and_whitening_is_exact[2]",
    "tests/test_time_to_accuracy.py::test_airbench_baseline_on_the_recipes_split_and_the_recipe_timed_to_its_accuracy",
    "tests/test_user_commands.py::test_copied_recipe_with_its_own_model_is_served_by_every_tool",
    "tests/test_user_commands.py::test_cpu_config_that_starts_one_process_says_so",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in LONG or item.nodeid.split("[", 1)[0] in LONG:
            item.add_marker(pytest.mark.integration)


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
