"""The compiled event loops behind scheduler/queueing.py's simulators (numba): one
pipeline's batcher and workers (finish_times), and both lanes on one shared GPU
(shared_finish_times), each with an early stop once a p99 is sure to miss a bound. The
tests hold them to the Python loops they replaced (tests/unit/test_queueing.py)."""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def interp_seconds(kx: np.ndarray, ky: np.ndarray, last_psgs: float, psgs: float) -> float:
    """PipelineModel.mean_seconds, compiled: linear in log PSGS between knots, flat below
    the first, proportional to PSGS past the last."""
    if psgs > last_psgs:
        return ky[-1] * psgs / last_psgs
    x = math.log(max(psgs, 1e-9))
    i = np.searchsorted(kx, x, side="right")
    if i == 0:
        return ky[0]
    if i == kx.shape[0]:
        return ky[-1]
    return ky[i - 1] + (ky[i] - ky[i - 1]) * (x - kx[i - 1]) / (kx[i] - kx[i - 1])


@numba.njit(cache=True)
def finish_times(arrivals: np.ndarray, cum: np.ndarray, ratios: np.ndarray, kx: np.ndarray, ky: np.ndarray,
                  last_psgs: float, workers: int, wait: float, bound: float, stretch: float,
                  budget: float = math.inf, warmup: int = 0, late_limit: int = 0) -> tuple[np.ndarray, bool]:
    """When each request's batch finishes: the batcher and `workers` workers of one
    pipeline (the loop queueing.Simulator.latencies describes), one batch per iteration. With a
    finite budget, stops early (True) once more than late_limit requests past the warm-up
    take longer than it: their p99 is then over it, whatever the rest do."""
    n = arrivals.shape[0]
    late = 0
    free = np.zeros(max(1, workers))  # when each worker is next free
    done = np.empty(n)
    i = 0
    batch = 0
    while i < n:
        w = np.argmin(free)
        # the batch fills when the pending PSGS reaches the bound, else closes after the wait
        full_at = i + 1 + np.searchsorted(cum[i + 1:], cum[i] + bound, side="left")  # first index past the bound
        t_full = arrivals[min(full_at - 1, n - 1)] if full_at <= n else math.inf
        start = max(free[w], min(arrivals[i] + wait, t_full))
        by_time = i + 1 + np.searchsorted(arrivals[i + 1:], start, side="right")
        by_bound = i + np.searchsorted(cum[i + 1:], cum[i] + bound, side="right")
        end = max(i + 1, min(by_time, by_bound))
        finish = start + interp_seconds(kx, ky, last_psgs, cum[end] - cum[i]) * ratios[batch % n] * stretch
        done[i:end] = finish
        late += count_late(arrivals, max(i, warmup), end, finish, budget)
        if late > late_limit:
            return done, True
        free[w] = finish
        batch += 1
        i = end
    return done, False


@numba.njit(cache=True)
def count_late(arrivals, lo: int, hi: int, finish: float, budget: float) -> int:
    """How many of requests lo..hi-1, answered at `finish`, took longer than budget."""
    count = 0
    if budget < math.inf:
        for j in range(lo, hi):
            if finish - arrivals[j] > budget:
                count += 1
    return count


def late_limit(n: int) -> int:
    """The most of n latencies that may exceed a bound while their p99 (numpy's linear
    quantile) still might not: with more, the value at rank floor(0.99 (n - 1)) exceeds it."""
    return n - math.floor(0.99 * (n - 1)) - 1


NO_REQUESTS = np.empty(0)  # a lane offered no requests


@numba.njit(cache=True)
def _next_start(arrivals, cum, i, bound, ready, wait) -> float:
    """When a lane's next batch starts, its earliest worker (and staging slot) free at
    `ready` (NaN: none has a known free time); NaN also when no request is left."""
    n = arrivals.shape[0]
    if i >= n or ready != ready:
        return math.nan
    full_at = i + 1 + np.searchsorted(cum[i + 1:], cum[i] + bound, side="left")
    t_full = arrivals[min(full_at - 1, n - 1)] if full_at <= n else math.inf
    return max(ready, min(arrivals[i] + wait, t_full))


@numba.njit(cache=True)
def _ready(free, n_free, slots, n_slots, has_slots) -> float:
    """When a lane's earliest worker (and, for a split lane, staging slot) is free: the
    tops of their heaps; NaN when one heap is empty (all busy until a time not known yet)."""
    if n_free == 0 or (has_slots and n_slots == 0):
        return math.nan
    return max(free[0], slots[0]) if has_slots else free[0]


@numba.njit(cache=True)
def shared_finish_times(arr_c, cum_c, ratios_c, bound_c, workers_c, slots_per_worker,
                         arr_g, cum_g, ratios_g, bound_g, workers_g,
                         host_kx, host_ky, host_last, dev_kx, dev_ky, dev_last, gpu_kx, gpu_ky, gpu_last,
                         wait, stretch, scale, shared, budget=math.inf, warmup=0, late_limit=0):
    """When each request of the CPU lane (index 0) and the GPU lane (1) is answered: the
    event loop queueing.SharedDeviceSimulator describes. Events run in (time, sequence) order: a
    lane's next batch start (one pending per lane, in `start_at`) and batches reaching
    the device (a binary heap of (time, sequence) over the batches handed off). A finite
    budget stops it early, as finish_times, counting both lanes' requests past the warm-up."""
    arrivals = (arr_c, arr_g)
    cums = (cum_c, cum_g)
    ratios = (ratios_c, ratios_g)
    bounds = (bound_c, bound_g)
    done = (np.empty(arr_c.shape[0]), np.empty(arr_g.shape[0]))
    # min-heaps of each lane's known worker free times and the split lane's staging slots'
    # (a busy worker, or a slot whose batch is not yet off the device, is out of its heap)
    free = (np.zeros(max(1, workers_c)), np.zeros(max(1, workers_g)))
    n_free = np.array([max(1, workers_c), max(1, workers_g)], dtype=np.int64)
    slots = np.zeros(max(1, workers_c) * slots_per_worker)
    n_slots = slots.shape[0]
    first = np.zeros(2, dtype=np.int64)
    batches = np.zeros(2, dtype=np.int64)
    start_at = np.full(2, math.inf)
    start_seq = np.zeros(2, dtype=np.int64)
    device_free = np.zeros(2)  # per lane's own device; entry 1 only when shared
    most = arr_c.shape[0] + arr_g.shape[0]  # batches, at most one per request
    heap_t, heap_seq, heap_batch = np.empty(most), np.empty(most, dtype=np.int64), np.empty(most, dtype=np.int64)
    b_lane, b_first, b_end = np.empty(most, dtype=np.int64), np.empty(most, dtype=np.int64), np.empty(most, dtype=np.int64)
    b_psgs, b_ratio = np.empty(most), np.empty(most)
    pending = 0  # batches in the heap
    made = 0  # batches formed
    late = 0  # requests past the warm-up answered later than the budget
    seq = 0
    for lane in range(2):
        ready = _ready(free[lane], n_free[lane], slots, n_slots, lane == 0)
        start = _next_start(arrivals[lane], cums[lane], first[lane], bounds[lane], ready, wait)
        if start == start:
            start_at[lane], start_seq[lane] = start, seq
            seq += 1
    while True:
        # the earliest event by (time, sequence): a start, or the batch atop the heap
        lane = -1
        t, tseq = math.inf, 0
        for k in range(2):
            if start_at[k] < t or (start_at[k] == t and t < math.inf and start_seq[k] < tseq):
                lane, t, tseq = k, start_at[k], start_seq[k]
        on_device = pending > 0 and (heap_t[0] < t or (heap_t[0] == t and heap_seq[0] < tseq))
        if on_device:
            t, j = heap_t[0], heap_batch[0]
            pending -= 1
            _heap_pop(heap_t, heap_seq, heap_batch, pending)
            lane = b_lane[j]
        elif lane < 0:
            break
        arr, cum, workers = arrivals[lane], cums[lane], free[lane]
        if not on_device:  # the lane's batch starts on its earliest free worker
            start_at[lane] = math.inf
            n_free[lane] -= 1
            _min_heap_pop(workers, n_free[lane])
            if lane == 0:
                n_slots -= 1
                _min_heap_pop(slots, n_slots)
            i = first[lane]
            by_time = i + 1 + np.searchsorted(arr[i + 1:], t, side="right")
            by_bound = i + np.searchsorted(cum[i + 1:], cum[i] + bounds[lane], side="right")
            end = max(i + 1, min(by_time, by_bound))
            ratio = ratios[lane][batches[lane] % ratios[lane].shape[0]]
            batches[lane] += 1
            first[lane] = end
            psgs = cum[end] - cum[i]
            at = t
            if lane == 0:  # the worker hands off after sampling and goes on
                at = t + interp_seconds(host_kx, host_ky, host_last, psgs) * ratio * stretch
                _min_heap_push(workers, n_free[lane], at)
                n_free[lane] += 1
            b_lane[made], b_first[made], b_end[made], b_psgs[made], b_ratio[made] = lane, i, end, psgs, ratio
            _heap_push(heap_t, heap_seq, heap_batch, pending, at, seq, made)
            pending += 1
            made += 1
            seq += 1
        else:  # a batch reaches the device
            i, end, psgs, ratio = b_first[j], b_end[j], b_psgs[j], b_ratio[j]
            which = 1 if shared else lane
            if lane == 0:
                service = interp_seconds(dev_kx, dev_ky, dev_last, psgs) * ratio * scale
            else:
                service = interp_seconds(gpu_kx, gpu_ky, gpu_last, psgs) * ratio * scale
            start = max(t, device_free[which])
            # A GPU-lane batch holds the device for its share: the lane's workers were
            # profiled together (closed loop, one batch each in flight), so they overlap
            # on the device and it finishes `workers` batches per service time. The split
            # lane's device work runs on one stage thread, one batch at a time.
            device_free[which] = start + (service / max(1, workers_g) if lane == 1 else service)
            finish = start + service
            done[lane][i:end] = finish
            late += count_late(arr, max(i, warmup), end, finish, budget)
            if late > late_limit:
                return done, True
            if lane == 1:  # its worker waited for the device
                _min_heap_push(workers, n_free[lane], finish)
                n_free[lane] += 1
            else:  # the batch's staging slot is free again
                _min_heap_push(slots, n_slots, finish)
                n_slots += 1
        ready = _ready(workers, n_free[lane], slots, n_slots, lane == 0)
        start = _next_start(arr, cum, first[lane], bounds[lane], ready, wait)
        if start == start and start < start_at[lane]:
            start_at[lane], start_seq[lane] = start, seq
            seq += 1
    return done, False


@numba.njit(cache=True)
def _min_heap_push(h, n, v) -> None:
    """Add v to the min-heap h[:n]."""
    h[n] = v
    i = n
    while i > 0:
        up = (i - 1) // 2
        if h[up] <= h[i]:
            break
        h[up], h[i] = h[i], h[up]
        i = up


@numba.njit(cache=True)
def _min_heap_pop(h, n) -> None:
    """Drop the least of a min-heap that then holds h[:n] (its last entry moves up top)."""
    h[0] = h[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and h[child + 1] < h[child]:
            child += 1
        if h[i] <= h[child]:
            break
        h[i], h[child] = h[child], h[i]
        i = child


@numba.njit(cache=True)
def _heap_before(ht, hs, a, b) -> bool:
    return ht[a] < ht[b] or (ht[a] == ht[b] and hs[a] < hs[b])


@numba.njit(cache=True)
def _heap_swap(ht, hs, hb, a, b) -> None:
    ht[a], ht[b] = ht[b], ht[a]
    hs[a], hs[b] = hs[b], hs[a]
    hb[a], hb[b] = hb[b], hb[a]


@numba.njit(cache=True)
def _heap_push(ht, hs, hb, n, t, s, b) -> None:
    """Add (t, s) with payload b to the heap of n entries."""
    ht[n], hs[n], hb[n] = t, s, b
    i = n
    while i > 0:
        up = (i - 1) // 2
        if not _heap_before(ht, hs, i, up):
            break
        _heap_swap(ht, hs, hb, i, up)
        i = up


@numba.njit(cache=True)
def _heap_pop(ht, hs, hb, n) -> None:
    """Drop the first entry of a heap that then holds n entries (its last moves up top)."""
    ht[0], hs[0], hb[0] = ht[n], hs[n], hb[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _heap_before(ht, hs, child + 1, child):
            child += 1
        if not _heap_before(ht, hs, child, i):
            break
        _heap_swap(ht, hs, hb, i, child)
        i = child
