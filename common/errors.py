"""Errors a user can fix, and the exit codes every command of this repository uses.

Each error's message is one paragraph that names the problem and the fix; commands print it after
``error:`` with no traceback and exit with the error's code. Through ``accelerate launch`` (torchrun)
every non-zero worker exit reaches the shell as 1, so a run also records how it ended in
``<run>/summary.json`` (``status``); see README, "Fault tolerance".
"""

from __future__ import annotations

import os
import re
import sys

EXIT_OK = 0
EXIT_CHECK_FAILED = 1    # a tool's own check failed (export: onnxruntime disagrees with PyTorch)
EXIT_BAD_INPUT = 2       # bad data, config, checkpoint or path
EXIT_NONFINITE = 3       # the loss became NaN/inf; nothing written after the last good checkpoint
EXIT_TARGET_MISSED = 4   # --target-accuracy was not reached
EXIT_PREEMPTED = 75      # stopped by a signal (or a lost launcher) after writing a checkpoint; rerun to resume


# how a run ended (summary.json's ``status``) -> its exit code
EXIT_CODES = {"running": EXIT_OK, "completed": EXIT_OK, "target_missed": EXIT_TARGET_MISSED, "bad_input": EXIT_BAD_INPUT,
              "nonfinite_loss": EXIT_NONFINITE, "storage_error": 1, "preempted": EXIT_PREEMPTED, "crashed": 1}


class RecipeError(Exception):
    """Bad input the user can fix."""

    exit_code = EXIT_BAD_INPUT
    status = "bad_input"


class ConfigError(RecipeError):
    """A bad setting."""


class DataError(RecipeError):
    """Unusable data."""


class StorageError(RecipeError):
    """The run directory's filesystem refused a write (full, over quota, read-only): not the user's input, not a
    bug; the last complete checkpoint is intact."""

    exit_code = 1
    status = "storage_error"


class NonFiniteLoss(RecipeError):
    exit_code = EXIT_NONFINITE
    status = "nonfinite_loss"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: what a terminal acts on instead of showing


def printable(text) -> str:
    """``text`` (any object, as ``str()`` gives it) with every control character written as ``\\xNN``:
    how a command prints a string it read from a file it was given (class names and settings in model.json
    or config.json, file names in a received folder), so that an escape sequence in it shows as text
    instead of retitling, clearing or rewriting the user's terminal. Other characters ('café', '猫') are
    kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def report(err: RecipeError) -> int:
    """Print ``err`` as one paragraph on stderr (prefixed with the rank in a multi-process job) and return
    its exit code. Every command of this repository ends a user error this way. Messages often quote what a
    file held, so control characters are escaped (a line break an embedded message carries is kept)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    message = "\n".join(printable(line) for line in str(err).split("\n"))
    sys.stderr.write(f"{f'[rank {rank}] ' if world > 1 else ''}error: {message}\n")
    sys.stderr.flush()
    return err.exit_code


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
