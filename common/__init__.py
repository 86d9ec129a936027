"""The recipes' library, in floors that import only downward: the ground floor (errors, console, files, config), the
techniques a recipe picks (models, vision, optimizers, schedules, averaging), ``data/`` (datasets, pixels, the decoded
cache, photos, augmentation), ``train/`` (the run and the parts it owns) and ``tools/`` (predict, export, and
recipe_files: a recipe file as a module)."""

import sys

if sys.platform == "win32":  # signals, fcntl locks and the launcher's process handling are POSIX
    sys.stderr.write(
        "error: these recipes run on Linux and macOS. On Windows, use WSL 2 (Windows Subsystem for "
        "Linux: `wsl --install`, then follow README's setup inside it); native Windows lacks the file "
        "locks and signals that keep runs safe to stop, resume and share.\n"
    )
    raise SystemExit(2)
