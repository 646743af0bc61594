"""Admission by predicted queueing delay (scheduler/admission.py)."""

import math

import pytest

from hybridgnn.errors import Overloaded
from hybridgnn.scheduler.admission import (
    CALIBRATION_MIN,
    CALIBRATION_RANGE,
    CALIBRATION_SAMPLES,
    MIN_BATCHES,
    SLO_EVERY,
    SLO_MIN_SHARE,
    SLO_TARGET,
    SLO_WINDOW,
    Admission,
    Lane,
    LoopLag,
    SloFeedback,
)


def test_an_unmeasured_lane_admits_and_an_empty_one_always_takes_one():
    adm = Admission(0.1, [Lane("sampled", 2, full_batch=100)])
    for _ in range(1000):
        adm.admit("sampled", 50)  # nothing measured yet: only the pending cap applies
    lane = Lane("x", 1)
    for _ in range(MIN_BATCHES):
        lane.observe(1, 10.0)  # 10 s per unit: any request is over a 0.1 s bound
    adm = Admission(0.1, [lane])
    adm.admit("x", 1)  # an empty lane still takes one, or nothing would ever be measured
    with pytest.raises(Overloaded) as info:
        adm.admit("x", 1)
    assert info.value.status == 429 and int(info.value.headers()["Retry-After"]) >= 1
    assert "exceeds the 100 ms bound" in str(info.value)


def test_the_cost_fit_recovers_a_fixed_and_a_per_unit_cost():
    lane = Lane("sampled", servers=2, full_batch=1000)
    for work in [10, 50, 100, 400, 800, 1000] * 10:
        lane.observe(work, 0.002 + 1e-5 * work)  # 2 ms per batch + 10 µs per PSGS
    fit = lane.describe()
    assert fit["batch_cost_s"] + 1000 * fit["cost_per_work_s"] == pytest.approx(0.012, rel=1e-3)
    lane.add(3000)  # three full batches over two servers
    assert lane.delay_s() == pytest.approx((3 * 0.002 + 3000 * 1e-5) / 2, rel=1e-3)


def test_one_batch_size_charges_per_unit():
    lane = Lane("lookup", servers=1)
    for _ in range(20):
        lane.observe(1, 0.004)
    lane.add(10)
    assert lane.delay_s() == pytest.approx(0.04)


def test_a_merging_lane_of_one_batch_size_charges_per_batch_until_another_size_gives_the_line():
    """Graph updates merge what waits into one log entry: 40 sent at once to a fresh server
    were predicted at 40 times one alone, and 38 refused, where merged they took twice one."""
    lane = Lane("updates", servers=1, full_batch=1000, merges=True)
    for _ in range(20):
        lane.observe(1, 0.007)  # one update per entry so far: the entry's fixed cost
    lane.add(40)
    assert lane.delay_s() == pytest.approx(0.007)
    adm = Admission(0.05, [lane])
    for _ in range(40):
        adm.admit("updates", 1)  # within the 50 ms bound, merged
    lane.add(2500 - lane.queued)  # three entries' worth still counts three
    assert lane.delay_s() == pytest.approx(3 * 0.007)
    for work in [1, 40, 200, 1000] * 30:
        lane.observe(work, 0.006 + 1e-5 * work)  # sizes vary: the line
    fit = lane.describe()
    assert fit["batch_cost_s"] == pytest.approx(0.006, rel=1e-2) and fit["cost_per_work_s"] == pytest.approx(1e-5,
                                                                                                             rel=1e-2)


def test_a_merging_lane_whose_sizes_vary_without_a_line_charges_time_that_grows_with_work_per_unit():
    """Per batch only for batches of one size (or bigger ones no slower): entries of 1 and
    1000 updates whose fit has a negative intercept (the time is the work's) were charged
    the mean entry's time (about half a second) per single update, and refused behind one."""
    lane = Lane("updates", servers=1, full_batch=1000, merges=True)
    for _ in range(30):
        lane.observe(1, 0.0004)
        lane.observe(1000, 1.0)
    fit = lane.describe()
    assert fit["batch_cost_s"] == 0 and fit["cost_per_work_s"] == pytest.approx(lane._y / lane._x)
    lane.add(1)
    assert lane.delay_s(1) < 0.01
    adm = Admission(0.05, [lane])
    adm.admit("updates", 1)  # a second single update behind the first
    flat = Lane("updates", servers=1, full_batch=1000, merges=True)
    for _ in range(30):
        flat.observe(1, 0.008)
        flat.observe(1000, 0.006)  # bigger entries no slower: a batch's cost
    assert flat.describe()["cost_per_work_s"] == 0 and flat.describe()["batch_cost_s"] == pytest.approx(0.007, rel=0.1)


def test_removing_work_frees_room_and_never_goes_negative():
    lane = Lane("x", 1)
    for _ in range(MIN_BATCHES):
        lane.observe(1, 0.01)
    adm = Admission(0.05, [lane])
    for _ in range(5):
        adm.admit("x", 1)
    with pytest.raises(Overloaded):
        adm.admit("x", 1)
    lane.remove(2)
    adm.admit("x", 1)
    lane.remove(100)
    assert lane.queued == 0 and lane.delay_s() == 0


def test_bad_observations_are_ignored():
    lane = Lane("x", 1)
    lane.observe(0, 1.0)
    lane.observe(5, math.nan)
    assert not lane.measured
    with pytest.raises(ValueError):
        Admission(0, [lane])


def test_the_delay_bound_comes_from_the_flag_else_the_room_an_slo_leaves_else_the_default():
    from hybridgnn.scheduler.admission import delay_bound_s

    assert delay_bound_s(0.25, 0.05, 0.002, 0.01) == 0.25
    assert delay_bound_s(None, 0.05, 0.002, 0.018) == pytest.approx(0.03)
    assert delay_bound_s(None, 0.05, 0.002, 0.047) == pytest.approx(0.01)  # at least a fifth of the SLO
    assert delay_bound_s(None, None, 0.002, None, default_s=0.1) == 0.1


def test_a_full_batch_is_the_first_limit_the_batcher_reaches():
    from hybridgnn.scheduler.admission import full_batch_work, serving_lanes

    assert full_batch_work(math.inf, 1024, 256, seed_psgs=10.0, mean_request_psgs=80.0) == 10_240
    assert full_batch_work(math.inf, 1024, 256, seed_psgs=10.0, mean_request_psgs=20.0) == 5_120
    assert full_batch_work(500.0, 1024, 256, seed_psgs=10.0, mean_request_psgs=20.0) == 500
    assert full_batch_work(1.0, 1024, 256, seed_psgs=10.0, mean_request_psgs=20.0) == 10  # never below one seed
    assert [lane.name for lane in serving_lanes(4, 2, 100.0, 1000)] == ["sampled", "lookup", "new_nodes", "updates"]


def test_loop_lag_counts_only_sustained_lateness():
    from hybridgnn.scheduler.admission import LoopLag

    lag = LoopLag(window=4)
    lag.observe(2.0)  # one long callback (start-up, a big decode): not overload
    assert lag.lag_s == 0.0
    for late in (0.3, 0.25, 0.4, 0.35):  # late at every tick: saturated
        lag.observe(late)
    assert lag.lag_s == pytest.approx(0.25)
    lag.observe(-0.001)  # a timer a hair early counts as on time: caught up
    assert lag.lag_s == 0.0


def test_a_lagging_loop_refuses_even_an_empty_lane_and_adds_to_a_busy_one():
    from hybridgnn.scheduler.admission import LoopLag

    lane = Lane("sampled", 1, full_batch=100)
    for work in [10, 100] * 8:
        lane.observe(work, 0.0005 * work)  # 50 ms per full batch
    adm = Admission(0.1, [lane], LoopLag(window=1))
    adm.admit("sampled", 100)  # 50 ms queued: within the bound
    adm.loop_lag.observe(0.06)  # 50 + 60 ms > 100 ms: the loop's share tips it over
    with pytest.raises(Overloaded):
        adm.admit("sampled", 1)
    assert adm.refused_for_lag == 0  # the lanes' share counted; the lag alone was under the bound
    lane.remove(100)
    adm.check("sampled")  # empty lane, lag under the bound: admitted
    adm.loop_lag.observe(0.25)
    with pytest.raises(Overloaded) as info:
        adm.check("sampled")
    assert adm.refused_for_lag == 1 and "exceeds the 100 ms bound" in str(info.value)
    assert adm.describe()["loop_lag_s"] == pytest.approx(0.25)


def test_backlogged_throughput_bounds_the_delay_when_servers_share_cores():
    """Each batch reports 10 ms of service on 2 servers, but they share one core, so the
    lane completes 50 units/s, not 100: the delay follows what was completed."""
    lane = Lane("sampled", servers=2, full_batch=1)
    for _ in range(10):
        lane.observe(1, 0.01)
    lane.add(10)  # backlogged: more than one full batch per server queued
    fitted = lane.delay_s()
    assert fitted == pytest.approx(10 * 0.01 / 2)
    t = 100.0
    lane.completed(0, t)  # opens a window
    for _ in range(10):  # one unit done every 20 ms, more always arriving
        t += 0.02
        lane.add(1)
        lane.remove(1)
        lane.completed(1, t)
    assert lane.throughput == pytest.approx(50, rel=0.05)
    assert lane.delay_s() == pytest.approx(10 / 50, rel=0.05) and lane.delay_s() > fitted


def test_a_backlogged_window_that_completed_no_work_leaves_the_throughput_usable():
    # A rate of 0 became the throughput, and every later prediction divided by it.
    lane = Lane("sampled", servers=1, full_batch=1)
    lane.observe(1, 0.01)
    lane.add(5)  # backlogged
    lane.completed(0, 0.0)
    lane.completed(0, 0.2)  # a window of only empty work
    assert lane.throughput is None and math.isfinite(lane.delay_s(1))


def test_a_window_in_which_the_lane_ran_dry_is_not_a_throughput_sample():
    lane = Lane("sampled", servers=1, full_batch=1)
    lane.observe(1, 0.01)
    lane.add(5)
    lane.completed(0, 0.0)
    lane.remove(5)  # ran dry: the window's rate says how fast work arrived, not how fast it is served
    lane.completed(5, 0.1)
    assert lane.throughput is None


def test_a_stale_low_throughput_is_raised_by_what_the_lane_completes_without_a_backlog():
    """A throughput measured while cold (or under heavier contention) would otherwise
    stick: refusing by it keeps the queue under the backlog that measures it again."""
    lane = Lane("sampled", servers=1, full_batch=10)
    for _ in range(10):
        lane.observe(10, 0.001)
    lane.throughput = 100.0  # stale: the lane really completes about 1,000 units/s
    lane.add(5)  # never backlogged (under one full batch)
    t = 0.0
    lane.completed(0, t)
    for _ in range(40):  # 10 units every 10 ms: 1,000 units/s
        t += 0.01
        lane.completed(10, t)
    assert lane.throughput > 900
    assert lane.delay_s() < 0.01  # 5 units at ~1,000/s, not 50 ms at the stale 100/s


def test_a_slow_window_without_a_backlog_does_not_lower_the_throughput():
    lane = Lane("sampled", servers=1, full_batch=10)
    lane.observe(10, 0.001)
    lane.throughput = 1000.0
    lane.completed(0, 0.0)
    lane.completed(1, 0.1)  # little arrived: 10 units/s says nothing of the lane's capacity
    assert lane.throughput == 1000.0


def _calibrated_lane(bound_s: float = 0.1) -> Lane:
    lane = Lane("sampled", servers=1, full_batch=10)
    for _ in range(10):
        lane.observe(10, 0.01)  # 1 ms per unit
    return lane


def test_calibration_scales_predictions_by_a_high_quantile_of_what_requests_waited():
    """Requests predicted to wait 50 ms waited 100 ms (the model saw half the contention):
    predictions double, so what admission lets in is what fits the bound in the tail."""
    lane = _calibrated_lane()
    lane.add(50)
    assert lane.delay_s() == pytest.approx(0.05)
    for _ in range(CALIBRATION_MIN):
        lane.calibrate(0.05, 0.1, bound_s=0.1)
    assert lane.scale == pytest.approx(2.0)
    assert lane.delay_s() == pytest.approx(0.1) and lane.model_delay_s() == pytest.approx(0.05)
    assert lane.describe()["calibration_scale"] == pytest.approx(2.0)


def test_calibration_ignores_small_predictions_and_stays_in_range():
    lane = _calibrated_lane()
    for _ in range(4 * CALIBRATION_MIN):
        lane.calibrate(0.001, 0.5, bound_s=0.1)  # a near-empty lane: its own service, not the queue
    assert lane.scale == 1.0
    assert lane.floor_s == pytest.approx(0.05)  # those set the floor, capped at half the bound
    for _ in range(CALIBRATION_MIN):
        lane.calibrate(0.05, 50.0, bound_s=0.1)  # outliers cannot freeze the lane
    assert lane.scale == CALIBRATION_RANGE[1]
    for _ in range(CALIBRATION_SAMPLES):
        lane.calibrate(0.05, 0.0, bound_s=0.1)  # nor an idle one admit without end
    assert lane.scale == CALIBRATION_RANGE[0]


def test_admit_returns_the_model_prediction_it_admitted_by():
    lane = _calibrated_lane()
    adm = Admission(0.1, [lane])
    assert adm.admit("sampled", 20) == pytest.approx(0.02)
    assert adm.admit("sampled", 20) == pytest.approx(0.04)


def test_a_fresh_lane_admits_until_it_has_measured_enough_batches():
    """The first batches of a fresh server run cold: a few slow ones must not refuse the
    requests that follow them on an idle server."""
    lane = Lane("sampled", servers=1, full_batch=10)
    adm = Admission(0.1, [lane])
    for _ in range(MIN_BATCHES - 1):
        lane.observe(1, 1.0)  # cold: a second per unit
    for _ in range(5):
        adm.admit("sampled", 1)
    lane.observe(1, 1.0)
    assert lane.measured
    with pytest.raises(Overloaded):
        adm.admit("sampled", 1)


def test_a_request_that_already_waited_in_the_front_end_counts_that_wait():
    lane = Lane("sampled", 1, full_batch=100)
    for work in [10, 100] * 8:
        lane.observe(work, 0.0005 * work)  # 50 ms per full batch
    adm = Admission(0.1, [lane])
    adm.admit("sampled", 100, waited_s=0.02)  # 50 ms queued + 20 ms waited: within the bound
    with pytest.raises(Overloaded):
        adm.admit("sampled", 1, waited_s=0.06)  # 50 + 60 ms
    lane.remove(100)
    adm.check("sampled", 0.0, waited_s=0.09)  # an empty lane, a wait under the bound: admitted
    with pytest.raises(Overloaded) as info:
        adm.check(None, 0.0, waited_s=0.15)  # no lane named: the wait alone judges
    assert adm.refused_for_lag == 1 and "exceeds the 100 ms bound" in str(info.value)
    adm.check(None, 0.0, waited_s=0.05)


def test_the_floor_is_what_work_waits_with_a_short_queue_and_it_counts_for_any_queue():
    """One-seed floods: the model predicts well under a millisecond for a short queue, but
    admitted requests still wait for the batcher and the hand-back to the loop; that wait
    (a high quantile of it) is the least a request can expect and counts with what it
    already waited."""
    lane = _calibrated_lane()
    adm = Admission(0.1, [lane])
    lane.add(1)
    assert lane.delay_s() == pytest.approx(0.001) and lane.floor_s == 0.0
    waits = [0.002] * 90 + [0.03] * 10  # the tail of short-queue waits: 30 ms
    for i in range(CALIBRATION_SAMPLES):
        lane.calibrate(0.001, waits[i % len(waits)], bound_s=0.1)
    assert lane.floor_s == pytest.approx(0.03)
    assert lane.delay_s() == pytest.approx(0.03) and lane.describe()["floor_s"] == pytest.approx(0.03)
    assert lane.scale == 1.0  # short queues never scale the model
    adm.check("sampled", 1, waited_s=0.065)  # 30 + 65 ms + 2 ms of model
    with pytest.raises(Overloaded):
        adm.check("sampled", 1, waited_s=0.075)
    lane.queued = 0.0
    adm.check("sampled", 1, waited_s=0.095)  # an empty lane takes one while the wait alone is within


def test_an_unmeasured_lane_has_no_floor():
    lane = Lane("sampled", servers=1, full_batch=10)
    lane.floor_s = 0.04
    assert lane.delay_s(5) == 0.0


def test_the_wait_after_reading_adds_to_the_wait_to_be_read():
    """waited_s starts when the request's first byte is parsed; the loop lag is about how
    long it sat unread before that. The two add up."""
    adm = Admission(0.1, [Lane("sampled", 1, full_batch=10)])
    for _ in range(4):
        adm.loop_lag.observe(0.04)
    adm.check(None, 0.0, waited_s=0.05)
    with pytest.raises(Overloaded):
        adm.check(None, 0.0, waited_s=0.07)  # 40 + 70 ms


def test_slo_feedback_shrinks_the_bound_while_the_p99_passes_the_target_and_not_past_its_floor():
    fb = SloFeedback(slo_s=0.05, ceiling_s=0.045)
    for _ in range(SLO_EVERY - 1):
        assert fb.observe(0.050) == 0.045  # the bound moves only every SLO_EVERY answers
    bound = fb.observe(0.050)
    assert bound == pytest.approx(0.045 * SLO_TARGET * 0.05 / 0.050)  # in proportion to the excess
    fb._recent.clear()
    for _ in range(SLO_EVERY):
        fb.observe(0.5)
    assert fb.bound_s == pytest.approx(bound * 0.9)  # but by a tenth at most: one stall is not a queue
    for _ in range(SLO_WINDOW * 20):
        bound = fb.observe(1.0)  # far over: the bound falls to its floor, no further
    assert bound == pytest.approx(SLO_MIN_SHARE * 0.05)
    assert fb.describe()["recent_p99_s"] == pytest.approx(1.0)


def test_slo_feedback_grows_the_bound_back_while_the_p99_is_well_under_the_target_but_not_past_the_ceiling():
    fb = SloFeedback(slo_s=0.05, ceiling_s=0.045)
    for _ in range(SLO_WINDOW):
        fb.observe(0.2)
    assert fb.bound_s < 0.045
    lowest = min(fb.observe(0.001) for _ in range(SLO_WINDOW))  # the slow ones leave the window
    for _ in range(SLO_WINDOW):
        fb.observe(0.001)
    assert fb.bound_s > lowest
    for _ in range(SLO_WINDOW * 20):  # slowly, 2 % a step: a bound back at once would overshoot
        fb.observe(0.001)
    assert fb.bound_s == 0.045  # the bound the SLO leaves is the most it returns to
    # between 0.85 and 1 of the target the bound holds
    held = fb.bound_s = 0.03
    fb._recent.clear()
    for _ in range(SLO_WINDOW):
        fb.observe(0.9 * SLO_TARGET * 0.05)
    assert fb.bound_s == held


def test_slo_feedback_never_reads_one_slow_request_as_the_p99():
    fb = SloFeedback(slo_s=0.05, ceiling_s=0.045)
    for i in range(SLO_WINDOW):
        fb.observe(5.0 if i == 100 else 0.01)  # one outlier in 512 is past the 99th percentile
    assert fb.bound_s == 0.045


def test_admission_follows_answered_latency_only_with_an_slo():
    lane = Lane("sampled", 1, full_batch=10)
    plain = Admission(0.1, [lane])
    for _ in range(SLO_WINDOW):
        plain.observe_latency(10.0)
    assert plain.bound_s == 0.1 and plain.describe()["slo"] is None
    with_slo = Admission(0.045, [Lane("sampled", 1, full_batch=10)], slo_s=0.05)
    for _ in range(SLO_EVERY):
        with_slo.observe_latency(0.1)
    assert with_slo.bound_s < 0.045
    assert with_slo.describe()["slo"]["target_p99_s"] == pytest.approx(SLO_TARGET * 0.05)
    with pytest.raises(ValueError):
        SloFeedback(0.0, 0.045)
    # the loop's lag (a request's wait to be read) counts in the latency it follows
    lagging = Admission(0.045, [Lane("sampled", 1, full_batch=10)], LoopLag(window=1), slo_s=0.05)
    lagging.loop_lag.observe(0.1)
    for _ in range(SLO_EVERY):
        lagging.observe_latency(0.001)
    assert lagging.bound_s < 0.045


def test_a_per_request_lane_charges_its_fixed_cost_per_request_and_the_rest_by_size():
    """New-node requests were one unit each whatever their size: one of 8,192 nodes and
    500,000 edges was predicted to cost what one of a node and ten edges costs. The lane
    now takes work by size and counts its fixed cost once per queued request."""
    from hybridgnn.scheduler.admission import new_node_work, serving_lanes

    lane = next(x for x in serving_lanes(1, 1, 1.0, 1) if x.name == "new_nodes")
    assert lane.per_request
    small, big = new_node_work(1, 10), new_node_work(8192, 500_000)
    for _ in range(8):
        lane.observe(small, 0.010)
        lane.observe(big, 2.0)
    adm = Admission(0.1, [lane])
    for _ in range(3):
        adm.admit("new_nodes", small)
    assert lane.requests == 3 and lane.model_delay_s(small) < 0.06  # four fixed costs, a few units
    with pytest.raises(Overloaded):  # two seconds of work behind three small ones
        adm.admit("new_nodes", big)
    for _ in range(3):
        lane.remove(small)
    assert lane.requests == 0 and lane.queued == 0.0
    adm.admit("new_nodes", big)  # an empty lane takes it
    assert 1.5 < lane.model_delay_s(small) < 2.5
    with pytest.raises(Overloaded):
        adm.admit("new_nodes", small)


def test_the_predicted_delay_is_the_documented_formula_and_grows_with_queued_work():
    """delay(Q) = (a·ceil(Q/B) + slope·Q) / servers, at least Q / backlogged throughput, on
    any batches observed: finite, >= 0, non-decreasing in Q, never NaN."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    batches = st.lists(st.tuples(st.floats(1e-3, 1e6), st.floats(0.0, 10.0)), min_size=MIN_BATCHES, max_size=40)

    @settings(max_examples=200, deadline=None)
    @given(batches, st.integers(1, 64), st.floats(1.0, 1e5), st.floats(0.0, 1e7),
           st.one_of(st.none(), st.floats(1e-3, 1e9)))
    def check(observed, servers, full_batch, queued, throughput):
        lane = Lane("sampled", servers, full_batch)
        for work, seconds in observed:
            lane.observe(work, seconds)
        lane.throughput = throughput
        lane.add(queued)
        delays = [lane.model_delay_s(extra) for extra in (0.0, 1.0, 10.0, 1e3, 1e6)]
        assert all(math.isfinite(d) and d >= 0 for d in delays)
        assert all(b >= a - 1e-12 * max(1.0, a) for a, b in zip(delays, delays[1:], strict=False))
        q = queued + 1e3
        want = (lane._a * math.ceil(q / lane.full_batch) + lane._slope * q) / lane.servers
        if throughput is not None:
            want = max(want, q / throughput)
        assert lane.model_delay_s(1e3) == pytest.approx(want)

    check()


def _per_unit_lane(seconds_per_unit: float, **kw) -> Lane:
    lane = Lane("x", 1, **kw)
    for _ in range(MIN_BATCHES):
        lane.observe(1, seconds_per_unit)
    return lane


@pytest.mark.parametrize("extra, retry_s", [(0.5, 2), (0.05, 1), (1000.0, 60)])
def test_retry_after_is_the_excess_rounded_up_within_a_second_and_a_minute(extra, retry_s):
    """1 s a unit, one unit queued, a 0.1 s bound: `extra` more waits 1 + extra seconds,
    past the bound by 0.9 + extra; a client told to come back before that is refused again."""
    adm = Admission(0.1, [_per_unit_lane(1.0)])
    adm.admit("x", 1)
    with pytest.raises(Overloaded) as info:
        adm.admit("x", extra)
    assert info.value.headers()["Retry-After"] == str(retry_s)
    assert f"retry in {retry_s} s" in str(info.value)


def test_a_per_request_lane_charges_a_new_requests_own_fixed_cost():
    lane = Lane("new_nodes", 1, per_request=True)
    for _ in range(MIN_BATCHES):
        lane.observe(1, 0.011)  # 10 ms a request + 1 ms a unit
        lane.observe(10, 0.020)
    assert lane.model_delay_s(0.0) == 0.0
    assert lane.model_delay_s(10) == pytest.approx(0.020, rel=1e-6)  # its own 10 ms, not only its units
    from hybridgnn.scheduler.admission import new_node_work

    assert new_node_work(0, 0) == 1.0  # an empty request still costs a request


def test_a_per_request_lane_is_backlogged_once_every_server_holds_a_request():
    lane = Lane("new_nodes", 2, per_request=True)
    lane.add(1)
    lane.add(1)
    lane.completed(0.0, 10.0)  # a window opens with both servers busy
    lane.completed(5.0, 10.1)
    assert lane.throughput == pytest.approx(50.0)


def test_predictions_under_a_fifth_of_the_bound_set_the_floor_not_the_scale():
    lane = _per_unit_lane(0.01)
    for _ in range(CALIBRATION_MIN):
        lane.calibrate(0.15, 1.5, bound_s=1.0)  # waited 10x a small prediction
    assert lane.scale == 1.0 and lane.floor_s == pytest.approx(0.5)  # at most half the bound
    for _ in range(CALIBRATION_MIN):
        lane.calibrate(0.25, 0.5, bound_s=1.0)
    assert lane.scale == pytest.approx(2.0)


def test_slo_feedback_never_raises_the_bound_past_a_configured_one_below_its_floor():
    """A configured bound under a tenth of the SLO is both ceiling and floor."""
    fb = SloFeedback(slo_s=1.0, ceiling_s=0.05)
    for _ in range(2 * SLO_EVERY):
        bound = fb.observe(5.0)  # far past the target: the bound shrinks to its floor
    assert bound == pytest.approx(0.05)


def test_admission_for_an_slo_leaves_room_for_the_slowest_pipelines_full_batch():
    from pathlib import Path
    from types import SimpleNamespace

    from hybridgnn.config import ServeConfig
    from hybridgnn.scheduler.admission import admission_for

    cfg = ServeConfig(dataset_dir=Path("/nonexistent"), model_dir=Path("/nonexistent"))
    profile = SimpleNamespace(devices={"cpu": SimpleNamespace(tail=lambda x: 0.010),
                                       "gpu": SimpleNamespace(tail=lambda x: 0.050)})
    adm = admission_for(cfg, 2, 100.0, SimpleNamespace(name="slo:100"), profile)
    assert adm.bound_s == pytest.approx(0.100 - cfg.batcher.max_wait_s - 0.050)
    assert adm.slo is not None and adm.slo.target_s == pytest.approx(SLO_TARGET * 0.1)
