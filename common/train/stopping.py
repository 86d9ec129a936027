"""Why a run should stop early, noticed on any rank: a signal, or a launcher that is gone.

- SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 set a flag; the training loop sees it at the next optimizer step
  (``common.train.run``), every rank writes a checkpoint, and the run exits with 75 ("preempted").
  torchrun forwards TERM/INT/HUP/QUIT to its workers, not USR1: under SLURM, slurm/train.sbatch turns
  the USR1 warning into a TERM for the launcher. torchrun kills its workers 30 s after forwarding a
  TERM, so the checkpoint must be written well inside that (it takes about a second for these models).
- A launcher killed outright (``kill -9``) leaves its workers running under PID 1; a watcher thread sees
  the parent change within a second and raises the same flag, so the orphans checkpoint and exit
  instead of racing a rerun in the same run directory. Only workers of a launcher (``accelerate launch``
  or torchrun as the parent) watch: ``nohup python recipes/x.py &`` keeps running when its shell logs out,
  and a HUP that was ignored at start (nohup) stays ignored.
- A second Ctrl-C ends the process at once (KeyboardInterrupt), without waiting for a step boundary.
- Phases with nothing to checkpoint (reading and decoding the data, waiting for a peer to decode it, the
  final evaluation, all of --eval-only) are ``interruptible``: a stop request ends them at once.
"""

from __future__ import annotations

import os
import signal
import threading

from common.errors import Preempted

WATCH_INTERVAL_S = 1.0
# torchrun forwards TERM, INT, HUP and QUIT to its workers; USR1 comes from slurm/train.sbatch's warning.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


LAUNCHERS = (
    "accelerate launch",
    "accelerate-launch",
    "accelerate.commands.launch",
    "accelerate/commands/launch",
    "torchrun",
    "torch.distributed.run",
    "torch/distributed/run",
)


def launched_by_a_launcher(parent: int) -> bool:
    """True when the parent process is `accelerate launch` (either launcher) or torchrun; a shell is not."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's workers, on any system
        return True
    try:
        cmd = open(f"/proc/{parent}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # no /proc (macOS): the single-process accelerate launcher goes unwatched there
        return False
    return any(name in cmd for name in LAUNCHERS)


class StopFlag:
    def __init__(self):
        self.reason, self.phase, self.error, self.checks = "", None, None, []
        self._previous = {}
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:  # `nohup` ignores HUP: a logout must not stop the run
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._parent = os.getppid()
        self._done = threading.Event()
        # Only a launcher's worker watches its parent: a plain `python recipe.py` (under nohup, say) outlives
        # the shell that started it on purpose.
        if self._parent != 1 and launched_by_a_launcher(self._parent):
            threading.Thread(target=self._watch_parent, name="launcher-watch", daemon=True).start()

    def __bool__(self) -> bool:
        for check in self.checks:  # read once per optimizer step: a non-blocking look at a pipe
            error = check.poll()
            if error is not None:
                self.fail(error)
        return bool(self.reason)

    def watch(self, check) -> None:
        """Ask ``check.poll()`` (``common.data.damaged.DamagedPhotos``) at every look at the flag; an error it returns
        stops the run (``fail``)."""
        self.checks.append(check)

    def _on_signal(self, signum, frame) -> None:
        if self.reason and signum == signal.SIGINT:  # a second Ctrl-C: stop now, without the checkpoint
            raise KeyboardInterrupt
        self.reason = self.reason or f"signal {signal.Signals(signum).name}"
        if self.phase:  # nothing to checkpoint in this phase: stop at once
            self._raise()

    def fail(self, error) -> None:
        """Stop at the next optimizer step every rank agrees on, and end there with ``error`` (a
        RecipeError: too many damaged photos) instead of "preempted"."""
        self.error = self.error or error
        self.reason = self.reason or "damaged photos"

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
        phase, self.phase = self.phase, None
        raise Preempted(
            f"stopped by {self.reason} while {phase}; no training was lost (nothing had trained since "
            "the last checkpoint). Rerun the same command (with --resume-from latest once the run has "
            "started) to continue."
        )

    def interruptible(self, phase: str | None) -> None:
        """From now on a stop request ends the process at once with Preempted (``phase`` names what it was
        doing: reading the data, the final evaluation, ...); None: back to stopping at the next optimizer step.
        A request that came before raises here."""
        self.phase = phase
        if phase and self.reason:
            self._raise()

    def _watch_parent(self) -> None:
        while not self._done.wait(WATCH_INTERVAL_S):
            if os.getppid() != self._parent:
                self.reason = self.reason or f"the loss of its launcher (PID {self._parent})"
                return

    def close(self) -> None:
        """Stop watching and put the previous handlers back (a run inside a longer-lived process)."""
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
