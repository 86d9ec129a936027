"""An evaluation's pictures (the confusion matrix, the misclassified grid) drawn in a child process, so that the
training loop does not wait for matplotlib.

Drawing both took about 0.8 s per evaluation on the main process (a 2-core CPU) while the other processes waited at
their next collective: on a GPU, longer than the evaluation's forward passes. A thread of the training process would
not help: matplotlib holds the GIL, and a loop of small torch ops ran at 13% of its speed beside it, at full speed
beside the child (benchmarks/eval_overhead.py, benchmarks/README.md). ``Renderer`` hands each evaluation's numbers
(the confusion matrix; up to 36 misclassified images with their labels and predictions: about 100 KB) to one child
process (``CHILD``: this module's ``serve``, imported from the folder that holds this process's own ``common``,
never from the folder the run is launched from), which draws them, encodes PNGs and sends the PNGs back; the run puts
them in its one TensorBoard writer (``common.train.tracking.MetricsLog``). The child imports numpy, PIL and
matplotlib, not torch. It runs at the training processes' priority: drawing starved by them would only make the loop
wait for it later.

What it promises: jobs are drawn one at a time, in the order given (a tag's steps stay monotonic); ``submit`` waits
only when ``MAX_PENDING`` jobs are already waiting to be drawn; a child that cannot start or dies is replaced by
drawing in a thread of this process (slower, nothing lost); ``finish`` returns everything submitted, drawn, or
after ``timeout`` drops what is left and says how many. The child ignores SIGINT and SIGTERM (the run decides what
to finish on a stop) and ends on a stop message, when its input closes, or when its parent is gone. One child per
process, kept between runs in one process (``renderer()``) and stopped at exit. Main process only."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from common.train.plots import confusion_matrix_image, curves_png, misclassified_grid, png_bytes

MAX_PENDING = 2  # evaluations waiting to be drawn before the loop waits for one (evaluations outrunning drawing)
ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `common`, for the child's import
HEADER = struct.Struct(">II")  # a message: the lengths of its JSON part and of its bytes, then both
# The child's program, run as `python -c CHILD ROOT`. Not `python -m common.train.render`: that puts the current
# folder first on sys.path, so a `common` package in the folder the run is launched from would be imported (and run)
# instead of this one (`-P` would stop it, but only from Python 3.11). Under `-c` sys.path[0] is '' (the current
# folder; absent with PYTHONSAFEPATH): it is dropped and ROOT put first.
CHILD = (
    "import sys; sys.path[:] = [sys.argv[1], *(p for p in sys.path if p)]; "
    "from common.train.render import serve; serve()"
)


@dataclasses.dataclass
class Drawn:
    """A job's pictures: {name: (PNG bytes, height, width)}, or why they could not be drawn."""

    id: int
    pictures: dict
    error: str | None = None


def draw(job: dict, arrays: dict) -> dict:
    """The pictures ``job["draw"]`` names ("confusion", "misclassified"; "curves": the run's curves.png, from the
    metrics.jsonl at ``job["metrics"]``) as {name: (PNG bytes, height, width)}."""
    out = {}
    for name in job["draw"]:
        if name == "curves":
            from PIL import Image

            png = curves_png(job["metrics"])
            width, height = Image.open(io.BytesIO(png)).size  # the header only
            out[name] = (png, height, width)
            continue
        if name == "confusion":
            image = confusion_matrix_image(arrays["confusion"], job["class_names"], title=job["title"])
        else:
            image = misclassified_grid(arrays["images"], arrays["labels"], arrays["preds"], job["class_names"])
        out[name] = (png_bytes(image), int(image.shape[0]), int(image.shape[1]))
    return out


# --- messages: {JSON} + bytes, both ways -----------------------------------------------------------------------


def send(fd: int, meta: dict, blobs=()) -> None:
    text = json.dumps({**meta, "blobs": [len(b) for b in blobs]}).encode()
    data = memoryview(b"".join([HEADER.pack(len(text), sum(len(b) for b in blobs)), text, *blobs]))
    while data:
        data = data[os.write(fd, data) :]


def _read(fd: int, n: int, first: bool = False) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if first and left == n:
                return None  # closed between messages
            raise EOFError("the other end closed in the middle of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> tuple[dict, list[bytes]] | None:
    """The next message, or None when the other end has closed."""
    head = _read(fd, HEADER.size, first=True)
    if head is None:
        return None
    n_text, n_data = HEADER.unpack(head)
    meta = json.loads(_read(fd, n_text))
    data, blobs, at = _read(fd, n_data) if n_data else b"", [], 0
    for n in meta.pop("blobs"):
        blobs.append(data[at : at + n])
        at += n
    return meta, blobs


def pack_arrays(arrays: dict) -> tuple[dict, list[bytes]]:
    specs = {k: [str(a.dtype), list(a.shape)] for k, a in arrays.items()}
    return specs, [np.ascontiguousarray(a).tobytes() for a in arrays.values()]


def unpack_arrays(specs: dict, blobs: list[bytes]) -> dict:
    return {k: np.frombuffer(b, dtype=d).reshape(s) for (k, (d, s)), b in zip(specs.items(), blobs)}


# --- the run's side --------------------------------------------------------------------------------------------


class Renderer:
    """One drawing child (started at the first job) and the thread that talks to it. ``submit`` a job, ``collect``
    what is drawn, ``finish`` before the run ends. ``command``: the child (tests give others)."""

    def __init__(self, command: list[str] | None = None, max_pending: int = MAX_PENDING):
        self.command = command or [sys.executable, "-c", CHILD, str(ROOT)]
        self.max_pending, self.next_id, self.in_flight = max_pending, 0, 0
        self.jobs, self.done, self.ready = queue.Queue(), queue.Queue(), []
        self.generation = 0  # bumped when pending jobs are dropped: the thread throws their results away
        self.proc, self.thread, self.lock = None, None, threading.Lock()
        self.fallback = None  # why pictures are drawn in this process (the child could not start, or died)

    def submit(self, job: dict, arrays: dict, timeout: float = 60.0) -> int:
        """Queue ``job`` ({"title", "class_names", "draw"}) with its ``arrays`` (numpy, or tensors on any device:
        copied to the host here); returns its id. Waits only when ``max_pending`` jobs are already waiting (then for
        one of them, at most ``timeout`` s)."""
        arrays = {k: v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in arrays.items()}
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._courier, name="render-courier", daemon=True)
            self.thread.start()
        deadline = time.monotonic() + timeout
        while self.in_flight >= self.max_pending and self._take(deadline):
            pass
        if self.in_flight >= self.max_pending:  # the child is stuck: start over rather than hold the loop
            self._drop()
        job_id, self.next_id = self.next_id, self.next_id + 1
        self.jobs.put((self.generation, job_id, job, arrays))
        self.in_flight += 1
        return job_id

    def collect(self, until: int | None = None, timeout: float = 60.0) -> list[Drawn]:
        """The jobs drawn since the last call; with ``until``, after waiting (at most ``timeout`` s) for that job."""
        deadline = time.monotonic() + timeout
        while self._take(None):
            pass
        while until is not None and all(d.id != until for d in self.ready) and self.in_flight:
            if not self._take(deadline):
                break
        out, self.ready = self.ready, []
        return out

    def finish(self, timeout: float = 30.0) -> tuple[list[Drawn], int]:
        """Everything submitted, drawn (in order); what is not drawn after ``timeout`` s is dropped: (drawn, how many
        were dropped). The child stays for the next run of this process."""
        deadline = time.monotonic() + timeout
        while self.in_flight and self._take(deadline):
            pass
        dropped = self.in_flight
        if dropped:
            self._drop()
        out, self.ready = self.ready, []
        return out, dropped

    def stop(self) -> None:
        """End the child (at exit)."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            send(proc.stdin.fileno(), {"stop": True})
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def _take(self, deadline: float | None) -> bool:
        """One drawn job into ``ready``: without waiting (deadline None), or until ``deadline``. False if none."""
        try:
            if deadline is None:
                generation, drawn = self.done.get_nowait()
            else:
                generation, drawn = self.done.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return False
        if generation == self.generation:  # (else a job dropped just as it was drawn: no longer counted)
            self.ready.append(drawn)
            self.in_flight -= 1
        return True

    def _drop(self) -> None:
        """Give up on the pending jobs: their results are thrown away, the child killed (a new one starts)."""
        self.generation += 1
        self.in_flight = 0
        with contextlib.suppress(queue.Empty):
            while True:
                self.jobs.get_nowait()
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def _courier(self) -> None:
        """The thread: each job to the child and its pictures back, in order (or drawn here when there is no child)."""
        while True:
            generation, job_id, job, arrays = self.jobs.get()
            try:
                drawn = self._in_child(job_id, job, arrays)
            except Exception as err:  # no child, or it died or garbled its answer
                if generation != self.generation:  # dropped meanwhile: its child was killed on purpose
                    continue
                self.fallback = self.fallback or f"{type(err).__name__}: {err}"
                with self.lock:
                    proc, self.proc = self.proc, None
                if proc is not None:
                    proc.kill()
                try:
                    drawn = Drawn(job_id, draw(job, arrays))
                except Exception as failed:  # a bug or bad numbers: said, the run goes on
                    drawn = Drawn(job_id, {}, f"{type(failed).__name__}: {failed}")
            self.done.put((generation, drawn))

    def _in_child(self, job_id: int, job: dict, arrays: dict) -> Drawn:
        with self.lock:
            if self.fallback is not None:
                raise OSError(self.fallback)
            if self.proc is None:
                pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
                self.proc = subprocess.Popen(self.command, **pipes, env=child_env())
            proc = self.proc
        specs, blobs = pack_arrays(arrays)
        send(proc.stdin.fileno(), {**job, "id": job_id, "arrays": specs}, blobs)
        reply = receive(proc.stdout.fileno())
        if reply is None:
            raise EOFError(f"the drawing process ended (exit {proc.poll()})")
        meta, pngs = reply
        if meta.get("id") != job_id:
            raise ValueError(f"the drawing process answered job {meta.get('id')} for job {job_id}")
        pictures = {name: (png, h, w) for (name, h, w), png in zip(meta.get("pictures", []), pngs)}
        return Drawn(job_id, pictures, meta.get("error"))


def child_env() -> dict:
    """This process's environment for the child, less PYTHONPATH's empty entries: Python reads each as the current
    folder, and the child imports nothing from the folder the run is launched from."""
    env = dict(os.environ)
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


_SHARED: Renderer | None = None


def renderer() -> Renderer:
    """This process's renderer: its child is started at the first job and stopped at exit."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Renderer()
        atexit.register(_SHARED.stop)
    return _SHARED


# --- the child ---------------------------------------------------------------------------------------------


def serve(inp: int = 0) -> None:
    """The child's loop: a job in, its pictures (or its error) out, until a stop message, closed input, or the parent
    is gone. Anything printed goes to stderr, never into a message."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    out = os.dup(1)
    os.dup2(2, 1)
    parent = os.getppid()
    while True:
        if not select.select([inp], [], [], 5.0)[0]:
            if os.getppid() != parent:
                return
            continue
        message = receive(inp)
        if message is None or message[0].get("stop"):
            return
        job, blobs = message
        try:
            drawn = draw(job, unpack_arrays(job["arrays"], blobs))
            reply = {"id": job["id"], "pictures": [[k, h, w] for k, (_, h, w) in drawn.items()]}
            pngs = [png for png, _, _ in drawn.values()]
        except Exception as err:  # a bug or bad numbers: the run says so and goes on
            reply, pngs = {"id": job["id"], "error": f"{type(err).__name__}: {err}"}, []
        try:
            send(out, reply, pngs)
        except OSError:  # the parent is gone
            return


if __name__ == "__main__":
    serve()
