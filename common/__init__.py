"""Shared pieces of the recipes: data, models, metrics, checkpoints, run plumbing."""

import sys

if sys.platform == "win32":  # signals, fcntl locks and the launcher's process handling are POSIX
    sys.stderr.write(
        "error: these recipes run on Linux and macOS. On Windows, use WSL 2 (Windows Subsystem for "
        "Linux: `wsl --install`, then follow README's setup inside it); native Windows lacks the file "
        "locks and signals that keep runs safe to stop, resume and share.\n"
    )
    raise SystemExit(2)

from common import moved  # noqa: E402 - after the platform check

moved.install()  # code written for 0.4's module paths is told where they moved
