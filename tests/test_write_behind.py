"""WriteBehind: frames encoded in a thread of their own give the same file; its errors reach the main thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ditsp.io.testclip import make_test_clip
from ditsp.io.write import VideoWriter
from ditsp.io.write_behind import WriteBehind

pytestmark = pytest.mark.timeout(120)


def _frames(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 32, 48), generator=g, dtype=torch.uint8)


def test_same_bytes_as_writing_in_the_calling_thread(tmp_path):
    frames = _frames(10)
    direct = VideoWriter(tmp_path / "direct.mp4", 12)
    for i in range(0, 10, 3):
        direct.write(frames[i : i + 3])
    direct.close()
    behind = WriteBehind(VideoWriter(tmp_path / "behind.mp4", 12), depth=1)
    for i in range(0, 10, 3):
        behind.write(frames[i : i + 3], tag=i)
    behind.close()
    assert (tmp_path / "direct.mp4").read_bytes() == (tmp_path / "behind.mp4").read_bytes()
    assert [tag for tag, *_ in behind.busy] == [0, 3, 6, 9]
    assert all(end >= start and cpu >= 0 for _, start, end, cpu in behind.busy)


def test_a_write_error_is_raised_as_itself_in_the_main_thread_and_nothing_is_left(tmp_path):
    behind = WriteBehind(VideoWriter(tmp_path / "o.mp4", 12))
    behind.write(_frames(2))
    behind.write(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))  # another frame size: the writer refuses it
    with pytest.raises(ValueError, match="16x16"):
        behind.finish()
    with pytest.raises(ValueError):  # and again at every later call: the error is not lost
        behind.check()
    behind.abort()
    assert os.listdir(tmp_path) == []


class _SlowWriter:
    def __init__(self):
        self.written, self.aborted, self.started = 0, False, threading.Event()

    def write(self, frames):
        self.started.set()
        time.sleep(0.2)
        self.written += 1

    def abort(self):
        self.aborted = True


def test_abort_drops_what_waits_and_does_not_hang_on_a_full_queue():
    slow = _SlowWriter()
    behind = WriteBehind(slow, depth=2)
    for _ in range(3):  # one being written, two waiting: the queue is full
        behind.write(None)
    slow.started.wait(5)
    t = time.perf_counter()
    behind.abort()
    assert time.perf_counter() - t < 1.0
    assert slow.written == 1 and slow.aborted


def test_a_failing_write_fails_the_restoration_and_leaves_no_file(tmp_path, monkeypatch):
    """A write error in the thread surfaces in the job (at the next window boundary or the end), which then
    removes its partial output: the job fails as it did when rank 0 wrote in its own thread."""
    from ditsp.distributed.launcher import RankContext
    from ditsp.models.seedvr2.job.request import Options, check
    from ditsp.models.seedvr2.job.restore import rank_upscale

    src = make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=21, fps=10, audio=False)
    calls = []

    def fails_second(self, frames):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(self, frames)

    real_write = VideoWriter.write
    monkeypatch.setattr(VideoWriter, "write", fails_second)
    out = tmp_path / "out" / "o.mp4"
    out.parent.mkdir()
    req = check(Options(input=str(src), output=str(out), model="tiny-8x", random_weights=True, resolution="32x32",
                        progress=False, window_frames=9, overlap=4)).req
    torch.set_num_threads(1)
    with pytest.raises(OSError, match="No space left"):
        rank_upscale(RankContext(0, 1, None, torch.device("cpu")), req)
    assert calls[:2] == ["ditsp-write-behind"] * 2  # written behind, not by the restoring thread
    assert os.listdir(out.parent) == []
