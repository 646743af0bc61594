"""How long a stage of device work took, measured without waiting for it.

On a GPU a wait between stages (to read a clock) stalls the host until the device is
idle, so the next stage's launches cannot overlap the last stage's work; for a small
batch that wait is a good part of its cost. The clock records CUDA events on the
current stream instead and reads them after the batch's one final wait. On a CPU device
the work is done when the call returns, so the wall clock is the same thing.
"""

from __future__ import annotations

import time

import torch


class StageClock:
    """One span per batch: start(), stop() around the stage's launches, seconds() after
    the stream has been synchronised. One per worker, used by one thread at a time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._wall = 0.0
        self._started = 0.0

    def start(self) -> None:
        if self.cuda:
            self._begin.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._wall = time.perf_counter() - self._started

    def seconds(self) -> float:
        """The span's length; on a GPU only once the stream's work up to stop() is done."""
        if self.cuda:
            return self._begin.elapsed_time(self._end) / 1e3
        return self._wall
