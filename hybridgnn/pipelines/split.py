"""Quiver's CPU lane (§4.2): CPU workers only sample; the device gathers and runs the model.

A SplitExecutor belongs to one CPU worker. It samples on the worker's thread (the
compiled CPU sampler, which releases the GIL), copies the sample into one of its staging
slots (pinned host memory on a GPU, reused: no pinned allocation per batch) and hands the
gather and the model to the lane's device stage. run_async() returns as soon as the
hand-off is made, and the worker samples its next batch while the device works on this
one; at most `slots` batches per worker are past the hand-off at once (each holds a slot
until its answer is back).

One SplitDeviceStage serves every worker of the lane: a few threads (HYBRIDGNN_SPLIT_
DEVICE_THREADS, default 1), each with a CUDA stream and a forward (CUDA graphs where
enabled) of its own, taking staged samples first come, first served. Why not a thread
per worker: on the H200, 16 workers each launching their own gathers and forwards spent
their time waiting for the GIL (a split batch took 61-125 ms on average, against 1.5 ms
for one worker alone); the launches are Python, so a few threads issue them
fastest. On a CPU device the stage computes on CPU tensors: how CI exercises the
hand-off, the sharing and the overlap.

The device stage gathers through the GPU pipeline's feature store (its FAP-ordered cache
and zero-copy host rows) and runs the GPU pipeline's model copy, so both lanes share one
device, one cache and one model, as the cost model (scheduler/queueing.py) assumes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time

import numpy as np
import torch

from hybridgnn.capabilities import DEVICE_GATE
from hybridgnn.features.store import gather_pending
from hybridgnn.pipelines.graphed import model_forward
from hybridgnn.pipelines.host_results import HostResults
from hybridgnn.pipelines.stage_clock import StageClock
from hybridgnn.types import BatchResult, StageTimings

SPLIT_SLOTS = 2  # staging slots per worker: batches a worker has past the hand-off at once


class _Slot:
    """Staging buffers of one batch in flight: sample ids and edges, grown by doubling."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.nodes = self._alloc((1024,))
        # flat: a batch's [2, m] edges are its first 2m entries, one contiguous block (a
        # column slice of a [2, capacity] buffer is not, and torch copies a non-contiguous
        # source to the device through pageable memory: a synchronous copy)
        self.edges = self._alloc((2 * 4096,))
        self.seeds = self._alloc((256,))
        self.results = HostResults(pinned)

    def _alloc(self, shape) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=torch.int64)
        with DEVICE_GATE.work():  # allocating pinned memory is a CUDA call
            return torch.empty(shape, dtype=torch.int64, pin_memory=True)

    def _fit(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        size = buf.shape[-1]
        if n <= size:
            return buf
        while size < n:
            size *= 2
        return self._alloc((*buf.shape[:-1], size))

    def stage(self, node_ids: np.ndarray, edge_index: np.ndarray, seed_index: np.ndarray) -> tuple[int, int, int]:
        n, m, s = len(node_ids), edge_index.shape[1], len(seed_index)
        self.nodes, self.seeds = self._fit(self.nodes, n), self._fit(self.seeds, s)
        self.edges = self._fit(self.edges, 2 * m)
        self.nodes[:n].copy_(torch.from_numpy(np.ascontiguousarray(node_ids, dtype=np.int64)))
        self.edges[:2 * m].view(2, m).copy_(torch.from_numpy(np.ascontiguousarray(edge_index, dtype=np.int64)))
        self.seeds[:s].copy_(torch.from_numpy(np.ascontiguousarray(seed_index, dtype=np.int64)))
        return n, m, s


def split_device_threads() -> int:
    """Threads of the split lane's device stage (HYBRIDGNN_SPLIT_DEVICE_THREADS, default 1)."""
    raw = os.environ.get("HYBRIDGNN_SPLIT_DEVICE_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"HYBRIDGNN_SPLIT_DEVICE_THREADS must be a whole number >= 1, got {raw!r}")
    return n


class _DeviceThread:
    """One thread of the device stage, with its stream and forward; `pending` counts the
    batches submitted to it and not yet finished (guarded by the stage's lock)."""

    def __init__(self, index: int, model, fanouts, device: torch.device):
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.forward = model_forward(model, fanouts, device, self.stream)  # graphs where enabled
        self.gather_clock = StageClock(device)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"split-device-{index}")
        self.pending = 0


class SplitDeviceStage:
    """The split lane's device stage (module docstring): gather and model for the staged
    samples of every worker. features, model, degrees: the GPU pipeline's (shared)."""

    def __init__(self, features, model, device: str | torch.device, fanouts, degrees=None, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.features, self.model = features, model
        self.degrees = degrees if getattr(model, "gcn_normalised", False) else None
        self.device = torch.device(device)
        self._threads = [_DeviceThread(i, model, fanouts, self.device) for i in range(threads)]
        self._lock = threading.Lock()

    @property
    def forward(self):
        """The first thread's forward (tests and benches read its replay counts)."""
        return self._threads[0].forward

    @forward.setter
    def forward(self, fn) -> None:
        if len(self._threads) > 1:  # a GraphedForward's buffers serve one thread at a time
            raise AttributeError("a stage of several threads has a forward per thread")
        self._threads[0].forward = fn

    def submit(self, slot: _Slot, sizes, nodes_per_hop, edges_per_hop, num_edges: int, t: StageTimings,
               handed: float, release) -> concurrent.futures.Future:
        """A future of one staged sample's result; release(slot) runs once the slot's
        buffers are no longer read (also when the device work fails)."""
        with self._lock:
            th = min(self._threads, key=lambda d: d.pending)  # the least loaded; ties to the first
            th.pending += 1
        try:
            future = th.pool.submit(self._on_device, th, slot, sizes, nodes_per_hop, edges_per_hop, num_edges, t,
                                    handed, release)
        except BaseException:
            with self._lock:
                th.pending -= 1
            raise

        def if_cancelled(f: concurrent.futures.Future) -> None:  # _on_device never ran: its finally neither
            if f.cancelled():
                release(slot)
                with self._lock:
                    th.pending -= 1

        future.add_done_callback(if_cancelled)
        return future

    def _on_device(self, th: _DeviceThread, slot: _Slot, sizes, nodes_per_hop, edges_per_hop, num_edges: int,
                   t: StageTimings, handed: float, release) -> BatchResult:
        """Gather and model on the device for one staged sample (on th's thread)."""
        n, m, s = sizes
        dev, stream = self.device, th.stream
        sync = stream.synchronize if stream is not None else (lambda: None)
        try:
            with DEVICE_GATE.work(), (torch.cuda.stream(stream) if stream is not None
                                      else contextlib.nullcontext()), torch.inference_mode():
                t2 = time.perf_counter()
                t.queue_wait_s += t2 - handed  # waited for the device stage
                node_ids = slot.nodes[:n].to(dev, non_blocking=True)
                edge_index = slot.edges[:2 * m].to(dev, non_blocking=True).view(2, m)
                th.gather_clock.start()  # timed by events: no wait between gather and model
                x, pending_tiers = gather_pending(self.features, node_ids)
                th.gather_clock.stop()
                degrees = self.degrees.tensors(node_ids) if self.degrees is not None else None
                out, hidden = th.forward(x, edge_index, nodes_per_hop, edges_per_hop, degrees)
                logits, emb, pred = slot.results.answer(out, hidden, nodes_per_hop[0], slot.seeds[:s].numpy(), sync)
                t4 = time.perf_counter()
                gather_s = min(th.gather_clock.seconds(), t4 - t2)
                tiers = pending_tiers()  # on this thread's stream, whose work is done
        except BaseException:
            with contextlib.suppress(Exception):
                sync()  # no copy launched above may still read the slot's pinned buffers once it is reused
            raise
        finally:
            release(slot)  # the copies are done (synchronised above) or failed
            with self._lock:
                th.pending -= 1
        t.gather_s, t.compute_s = gather_s, t4 - t2 - gather_s
        return BatchResult(logits=logits, embeddings=emb, predictions=pred.astype(np.int64, copy=False), timings=t,
                           sampled_edges=num_edges, gathered_rows=tiers)

    def close(self) -> None:
        """Finish what was submitted, then end the threads."""
        for th in self._threads:
            th.pool.shutdown(wait=True)


class SplitExecutor:
    """One CPU worker's executor of the split lane (module docstring). sampler: the
    worker's CPU sampler; features, model, degrees: the GPU pipeline's (shared). stage:
    the lane's shared device stage (Resources makes one); without it the executor makes
    one of its own and closes it with itself."""

    def __init__(self, sampler, features, model, device: str | torch.device, degrees=None, slots: int = SPLIT_SLOTS,
                 read_lock=contextlib.nullcontext, stage: SplitDeviceStage | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.sampler, self.features, self.model = sampler, features, model
        self.device = torch.device(device)
        self.read_lock = read_lock
        self._owns_stage = stage is None
        self.stage = stage if stage is not None else SplitDeviceStage(features, model, self.device, sampler.fanouts,
                                                                      degrees)
        self._free = [_Slot(pinned=self.device.type == "cuda") for _ in range(slots)]
        self._slot_ready = threading.Condition()
        self.handed_off = 0  # batches handed to the device stage (diagnostics and tests)
        self.on_device = 0  # of those, not yet finished (the router counts them as the GPU's load)

    @property
    def forward(self):
        return self.stage.forward

    @forward.setter
    def forward(self, fn) -> None:
        if not self._owns_stage:
            raise AttributeError("the device stage is shared: set its forward on the stage")
        self.stage.forward = fn

    def run(self, seeds: np.ndarray, timings: StageTimings | None = None) -> BatchResult:
        """Sample, hand off and wait for the answer (what a plain worker loop calls)."""
        return self.run_async(seeds, timings).result()

    def run_async(self, seeds: np.ndarray, timings: StageTimings | None = None) -> concurrent.futures.Future:
        """Sample on this thread, then a future of the batch's result from the device stage.
        Blocks while every staging slot is in flight; sampling errors raise here."""
        t = timings if timings is not None else StageTimings()
        with self.read_lock():
            t0 = time.perf_counter()
            sub = self.sampler.sample(seeds)
            t1 = time.perf_counter()
        t.sample_s = t1 - t0
        with self._slot_ready:
            while not self._free:
                self._slot_ready.wait()
            slot = self._free.pop()
            self.on_device += 1
        try:
            sizes = slot.stage(sub.node_ids, sub.edge_index, sub.seed_index)
            handed = time.perf_counter()
            future = self.stage.submit(slot, sizes, list(sub.num_sampled_nodes), list(sub.num_sampled_edges),
                                       int(sub.num_edges), t, handed, self._release)
        except BaseException:
            self._release(slot)
            raise
        self.handed_off += 1
        return future

    def _release(self, slot: _Slot) -> None:
        with self._slot_ready:
            self._free.append(slot)
            self.on_device -= 1
            self._slot_ready.notify_all()

    def close(self) -> None:
        """Wait for this worker's batches on the device; end the stage if it is its own."""
        with self._slot_ready:
            while self.on_device > 0:
                self._slot_ready.wait()
        if self._owns_stage:
            self.stage.close()
