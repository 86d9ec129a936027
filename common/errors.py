"""Errors a user can fix, and the exit codes every command of this repository uses.

Each error's message is one paragraph that names the problem and the fix; commands print it after
``error:`` with no traceback and exit with the error's code. Through ``accelerate launch`` (torchrun)
every non-zero worker exit reaches the shell as 1, so a run also records how it ended in
``<run>/summary.json`` (``status``); see docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from datetime import timedelta

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a tool's own check failed (export: onnxruntime disagrees with PyTorch)
EXIT_BAD_INPUT = 2  # bad data, config, checkpoint or path
EXIT_NONFINITE = 3  # the loss became NaN/inf; nothing written after the last good checkpoint
EXIT_TARGET_MISSED = 4  # --target-accuracy was not reached
EXIT_PREEMPTED = 75  # stopped by a signal (or a lost launcher) after writing a checkpoint; rerun to resume


class RecipeError(Exception):
    """Bad input the user can fix."""

    exit_code = EXIT_BAD_INPUT
    status = "bad_input"

    def __init__(self, message: str = ""):
        super().__init__(_from_worker(str(message)))


def _from_worker(message: str) -> str:
    """A DataLoader worker's error reaches the training process re-raised with the worker's traceback as its message
    ('Caught DataError in DataLoader worker process 0. Original Traceback ...'): keep its own paragraph, and say
    where it came from."""
    first, _, rest = message.partition("\n")
    if not (first.startswith("Caught ") and " in DataLoader worker process " in first and rest):
        return message
    last = rest.rstrip().rsplit("\n", 1)[-1]
    return f"{last.split(': ', 1)[1] if ': ' in last else last} (in a DataLoader worker)"


class ConfigError(RecipeError):
    """A bad setting."""


class DataError(RecipeError):
    """Unusable data."""


class StorageError(RecipeError):
    """The run directory's filesystem refused a write (full, over quota, read-only): not the user's input, not a
    bug; the last complete checkpoint is intact."""

    exit_code = 1
    status = "storage_error"


class OutOfMemory(RecipeError):
    """The GPU ran out of memory: the message names the batch that did not fit and the setting that keeps the run
    the same in smaller batches."""

    exit_code = 1
    status = "out_of_memory"


class NonFiniteLoss(RecipeError):
    exit_code = EXIT_NONFINITE
    status = "nonfinite_loss"


class Unfinished(RecipeError):
    """The recipe's train() returned without run.finish(): a loop edit, not bad input; the position is
    checkpointed."""

    exit_code = 1
    status = "unfinished"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: what a terminal acts on instead of showing


def printable(text) -> str:
    """``text`` (any object, as ``str()`` gives it) with every control character written as ``\\xNN``:
    how a command prints a string it read from a file it was given (class names and settings in model.json
    or config.json, file names in a received folder), so that an escape sequence in it shows as text
    instead of retitling, clearing or rewriting the user's terminal. Other characters ('café', '猫') are
    kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


SAID_ONCE_WAIT_S = 15.0  # how long a process waits for the main process to say the same bad input


def report(err: RecipeError) -> int:
    """Print ``err`` as one paragraph on stderr and return its exit code. Every command of this repository ends a
    user error this way. Messages often quote what a file held, so control characters are escaped (a line break an
    embedded message carries is kept).

    In a job of several processes the message carries its rank, and bad input (the same data, flags or files stop
    every process alike) is said once: the main process says it and posts it in the launcher's key-value store; any
    other process waits for that (up to ``SAID_ONCE_WAIT_S``) and prints its own only when it differs or never
    came. Waiting also keeps a process from exiting first, which would make the launcher stop the main process
    before it has said anything. Other errors (a non-finite loss: each process says it stopped) print on every
    process."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    message = "\n".join(printable(line) for line in str(err).split("\n"))
    said_once = world > 1 and err.exit_code == EXIT_BAD_INPUT
    key = f"accelerate-recipes/said/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if said_once and rank != 0 and _said_by_main(_job_store(), key) == message:
        return err.exit_code
    sys.stderr.write(f"{f'[rank {rank}] ' if world > 1 else ''}error: {message}\n")
    sys.stderr.flush()
    store = _job_store() if said_once and rank == 0 else None  # after printing: a store out of reach costs no delay
    if store is not None:
        with contextlib.suppress(Exception):  # the others then print theirs
            store.set(key, message)
    return err.exit_code


def _job_store():
    """A client of the launcher's key-value store (torchrun's, at MASTER_ADDR:MASTER_PORT), or None."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
    except Exception:  # noqa: BLE001 - no store to reach: every process prints its own
        return None


def _said_by_main(store, key: str) -> str | None:
    if store is None:
        return None
    try:
        store.wait([key], timedelta(seconds=SAID_ONCE_WAIT_S))
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - not said in time (the main process runs on, or failed otherwise)
        return None


def run_command(run, args) -> int:
    """``run(args)``'s exit code, or a user error reported as one paragraph with its own code: the body of a
    tool's ``main()``."""
    try:
        return run(args)
    except RecipeError as err:
        return report(err)


class Preempted(Exception):
    """Not an error: the run stopped early on request (a signal, a lost launcher) after writing a
    checkpoint. The same command with --resume-from latest continues it."""

    exit_code = EXIT_PREEMPTED
    status = "preempted"


# how a run ended (summary.json's ``status``) -> its exit code: the endings that are no error, then each error's own
EXIT_CODES = {
    "running": EXIT_OK,
    "completed": EXIT_OK,
    "target_missed": EXIT_TARGET_MISSED,
    "crashed": 1,
    **{
        end.status: end.exit_code
        for end in (RecipeError, StorageError, OutOfMemory, NonFiniteLoss, Unfinished, Preempted)
    },
}
