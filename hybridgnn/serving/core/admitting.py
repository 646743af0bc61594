"""What every engine kind shares: admission (lanes, the in-flight cap, shedding before
decoding), requests in flight, readiness and drain. A subclass sets cfg, _admission,
_admitted_seed_psgs, _pending, _idle, _started, _refused_in_flight_cap, draining, ready."""

from __future__ import annotations

import asyncio
import logging
import time

from hybridgnn.errors import Draining, Overloaded, ServingError

log = logging.getLogger("hybridgnn.serving.core.engine")
# How often the loop-lag timer runs while requests come: often enough to see a lag well
# under the 100 ms default bound. Each tick wakes the process, though (about 100 µs of CPU
# on a 2-core VM: an idle server spent 2.4 % of a core on them), so an engine that admitted
# nothing for LAG_IDLE_AFTER_TICKS ticks slows to LAG_IDLE_TICK_S, and its next admission
# (or refusal) brings the fast ticks back at once.
LAG_TICK_S = 0.005
LAG_IDLE_TICK_S = 0.25
LAG_IDLE_AFTER_TICKS = 200


class Admitting:
    _lag_idle = False  # the lag timer runs at LAG_IDLE_TICK_S
    _admitted = 0  # requests admitted or refused so far (the lag timer's sign of activity)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def queue_bound_s(self) -> float:
        """Admission's bound on the predicted queueing delay (the front end's standing-queue
        limits follow it)."""
        return self._admission.bound_s

    def mark_unready(self) -> None:
        """Report not-ready (balancers stop routing here) while still serving what arrives."""
        self.ready = False

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait until every admitted request has its answer."""
        self.draining = True
        self.ready = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            log.error("drain timed out with %d requests pending", self._pending)
            return False

    def admit(self, lane: str, work: float, waited_s: float = 0.0) -> float:
        """Count one more request in flight on `lane`, or raise Draining / Overloaded (its
        predicted queueing delay, plus waited_s already spent in the front end, past the
        bound; or the hard cap on requests in flight). Returns the lane's predicted wait.
        Every admit is matched by one release()."""
        self._admitted += 1
        if self._lag_idle:
            self._wake_lag_ticks()
        if self.draining or not self._started:
            raise Draining("server is shutting down" if self.draining else "server is starting")
        if self._pending >= self.cfg.batcher.max_pending_requests:
            self._refused_in_flight_cap += 1
            raise Overloaded(f"{self._pending} requests in flight (limit {self.cfg.batcher.max_pending_requests})")
        predicted = self._admission.admit(lane, work, waited_s)
        self._pending += 1
        self._idle.clear()
        return predicted

    def start_lag_ticks(self) -> None:
        """Feed admission how late a timer runs (the event loop's lag), every LAG_TICK_S
        (LAG_IDLE_TICK_S while idle), until stop_lag_ticks()."""
        loop = asyncio.get_running_loop()
        quiet = [0, self._admitted]  # fast ticks in a row that saw nothing admitted; the count then

        def tick(due: float) -> None:
            now = loop.time()
            self._admission.loop_lag.observe(now - due)
            if self._admitted != quiet[1] or self._pending:
                quiet[0], quiet[1] = 0, self._admitted
            else:
                quiet[0] += 1
            self._lag_idle = quiet[0] >= LAG_IDLE_AFTER_TICKS
            period = LAG_IDLE_TICK_S if self._lag_idle else LAG_TICK_S
            self._lag_handle = loop.call_at(now + period, tick, now + period)

        def wake() -> None:
            self._lag_idle = False
            quiet[0] = 0
            if loop.is_closed():  # an engine whose loop ended without stop(): nothing to tick on
                return
            self._lag_handle.cancel()
            due = loop.time() + LAG_TICK_S
            self._lag_handle = loop.call_at(due, tick, due)

        self._wake_lag_ticks = wake
        tick(loop.time())

    def stop_lag_ticks(self) -> None:
        handle = getattr(self, "_lag_handle", None)
        if handle is not None:
            handle.cancel()
        self._lag_idle = False  # nothing to wake any more

    def release(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    def lane(self, name: str):
        """Admission's lane `name` (its queued work and measured service rate)."""
        return self._admission.lanes[name]

    async def run_in_lane(self, lane_name: str, work: float, call, *args, waited_s: float = 0.0,
                          learn: bool = True, **kwargs):
        """Admit `work` on a lane (after waited_s already spent in the front end), await
        call(*args, **kwargs), and release it. The lane's cost model learns from calls that
        found it empty (their time is service, not wait) and were answered or refused (4xx):
        a 503 or a failure took whatever its cause took (a down rank group's timeout), and
        learnt as service it would refuse the lane's work (429) long after. learn=False:
        the lane learns elsewhere (graph updates: from each merged log entry, whose one
        fixed cost many requests share)."""
        self.admit(lane_name, work, waited_s)
        lane = self.lane(lane_name)
        alone = lane.queued <= work
        served = False
        t0 = time.perf_counter()
        try:
            result = await call(*args, **kwargs)
            served = True
            return result
        except ServingError as exc:
            served = exc.status < 500
            raise
        finally:
            lane.remove(work)
            now = time.perf_counter()
            if alone and served and learn:
                lane.observe(work, now - t0)
            lane.completed(work, now)
            self.release()

    def shed(self, waited_s: float, lane: str | None = None, seeds: int = 0) -> None:
        """Raise Overloaded, before a request is decoded, if it already waited in the front
        end past the delay bound, or (lane given) that lane would be past the bound with the
        work its `seeds` are expected to bring (the mean PSGS per seed of admitted requests;
        submit then judges the request's own PSGS)."""
        self._admitted += 1
        if self._lag_idle:
            self._wake_lag_ticks()
        if self._started and not self.draining:
            self._admission.check(lane, seeds * self._admitted_seed_psgs if lane == "sampled" else 0.0, waited_s)

    def shed_standing(self) -> bool:
        """Whether a request the front end found waiting past the target of a queue that
        stands there is refused (and counted so): yes unless the engine is starting or
        draining, whose own answer (503) applies then."""
        self._admitted += 1
        if self._lag_idle:
            self._wake_lag_ticks()
        if self._started and not self.draining:
            self._admission.count_standing()
            return True
        return False


async def started(engine):
    """`engine` once its start() returned; one whose start fails is stopped before the error
    propagates, so nothing it started (workers, ranks) outlives it."""
    try:
        await engine.start()
    except BaseException:
        await asyncio.shield(engine.stop())
        raise
    return engine
