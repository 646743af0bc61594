"""Admission by predicted queueing delay (a decision; the engine executes it).

Each kind of work waits in a lane: sampled inference (the pipelines' batches, work in
PSGS), precomputed lookups off the event loop, new-node compute and graph updates (work
in requests or updates). A lane knows the work queued in it and a cost model fitted to
the batches it completed, cost(b) = a + slope·b seconds for a batch of work b, so the
wait that new work would see is the time its servers need for what is ahead of it:

    delay(Q) = (a · ceil(Q / B) + slope · Q) / servers

where B is the work of a full batch (the batcher's limits under backlog). Until batches of
more than one size have been seen there is no line: the time is charged per unit of work
(pessimistic), except in a lane that merges what waits (graph updates), where it is the
batch's. The fit sees
each batch's own service time, which says nothing of the cores the servers share with
each other and with the event loop; so a lane also measures its throughput while it is
backlogged (work completed per second in windows when work was always waiting), and
the delay is the larger of the two: Q / throughput bounds it from below whatever the
machine's cores. Both describe an average; the promise is about the tail. So a lane
can also be calibrated: each admitted request's prediction is compared with the wait
it then saw, and predictions are scaled by a high quantile of actual ÷ predicted over
recent requests (CALIBRATION_QUANTILE; predictions under a fifth of the bound are not
compared: there a request's own service, not the queue, makes the wait). Those short
waits set the lane's floor instead: the same quantile of what admitted work waited while
the queue was short (the batcher's wait, the hand-back from a worker to the event loop),
which no queue model sees and which counts whatever the queue (measured: 10–30 ms at p99
under a flood of one-seed requests, where the model predicted well under a millisecond). A
request is admitted while the larger of delay(queued + its own work) and the floor stays
within the bound, else refused with Retry-After ≈ the excess. Until a lane has measured
MIN_BATCHES batches it admits: the first batches of a fresh server run cold (lazy
initialisation, caches), and a model fitted to them would refuse an idle server's first
requests (the pending count still caps memory). Every request kind passes through here.

With an SLO policy the promise is the SLO for the whole request, at p99, and the lanes
only bound its queueing part at the 95th percentile. So `SloFeedback` also watches the
server-side latency of answered requests and moves the bound: it shrinks while their p99
passes SLO_TARGET of the SLO and grows back, up to the bound the SLO leaves, while the p99
is well under it.

The lanes see only work already parsed. When the event loop itself is the bottleneck
(small requests, one loop) the wait is spent before that: in socket buffers while the
loop runs other callbacks. A `LoopLag` measures how late the loop runs a periodic timer,
which is about how long a request that arrives now waits to be read (sustained over a
few ticks: one slow callback is not overload). It adds to what a request already waited
after it was read (its turn of the loop) and to every lane's delay; past the bound on
their own the two refuse even an empty lane, which frees the loop (a refusal costs a
fraction of an answer) until it catches up.
"""

from __future__ import annotations

import collections
import logging
import math

from hybridgnn.config import DEFAULT_QUEUE_DELAY_S, ServeConfig
from hybridgnn.errors import Overloaded

log = logging.getLogger(__name__)

MIN_BATCHES = 8  # batches a lane measures before its predictions count
_DECAY = 0.05  # weight of the newest batch in the cost fit (about the last 20 batches)
WINDOW_S = 0.05  # a backlogged-throughput sample spans at least this long (several batches)
CALIBRATION_QUANTILE = 0.95  # the share of admitted requests whose wait the scaled prediction covers
CALIBRATION_SAMPLES = 256  # recent (prediction, wait) pairs the scale is taken over
CALIBRATION_MIN = 32  # pairs needed before predictions are scaled at all
CALIBRATION_RANGE = (0.5, 4.0)  # the scale never leaves this range (a burst of outliers cannot freeze a lane)


SLO_TARGET = 0.9  # the share of the SLO the server's own p99 may take (the rest: encoding, sockets, the client)
SLO_WINDOW = 512  # recent answered requests the p99 is taken over
SLO_EVERY = 64  # answered requests between two moves of the bound
SLO_MIN_SHARE = 0.1  # the bound never falls under this share of the SLO


class SloFeedback:
    """Moves the admission bound so that the p99 of answered requests' server-side latency
    (front-end wait, batching, queue, service, the hand-back to the loop) stays within
    SLO_TARGET × the SLO. Every SLO_EVERY answers, the p99 over the last SLO_WINDOW is
    compared with that target: above it the bound shrinks in proportion to the excess, by
    at most a tenth; under 0.85 of it the bound grows by 2 %. The bound stays within
    [SLO_MIN_SHARE × SLO, ceiling], the ceiling being the bound the SLO leaves (or the
    configured one)."""

    __slots__ = ("target_s", "lowest_s", "ceiling_s", "bound_s", "p99_s", "_recent", "_since")

    def __init__(self, slo_s: float, ceiling_s: float):
        if not (slo_s > 0 and ceiling_s > 0):
            raise ValueError(f"an SLO feedback needs a positive SLO and bound, got {slo_s}, {ceiling_s}")
        self.target_s = SLO_TARGET * slo_s
        self.lowest_s = min(ceiling_s, SLO_MIN_SHARE * slo_s)
        self.ceiling_s = self.bound_s = ceiling_s
        self.p99_s: float | None = None
        self._recent = collections.deque(maxlen=SLO_WINDOW)
        self._since = 0

    def observe(self, latency_s: float) -> float:
        """Count one answered request's server-side latency; return the bound now in force."""
        self._recent.append(latency_s)
        self._since += 1
        if self._since >= SLO_EVERY:
            self._since = 0
            self.p99_s = p99 = _quantile(self._recent, 0.99)
            if p99 > self.target_s:
                # at most a tenth a step: one stall (a busy core, a slow batch) is not a queue,
                # and a bound cut by it would refuse for seconds what could have been served
                self.bound_s = max(self.lowest_s, self.bound_s * max(0.9, self.target_s / p99))
            elif p99 < 0.85 * self.target_s:
                # slowly: a bound that came back at once would overshoot and oscillate
                self.bound_s = min(self.ceiling_s, self.bound_s * 1.02)
        return self.bound_s

    def describe(self) -> dict:
        return {"target_p99_s": self.target_s, "bound_range_s": [self.lowest_s, self.ceiling_s],
                "recent_p99_s": self.p99_s}


class Lane:
    """Queued work and a cost model for one kind of server pool."""

    __slots__ = ("name", "servers", "queued", "full_batch", "merges", "measured", "_n", "_x", "_y", "_xx", "_xy", "_a", "_slope",
                 "throughput", "_win_t0", "_win_work", "_win_backlogged", "scale", "_ratios", "_since_scaled",
                 "floor_s", "_short_waits", "_since_floor", "per_request", "requests")

    def __init__(self, name: str, servers: int, full_batch: float = 1.0, *, per_request: bool = False,
                 merges: bool = False):
        """per_request: each request is served alone, whatever its work (new nodes: its
        query nodes and edges), so the fixed cost counts once per queued request, not once
        per full_batch of work. merges: queued requests are merged into one batch of up to
        full_batch (graph updates: one log entry), so batches of one request's work say
        what a batch costs, not what each unit of work costs (see observe)."""
        self.name = name
        self.merges = merges
        self.servers = max(1, servers)
        self.queued = 0.0
        self.per_request = per_request
        self.requests = 0  # queued (admitted, not yet removed)
        self.full_batch = max(full_batch, 1e-9)
        self.measured = False  # whether predictions count: MIN_BATCHES batches measured (observe keeps it)
        self._n = 0
        self._x = self._y = self._xx = self._xy = 0.0  # exponentially weighted moments of (work, seconds)
        self._a = 0.0
        self._slope: float | None = None  # None: nothing measured yet
        self.throughput: float | None = None  # work per second while backlogged; None: not measured
        self._win_t0: float | None = None
        self._win_work = 0.0
        self._win_backlogged = False
        self.scale = 1.0  # predictions are multiplied by this (calibrate)
        self._ratios: collections.deque[float] = collections.deque(maxlen=CALIBRATION_SAMPLES)
        self._since_scaled = 0
        self.floor_s = 0.0  # what admitted work waits with a short queue (calibrate)
        self._short_waits: collections.deque[float] = collections.deque(maxlen=CALIBRATION_SAMPLES)
        self._since_floor = 0

    def delay_s(self, extra: float = 0.0) -> float:
        """Seconds until work `extra` added now would be done, queued work first (the
        model's prediction, scaled by the calibration, and at least the floor)."""
        return self.expected_s(self.model_delay_s(extra))

    def expected_s(self, predicted_s: float) -> float:
        """The wait to expect for a model prediction: scaled by the calibration, at least
        the floor (0 until the lane is measured)."""
        return max(predicted_s * self.scale, self.floor_s) if self.measured else 0.0

    def model_delay_s(self, extra: float = 0.0) -> float:
        """The cost model's and the throughput's prediction alone, before calibration."""
        if not self.measured:
            return 0.0
        q = self.queued + extra
        if self.per_request:
            batches = self.requests + (extra > 0)
        else:
            batches = math.ceil(q / self.full_batch) if q > 0 else 0
        fitted = (self._a * batches + self._slope * q) / self.servers
        return fitted if self.throughput is None else max(fitted, q / self.throughput)

    def calibrate(self, predicted_s: float, waited_s: float, bound_s: float) -> None:
        """Compare one admitted request's model prediction (model_delay_s when it was
        admitted) with how long it then waited before its service began; every
        CALIBRATION_MIN pairs the scale becomes the CALIBRATION_QUANTILE of waited ÷
        predicted. Small predictions do not scale: near an empty lane the wait is the
        batcher's and the hand-back's, not the queue's. Their waits set the floor (the
        same quantile of them, at most half the bound, so it cannot refuse by itself)."""
        if not math.isfinite(waited_s):
            return
        if predicted_s < 0.2 * bound_s:
            self._short_waits.append(max(waited_s, 0.0))
            self._since_floor += 1
            if self._since_floor >= CALIBRATION_MIN:
                self._since_floor = 0
                self.floor_s = min(0.5 * bound_s, _quantile(self._short_waits, CALIBRATION_QUANTILE))
            return
        self._ratios.append(max(waited_s, 0.0) / predicted_s)
        self._since_scaled += 1
        if self._since_scaled >= CALIBRATION_MIN and len(self._ratios) >= CALIBRATION_MIN:
            self._since_scaled = 0
            lo, hi = CALIBRATION_RANGE
            self.scale = min(hi, max(lo, _quantile(self._ratios, CALIBRATION_QUANTILE)))

    def describe(self) -> dict:
        """The lane's state and cost model, for the model metadata (diagnostics)."""
        return {"servers": self.servers, "queued": self.queued, "full_batch": self.full_batch,
                "batch_cost_s": self._a, "cost_per_work_s": self._slope, "backlogged_throughput": self.throughput,
                "calibration_scale": self.scale, "calibration_samples": len(self._ratios),
                "floor_s": self.floor_s, "delay_s": self.delay_s()}

    def add(self, work: float) -> None:
        self.queued += work
        self.requests += 1

    def remove(self, work: float) -> None:
        self.queued = max(0.0, self.queued - work)
        self.requests = max(0, self.requests - 1)
        if not self._backlogged():
            self._win_backlogged = False

    def _backlogged(self) -> bool:
        """Whether every server is busy and work waits (one full batch each, or one request)."""
        if self.per_request:
            return self.requests >= self.servers
        return self.queued >= self.servers * self.full_batch

    def completed(self, work: float, now: float) -> None:
        """Count `work` finished at time `now` (seconds, monotonic) towards the backlogged
        throughput: a window of at least WINDOW_S in which work was always waiting gives
        one sample. A window in which the lane ran dry says how fast work arrived, not how
        fast it can be served, so it can only raise the estimate (what was done is possible)."""
        if self._win_t0 is None or now < self._win_t0:
            self._win_t0, self._win_work, self._win_backlogged = now, 0.0, self._backlogged()
            return
        self._win_work += work
        if now - self._win_t0 >= WINDOW_S:
            rate = self._win_work / (now - self._win_t0)
            if self._win_backlogged and rate > 0:  # 0 (only empty work done) would divide by 0 in every prediction
                self.throughput = rate if self.throughput is None else self.throughput + 0.3 * (rate - self.throughput)
            elif self.throughput is not None and rate > self.throughput:
                # The lane just completed work faster than its backlogged estimate allows:
                # that estimate is stale (measured under heavier contention, or cold). It must
                # not wait for a backlog to be corrected: refusing by it keeps the backlog from
                # forming, and the lane would refuse at a fraction of its capacity for good.
                self.throughput += 0.3 * (rate - self.throughput)
            self._win_t0, self._win_work, self._win_backlogged = now, 0.0, self._backlogged()

    def observe(self, work: float, seconds: float) -> None:
        """Fit the cost model with one completed batch (its work and service seconds)."""
        if not (work > 0 and seconds >= 0 and math.isfinite(seconds)):
            return
        d = _DECAY if self._n else 1.0
        self._n += 1
        self.measured = self._n >= MIN_BATCHES  # the slope is set below, whatever the fit
        self._x += d * (work - self._x)
        self._y += d * (seconds - self._y)
        self._xx += d * (work * work - self._xx)
        self._xy += d * (work * seconds - self._xy)
        var = self._xx - self._x * self._x
        per_batch = self.merges
        if var > 1e-6 * self._x * self._x and self._n >= MIN_BATCHES:
            slope = (self._xy - self._x * self._y) / var
            a = self._y - slope * self._x
            if slope > 0 and a >= 0:
                self._slope, self._a = slope, a
                return
            # Sizes that vary but no line: bigger batches no slower is a batch's cost; time
            # that grows with the work (a negative intercept) is the work's, and charged per
            # batch it put a thousand-update entry's time on each single update.
            per_batch = per_batch and slope <= 0
        if per_batch:
            # Batches all of one size in a lane that merges what waits: their time is the
            # batch's (a log append and its sync for an update), so charge it per batch. Per
            # unit of work, 40 updates sent at once to a fresh server were predicted at 40
            # times one alone and 38 of them refused (429), where merged they took twice one;
            # and the refusals kept the merged batches that would have taught the slope from
            # forming. The backlogged throughput and the batch count still bound a flood,
            # and the first merged batch of another size gives the line.
            self._slope, self._a = 0.0, self._y
            return
        # Too little spread in batch sizes for a line: charge all time per unit of work
        # (pessimistic for bigger batches, so admission errs towards refusing).
        self._slope, self._a = self._y / max(self._x, 1e-12), 0.0


def _quantile(values, q: float) -> float:
    ordered = sorted(values)  # a few µs for 256 floats, where numpy's quantile costs tens
    return ordered[int(q * (len(ordered) - 1))]


class LoopLag:
    """How late the event loop runs, sustained: fed the lateness of a periodic timer (the
    engine's ticker), it holds the least of the last `window` samples. A loop that is
    saturated is late at every tick; one long callback (a start-up step, a big decode)
    makes one tick late and is not overload, so it must not refuse what follows it."""

    __slots__ = ("lag_s", "_recent")

    def __init__(self, window: int = 4):
        self.lag_s = 0.0
        self._recent = collections.deque([0.0] * window, maxlen=window)

    def observe(self, late_s: float) -> None:
        self._recent.append(max(0.0, late_s))
        self.lag_s = min(self._recent)


class Admission:
    """Lanes by name, the loop lag and the delay bound; `admit` raises Overloaded past the
    bound."""

    def __init__(self, bound_s: float, lanes: list[Lane], loop_lag: LoopLag | None = None,
                 slo_s: float | None = None):
        if not bound_s > 0:
            raise ValueError(f"the queue-delay bound must be > 0 seconds, got {bound_s}")
        self.bound_s = bound_s
        # with an SLO, the bound follows the answered requests' p99 (observe_latency)
        self.slo = SloFeedback(slo_s, bound_s) if slo_s is not None else None
        self.lanes = {lane.name: lane for lane in lanes}
        self.loop_lag = loop_lag or LoopLag()
        self.refused = 0
        self.refused_for_lag = 0
        self.refused_standing = 0

    def admit(self, lane_name: str, work: float, waited_s: float = 0.0) -> float:
        """Queue `work` on the lane, or raise Overloaded (with Retry-After) if the delay it
        would see, after waited_s already spent in the front end, passes the bound. Returns
        the lane's model prediction for it (what Lane.calibrate compares the wait it sees with)."""
        predicted = self.check(lane_name, work, waited_s)
        self.lanes[lane_name].add(work)
        return predicted

    def check(self, lane_name: str | None, work: float = 0.0, waited_s: float = 0.0) -> float:
        """Raise Overloaded if work added to the lane now would wait past the bound (the front
        end asks before decoding, with the work the request declares at the mean cost per
        unit: a decode costs more than the rest of a refusal);
        else return the lane's model prediction for it, before calibration. waited_s: what
        the request already waited in the front end (for its turn of the event loop); it
        adds to the loop lag (the wait to be read). lane_name None: judge by those alone."""
        ahead = self.loop_lag.lag_s + waited_s
        predicted = queued = delay = 0.0
        if lane_name is not None:
            lane = self.lanes[lane_name]
            queued = lane.queued
            if lane.measured:
                predicted = lane.model_delay_s(work)
                delay = max(predicted * lane.scale, lane.floor_s)  # lane.expected_s(predicted), spelled out
        delay += ahead
        # An empty lane takes one request unless the loop (or the wait for it) alone is past the bound.
        if delay > self.bound_s and (queued > 0 or ahead > self.bound_s):
            self.refused += 1
            self.refused_for_lag += ahead > self.bound_s
            # The message names the bound and the retry, not the exact delay: under overload
            # thousands of these a second are answered, and a few distinct messages let the
            # front end share their encoded answers (the delay is in the model metadata).
            retry_s = math.ceil(min(60.0, max(1.0, delay - self.bound_s)))
            raise Overloaded(f"predicted queueing delay exceeds the {self.bound_s * 1e3:.0f} ms bound; retry "
                             f"in {retry_s} s", retry_after_s=retry_s)
        return predicted

    def observe_latency(self, latency_s: float) -> None:
        """Count an answered sampled request's latency since it was read (with an SLO
        only: the bound follows their p99). The loop's lag adds to it: about how long a
        request waits to be read while the loop is late."""
        if self.slo is not None:
            self.bound_s = self.slo.observe(latency_s + self.loop_lag.lag_s)

    def count_standing(self) -> None:
        """Count a request refused for waiting past the target of a queue that stands in
        the front end (the front end decides; see serving/http/turns.py)."""
        self.refused += 1
        self.refused_standing += 1

    def describe(self) -> dict:
        return {"bound_s": self.bound_s, "refused_by_delay": self.refused,
                "refused_for_loop_lag": self.refused_for_lag, "refused_standing_queue": self.refused_standing,
                "loop_lag_s": self.loop_lag.lag_s,
                "slo": self.slo.describe() if self.slo is not None else None,
                "lanes": {name: lane.describe() for name, lane in self.lanes.items()}}


def delay_bound_s(configured_s: float | None, slo_s: float | None, batching_wait_s: float,
                  full_batch_service_s: float | None, default_s: float = DEFAULT_QUEUE_DELAY_S) -> float:
    """The queueing-delay bound: the configured one, else the room an SLO leaves (the SLO
    less the batching wait and a full batch's p99 service time, at least a fifth of the
    SLO), else default_s."""
    if configured_s is not None:
        return configured_s
    if slo_s is not None and full_batch_service_s is not None:
        return max(slo_s / 5, slo_s - batching_wait_s - full_batch_service_s)
    return default_s


def full_batch_work(max_batch_psgs: float, max_batch_seeds: int, max_batch_requests: int, seed_psgs: float,
                    mean_request_psgs: float) -> float:
    """PSGS of a batch the batcher closes under backlog (full by one of its limits)."""
    return max(seed_psgs, min(max_batch_psgs, max_batch_seeds * seed_psgs, max_batch_requests * mean_request_psgs))


def serving_lanes(sampled_servers: int, cpu_workers: int, full_batch: float, update_batch: int) -> list[Lane]:
    """One lane per kind of work: sampled inference (PSGS, every pipeline's workers),
    precomputed lookups and new-node compute (requests, CPU workers), graph updates."""
    return [Lane("sampled", sampled_servers, full_batch), Lane("lookup", cpu_workers),
            Lane("new_nodes", cpu_workers, per_request=True), Lane("updates", 1, update_batch, merges=True)]


def new_node_work(query_nodes: int, edges: int) -> float:
    """A new-node request's work on its lane: one unit per query node and per edge, so a
    request of 8,192 nodes and 500,000 edges is not charged as one of a node and an edge."""
    return float(max(1, query_nodes + edges))


def admission_for(cfg: ServeConfig, sampled_servers: int, full_batch: float, policy, profile) -> Admission:
    """A server's admission: one lane per kind of work and the delay bound from the flags,
    else from the room an slo:<ms> policy leaves (its profile gives a full batch's p99)."""
    slo_s = service_s = None
    if policy is not None and policy.name.startswith("slo"):
        slo_s = float(policy.name.split(":", 1)[1]) / 1000.0
        service_s = max(float(dev.tail(full_batch)) for dev in profile.devices.values())
    bound = delay_bound_s(cfg.admission.max_queue_delay_s, slo_s, cfg.batcher.max_wait_s, service_s)
    log.info("admission: a request is refused (429) when its predicted queueing delay passes %.0f ms", bound * 1e3)
    return Admission(bound, serving_lanes(sampled_servers, cfg.cpu_pipeline.workers, full_batch,
                                          cfg.updates.max_batch_updates), slo_s=slo_s)
