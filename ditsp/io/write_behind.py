"""Encoding behind the computation: a writer's frames go to a thread of their own, so the next window starts.

Rank 0 of a restoration writes every frame. Writing in its main thread made every other rank wait at
the window boundary while the encoder ran. :class:`WriteBehind` hands each chunk of frames to one
thread that encodes them in the order given, while the main thread goes on to the next window; the
encoder releases the GIL, so the two run side by side. The file's bytes are the same: the same frames
reach the same writer in the same order. The encoder holds its last frames until the file is closed
(x264's lookahead: 40 frames at preset medium), so what overlaps is the encoding of the frames before
them: on one core here, a 120-frame 256x256 clip in 13-frame chunks encoded 0.1 s per chunk behind the
restoration and 0.27 s at the close; a clip of 40 frames or fewer is encoded at the close.

A write error is kept and raised, as itself, in the main thread at the next :meth:`check`,
:meth:`write` or :meth:`close` (the restoration calls :meth:`check` before each window boundary, so
every rank learns of it there). At most ``depth`` chunks wait (each a window's frames in uint8), so a
slow disk bounds memory rather than letting it grow. :meth:`abort` stops the thread and removes the
partial file, as the writer's own ``abort`` does.
"""

from __future__ import annotations

import queue
import threading
import time

_STOP = object()


class WriteBehind:
    """Runs ``writer.write`` in a thread of its own; ``writer`` is a :class:`~ditsp.io.write.VideoWriter`."""

    def __init__(self, writer, depth: int = 2):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._aborted = threading.Event()
        self.busy: list[tuple[object, float, float, float]] = []  # per chunk: tag, start, end (perf_counter), CPU s
        self._thread = threading.Thread(target=self._run, name="ditsp-write-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            tag, frames = item
            if self._error is not None or self._aborted.is_set():
                continue  # drain without writing: the main thread raises or has aborted
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self.writer.write(frames)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread as it was
                self._error = e
            self.busy.append((tag, start, time.perf_counter(), time.thread_time() - cpu))

    def check(self) -> None:
        """Raise the error a write hit, if any (in the calling thread)."""
        if self._error is not None:
            raise self._error

    def write(self, frames, tag=None) -> None:
        """Queue ``frames`` (not to be changed afterwards); waits while ``depth`` chunks are already queued.
        ``tag`` labels the chunk's entry in :attr:`busy`."""
        self.check()
        if not self._thread.is_alive():
            raise RuntimeError("the writer's thread has stopped")
        self._queue.put((tag, frames))

    def finish(self) -> None:
        """Wait until every queued chunk is written; raises a write's error. Nothing may be queued after it."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self.check()

    def close(self):
        """:meth:`finish`, then close the writer (the file appears)."""
        self.finish()
        return self.writer.close()

    def abort(self) -> None:
        """Stop writing (the chunk being encoded finishes) and remove the partial file; never raises a write's error."""
        self._aborted.set()
        while self._thread.is_alive():  # make room for the stop marker without waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self.writer.abort()

