"""The offline workload generator and closed-loop runner behind `hybridgnn profile`.

Batches span the PSGS range: seeds are split into PSGS quantile buckets; each batch aims
at a log-spaced PSGS bin (mostly the one with the fewest samples so far, so rare corners
of the range fill as fast as common ones), takes its seeds from a bucket that can reach
that bin within 1..max_batch seeds, and sizes itself to land there. Each pipeline runs closed loop with concurrency equal to its
workers (each worker thread runs its next batch as soon as the last one ends): the
pipeline is fully used, yet nothing else queues, so a latency is the batch's own service time
(a split lane's workers share one device stage, and its queue is taken out: own_service).
Samples land in log-spaced PSGS bins; the run ends when every reachable bin holds
`min_samples` (enough for a stable p99) or the time budget is spent.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hybridgnn.scheduler.curves import Samples

MAX_BINS = 1000
MAX_BATCH = 1 << 20  # seeds


@dataclass(frozen=True)
class ProfileConfig:
    bins: int = 12
    min_samples: int = 100  # per bin: a p99 from fewer than ~100 samples is its maximum
    max_batch: int = 1024
    buckets: int = 8  # PSGS quantile buckets seeds are drawn from
    budget_s: float = 300.0  # per pipeline
    seed: int = 0
    # With a split CPU lane: profile each lane beside the other's device work (the curves
    # then hold the contention, and an SLO choice treats the lanes as independent), instead
    # of alone (the default: the SLO choice queues both on one simulated device)
    other_lane_loaded: bool = False

    def __post_init__(self):
        # Upper bounds too: the bin edges and a batch's seeds are arrays of these sizes
        # (--bins 1e9 or --max-batch 1e12 ended in a MemoryError traceback)
        if not (2 <= self.bins <= MAX_BINS and self.min_samples >= 1 and 1 <= self.max_batch <= MAX_BATCH
                and self.buckets >= 1):
            raise ValueError(f"bins within [2, {MAX_BINS}], min_samples >= 1, max_batch within [1, {MAX_BATCH}] "
                             f"and buckets >= 1 needed, got {self}")
        if not 0 < self.budget_s < math.inf:  # NaN passed, and profiled nothing
            raise ValueError(f"budget_s must be > 0 and finite, got {self.budget_s}")


class BatchGenerator:
    """Thread-safe stream of (seeds, batch PSGS) spanning the PSGS range."""

    def __init__(self, psgs: np.ndarray, cfg: ProfileConfig):
        psgs = np.asarray(psgs, dtype=np.float64)
        order = np.argsort(psgs, kind="stable")
        self.buckets = [b for b in np.array_split(order, cfg.buckets) if b.size]
        self.bucket_mean = np.array([max(float(psgs[b].mean()), 1e-9) for b in self.buckets])
        self.psgs = psgs
        self.max_batch = cfg.max_batch
        self._rng = np.random.default_rng(cfg.seed)
        self._lock = threading.Lock()
        low = float(self.bucket_mean.min())
        high = float(self.bucket_mean.max()) * cfg.max_batch
        self.edges = np.exp(np.linspace(math.log(max(low, 1.0)), math.log(max(high, 2.0)), cfg.bins + 1))
        self.counts = np.zeros(cfg.bins, dtype=np.int64)

    def next(self) -> tuple[np.ndarray, float]:
        with self._lock:
            rng = self._rng
            if rng.random() < 0.75:  # mostly the emptiest bin, else any: every bin keeps getting some
                target = int(rng.choice(np.flatnonzero(self.counts == self.counts.min())))
            else:
                target = int(rng.integers(len(self.counts)))
            goal = math.exp(rng.uniform(math.log(self.edges[target]), math.log(self.edges[target + 1])))
            sizes = goal / self.bucket_mean
            feasible = np.flatnonzero((sizes >= 1) & (sizes <= self.max_batch))
            b = int(rng.choice(feasible)) if feasible.size else int(np.argmin(np.abs(np.log(sizes))))
            size = int(np.clip(round(sizes[b]), 1, self.max_batch))
            bucket = self.buckets[b]
            seeds = bucket[rng.integers(0, bucket.size, size=size)]
        return seeds.astype(np.int64), float(self.psgs[seeds].sum())

    def record(self, batch_psgs: float) -> None:
        with self._lock:
            self.counts[self.bin_of(batch_psgs)] += 1

    def bin_of(self, batch_psgs: float) -> int:
        return int(np.clip(np.searchsorted(self.edges, batch_psgs, side="right") - 1, 0, len(self.edges) - 2))


def run_closed_loop(run_batch: Callable[[int, np.ndarray], object], workers: int, gen: BatchGenerator,
                    cfg: ProfileConfig, *, progress: Callable[[int], None] | None = None,
                    own_service: bool = False) -> tuple[Samples, bool]:
    """Drive `run_batch(worker, seeds)` from `workers` threads until every bin a batch can
    reach has min_samples, or the budget is spent. Returns (samples, complete).
    own_service: a batch's seconds leave out the queue wait its result reports
    (timings.queue_wait_s): a split lane's workers queue for one shared device stage, a
    queue the SLO simulator models itself (the device one server), so counting it here
    too would charge it twice, and make the lane look slower than it is when not loaded."""
    samples = Samples()
    counts = np.zeros(len(gen.edges) - 1, dtype=np.int64)
    lock = threading.Lock()
    stop = threading.Event()
    deadline = time.monotonic() + cfg.budget_s
    errors: list[BaseException] = []
    # A bin counts as full once it has min_samples; bins no batch has reached after a
    # while (the extreme corners of the range) do not hold the run open.
    warmup = max(200, 20 * len(counts))

    def done() -> bool:
        seen = int(counts.sum())
        reached = counts > 0
        if seen < warmup:
            return False
        return bool(np.all(counts[reached] >= cfg.min_samples))

    def work(worker: int) -> None:
        try:
            while not stop.is_set():
                seeds, psgs = gen.next()
                t0 = time.perf_counter()
                result = run_batch(worker, seeds)
                dt = time.perf_counter() - t0
                gen.record(psgs)
                t = getattr(result, "timings", None)
                if own_service and t is not None:
                    dt = max(dt - t.queue_wait_s, 1e-9)
                with lock:
                    samples.add(psgs, dt, int(seeds.size))
                    if t is not None:  # the device's share (a split lane's gather and model)
                        samples.device.append(t.gather_s + t.compute_s)
                    counts[gen.bin_of(psgs)] += 1
                    if progress is not None:
                        progress(1)
                    if done() or time.monotonic() > deadline:
                        stop.set()
        except BaseException as exc:  # surfaced after the threads end
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=(w,), name=f"profile-{w}", daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return samples, done()
