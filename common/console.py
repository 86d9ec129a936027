"""The one way anything in this repository prints a line for the user: ``say(text)``.

It prints on the main process only (rank 0 of the job; every process when there is no job), to stdout,
flushed at once so a log file under ``nohup`` shows it as it happens, and through the progress bar when one
is shown, so that a message never lands on top of the bar. Code that prints does not need to know which
process it runs on, and no function needs a ``say`` or ``is_main`` parameter to print.

Errors are not said: they go to stderr as one paragraph (``common.errors.report``)."""

from __future__ import annotations

import os
import sys

from common.errors import printable

_bar = None  # the tqdm bar shown now (common.train.tracking.Progress sets it), or None


def is_main() -> bool:
    """Rank 0 of the job: the process group's rank once it exists, the launcher's RANK before that."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def say(text: str) -> None:
    """Print ``text`` on the main process (through the progress bar when one is shown). Control characters are
    written as text (``common.errors.printable``): a message may quote a file or class name from the user's
    data, and an escape sequence in it must not retitle, clear or rewrite the terminal."""
    if not is_main():
        return
    text = "\n".join(printable(line) for line in str(text).split("\n"))
    if _bar is not None:
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


def show_bar(bar) -> None:
    """Messages go through ``bar`` (tqdm.write) until ``show_bar(None)``."""
    global _bar
    _bar = bar
