"""Curve fitting, crossing points and SLO choice on synthetic curves; the workload
generator and closed-loop runner; profile save/load/mismatch checks."""

import dataclasses
import math
import time

import numpy as np
import pytest

from hybridgnn.profiling.runner import BatchGenerator, ProfileConfig, run_closed_loop
from hybridgnn.scheduler.curves import (
    Curve,
    DeviceCurves,
    bin_statistics,
    capacity,
    choose_for_slo,
    crossing,
    isotonic,
    operating_points,
)
from hybridgnn.scheduler.queueing import (
    ServingLoad,
    frontend_capacity,
    frontend_wait_p99_s,
)
from hybridgnn.telemetry.metrics import Telemetry

X = np.exp(np.linspace(math.log(10), math.log(1e5), 30))


def curve(fn) -> Curve:
    return Curve([float(x) for x in X], [float(fn(x)) for x in X])


def test_isotonic_pools_violators_by_weight():
    assert isotonic(np.array([1.0, 3.0, 2.0, 4.0]), np.array([1, 1, 1, 1])).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert isotonic(np.array([5.0, 1.0]), np.array([3, 1])).tolist() == [4.0, 4.0]


def test_curve_interpolates_in_log_space_and_grows_proportionally_beyond():
    c = Curve([10.0, 1000.0], [1.0, 3.0])
    assert float(c(100.0)) == pytest.approx(2.0)
    assert float(c(5.0)) == 1.0 and float(c(2000.0)) == pytest.approx(6.0)
    assert c.max_psgs_within(2.0) == pytest.approx(100.0)
    assert c.max_psgs_within(0.5) == 0.0 and c.max_psgs_within(6.0) == pytest.approx(2000.0)


@pytest.mark.parametrize("seconds", [[float("nan"), 3.0], [1.0, math.inf], [0.0, 0.0], [-1.0, 3.0]])
def test_a_curve_with_a_latency_that_is_not_finite_and_positive_is_refused(seconds):
    """NaN compares false (a threshold from nothing), inf never crosses, and zero made an
    SLO choice divide by zero: a profile holding one is refused (a ValueError, which
    serve reports as a configuration error), not served."""
    with pytest.raises(ValueError, match="finite and positive"):
        Curve([10.0, 1000.0], seconds)
    with pytest.raises(ValueError, match="finite and positive"):
        Curve([float("nan"), 1000.0], [1.0, 3.0])


def test_noisy_bins_fit_a_monotone_curve():
    rng = np.random.default_rng(0)
    truth = 1e-3 + 2e-7 * X
    noisy = truth * (1 + 0.3 * rng.standard_normal(X.size))
    c = Curve.fit(X, noisy, np.full(X.size, 50))
    assert np.all(np.diff(c.seconds) >= 0)
    assert np.median(np.abs(np.asarray(c.seconds) / truth - 1)) < 0.25


def test_the_batch_bound_of_a_falling_hand_written_curve_is_read_on_its_rising_envelope():
    """The bound searched the knots as if sorted: a curve that falls somewhere gave any answer."""
    falling = Curve([10.0, 100.0, 1000.0], [0.01, 0.005, 0.02])
    assert falling.max_psgs_within(0.008) == 0.0  # 10 PSGS already takes 10 ms
    assert falling.max_psgs_within(0.015) == pytest.approx(10 ** 2.5)
    assert falling.max_psgs_within(0.04) == pytest.approx(2000.0)


def test_crossing_found_where_the_curves_meet():
    cpu = curve(lambda x: 1e-6 * x)  # grows fast with PSGS
    gpu = curve(lambda x: 2e-3 + 1e-8 * x)  # fixed launch cost, cheap per node
    thr, kind = crossing(cpu, gpu, 10, 1e5)
    want = 2e-3 / (1e-6 - 1e-8)
    assert kind == "crossed" and thr == pytest.approx(want, rel=0.02)


def test_non_crossing_curves_name_the_dominant_device():
    fast, slow = curve(lambda x: 1e-4 * math.log(x)), curve(lambda x: 1e-2 + 1e-4 * math.log(x))
    assert crossing(fast, slow, 10, 1e5) == (math.inf, "cpu_dominates")
    assert crossing(slow, fast, 10, 1e5) == (0.0, "gpu_dominates")


def test_inverted_curves_are_named_so_and_the_stronger_device_takes_all():
    """The GPU lower at small PSGS and the CPU at large was labelled "gpu_dominates"."""
    gpu = curve(lambda x: 1e-6 * x)  # lower below 2,000 PSGS
    cpu = curve(lambda x: 2e-3 + 1e-8 * x)
    assert crossing(cpu, gpu, 10, 1e5) == (0.0, "inverted")
    pts = operating_points(DeviceCurves(cpu, cpu, 2), DeviceCurves(gpu, gpu, 2), 10, 1e5, mean_seed_psgs=10.0)
    point = pts["latency_preferred"]
    assert point.crossing == "inverted" and point.psgs_threshold == math.inf  # the CPU sustains more at 1e5
    assert point.predicted_seeds_per_s == pytest.approx(2 / (2e-3 + 1e-3) * 1e5 / 10, rel=0.05)


def test_four_points_are_ordered_as_quiver_describes():
    # CPU: mean 1e-6 x, tail 2e-6 x. GPU: mean 2e-3 + 1e-8 x, tail 4e-3 + 2e-8 x.
    cpu = DeviceCurves(curve(lambda x: 1e-6 * x), curve(lambda x: 2e-6 * x), 2)
    gpu = DeviceCurves(curve(lambda x: 2e-3 + 1e-8 * x), curve(lambda x: 4e-3 + 2e-8 * x), 2)
    pts = operating_points(cpu, gpu, 10, 1e5, mean_seed_psgs=10.0)
    thr = {k: p.psgs_threshold for k, p in pts.items()}
    assert all(p.crossing == "crossed" for p in pts.values())
    # CPU tail = GPU mean comes first, CPU mean = GPU tail last
    assert thr["cpu_preferred"] < thr["latency_preferred"] < thr["gpu_preferred"]
    assert thr["cpu_preferred"] < thr["throughput_preferred"] < thr["gpu_preferred"]
    assert thr["latency_preferred"] == pytest.approx(4e-3 / (2e-6 - 2e-8), rel=0.02)
    assert all(p.predicted_seeds_per_s > 0 for p in pts.values())


def test_slo_choice_keeps_each_device_within_its_limit():
    # CPU: linear in PSGS, tail 2x the mean; GPU: a fixed launch cost, cheap per node
    cpu = DeviceCurves(curve(lambda x: 1e-6 * x), curve(lambda x: 2e-6 * x), 2, cores_used=2)
    gpu = DeviceCurves(curve(lambda x: 2e-3 + 1e-8 * x), curve(lambda x: 4e-3 + 2e-8 * x), 2)
    load = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)
    c = choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.020, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=load)
    # no bound lets one batch's own latency exceed what the SLO leaves after batching
    assert 0 < c.pipeline_limits["cpu"] <= cpu.tail.max_psgs_within(0.018) + 1e-6
    assert 0 < c.pipeline_limits["gpu"] <= gpu.tail.max_psgs_within(0.018) + 1e-6
    assert c.max_batch_psgs == pytest.approx(max(c.pipeline_limits.values()))
    assert c.psgs_threshold <= c.pipeline_limits["cpu"]
    assert c.predicted_p99_s <= 0.020 + 1e-9 and c.predicted_seeds_per_s > 0
    with pytest.raises(ValueError, match="no batch meets a p99 of 3 ms "):
        choose_for_slo({"gpu": gpu}, 0.003, 10.0, lo=10, hi=1e5)
    with pytest.raises(ValueError, match="no batch meets a p99 of 0.001 ms "):  # it said 0.0 ms
        choose_for_slo({"gpu": gpu}, 1e-6, 10.0, lo=10, hi=1e5)


def test_slo_choice_puts_a_split_cpu_lane_and_the_gpu_lane_on_one_device():
    """A split CPU lane's device share queues with the GPU lane: the rates chosen together
    fit less than two devices would, and the CPU lane's device share decides how much."""
    gpu = DeviceCurves(curve(lambda x: 2e-3 + 1e-7 * x), curve(lambda x: 4e-3 + 2e-7 * x), 2)
    load = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)

    def chosen(device_share):
        cpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-6 * x), curve(lambda x: 2e-3 + 2e-6 * x), 2, cores_used=2,
                           device_share=device_share)
        return choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.030, 10.0, batching_wait_s=0.002, lo=10, hi=1e5,
                              load=load)

    light = chosen(curve(lambda x: 2e-5 + 1e-9 * x))  # the device does little of a CPU-lane batch
    heavy = chosen(curve(lambda x: 8e-4 + 8e-7 * x))  # most of it, 8x the GPU lane's cost per PSGS
    # the heavy lane's device work displaces the GPU lane's: together they fit less (the GPU
    # lane alone fills the device, so the light lane adds little more than what its host
    # share samples in the room a slightly slower GPU lane leaves)
    assert heavy.predicted_seeds_per_s < 0.995 * light.predicted_seeds_per_s
    for c in (light, heavy):
        assert c.predicted_p99_s <= 0.030 + 1e-9 and c.pipeline_limits["gpu"] > 0


def test_slo_choice_says_when_nothing_fits_on_the_shared_device():
    """The GPU lane fits nothing within the SLO and the split CPU lane's device share takes
    longer than the SLO: the CPU lane fits alone (its mean curve) but not on the shared
    device. That was a choice of 0 seeds/s "at a p99 of 0", and served."""
    gpu = DeviceCurves(curve(lambda x: 1.0 + 0 * x), curve(lambda x: 1.0 + 0 * x), 1)
    cpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-7 * x), curve(lambda x: 2e-3 + 2e-7 * x), 2, cores_used=2,
                       device_share=curve(lambda x: 0.5 + 0 * x))
    load = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)
    with pytest.raises(ValueError, match="no load meets a p99 of 30 ms once the split CPU lane"):
        choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.030, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=load)


def test_slo_choice_never_fits_more_on_the_shared_device_than_it_can_serve():
    """The CPU lane's device share costs what the GPU lane's batches cost: the GPU lane alone
    already fills the device, so together they fit no more. A few thousand simulated
    requests at a high rate are a few batches, too few for the p99 to show the device
    overloaded: the CPU lane's rate was found up to twice the lanes' alone rates, and two
    independent devices fit twice as much."""
    f = curve(lambda x: 1e-3 + 1e-7 * x)
    gpu = DeviceCurves(f, curve(lambda x: 1.5 * (1e-3 + 1e-7 * x)), 1)
    cpu = DeviceCurves(curve(lambda x: 1.1 * (1e-3 + 1e-7 * x)), curve(lambda x: 1.65 * (1e-3 + 1e-7 * x)), 4,
                       cores_used=2, device_share=f)
    kw = dict(batching_wait_s=0.002, lo=10, hi=1e5, load=ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2))
    alone = choose_for_slo({"gpu": gpu}, 0.030, 10.0, **kw).predicted_seeds_per_s
    both = choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.030, 10.0, **kw).predicted_seeds_per_s
    assert alone <= both <= 1.1 * alone


def test_slo_choice_charges_spread_and_front_end():
    cpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-6 * x), curve(lambda x: 3e-3 + 3e-6 * x), 2, cores_used=2)
    quiet = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)
    strict = choose_for_slo({"cpu": cpu}, 0.050, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=quiet)
    loose = choose_for_slo({"cpu": cpu}, 0.050, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=quiet, tail=False)
    # the mean curve alone (PSGS-loose) promises more than the measured spread allows
    assert loose.predicted_seeds_per_s > strict.predicted_seeds_per_s
    assert math.isinf(strict.psgs_threshold)
    busy = ServingLoad(request_seeds=4, frontend_cpu_s=300e-6, colocated_cpu_s=200e-6, cores=2)
    charged = choose_for_slo({"cpu": cpu}, 0.050, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=busy)
    assert charged.predicted_seeds_per_s < 0.9 * strict.predicted_seeds_per_s
    # a device pipeline's batches are not slowed by the front end's CPU use ...
    dev = DeviceCurves(cpu.mean, cpu.tail, 2, cores_used=0)
    light = ServingLoad(request_seeds=4, frontend_cpu_s=5e-6, colocated_cpu_s=200e-6, cores=2)
    assert choose_for_slo({"gpu": dev}, 0.050, 10.0, batching_wait_s=0.002, lo=10, hi=1e5,
                          load=light).predicted_seeds_per_s == pytest.approx(strict.predicted_seeds_per_s, rel=0.05)
    # ... but nothing is offered more requests than one event loop can take
    slow_loop = ServingLoad(request_seeds=4, frontend_cpu_s=2e-3, cores=2)
    capped = choose_for_slo({"gpu": dev}, 0.050, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=slow_loop)
    assert capped.predicted_seeds_per_s <= 4 * frontend_capacity(2e-3) + 1e-6
    assert capped.predicted_seeds_per_s < 0.5 * strict.predicted_seeds_per_s


def test_event_loop_wait_grows_with_its_utilisation_and_caps_the_rate():
    assert frontend_wait_p99_s(0.0, 1e-3) == 0.0 and frontend_capacity(0.0) == math.inf
    waits = [frontend_wait_p99_s(r, 1e-3) for r in (100, 400, 700, 850)]
    assert waits == sorted(waits) and waits[-1] > 10 * waits[0]
    assert math.isinf(frontend_wait_p99_s(900, 1e-3)) and frontend_capacity(1e-3) == pytest.approx(900)


def test_generator_spans_the_psgs_range_and_runner_fills_every_bin():
    psgs = np.random.default_rng(0).pareto(1.5, 5000) * 10 + 1
    cfg = ProfileConfig(bins=8, min_samples=20, max_batch=256, budget_s=30)
    gen = BatchGenerator(psgs, cfg)
    seen = []

    def fake(worker, seeds):
        seen.append(worker)

    samples, complete = run_closed_loop(fake, 2, gen, cfg)
    assert complete and set(seen) <= {0, 1}
    stats = bin_statistics(samples, gen.edges)
    assert len(stats["count"]) == 8 and min(stats["count"]) >= 20
    assert max(samples.psgs) / min(samples.psgs) > 100  # several decades


def test_runner_leaves_out_a_shared_stage_queue_when_asked(monkeypatch):
    """A split lane's batch reports how long it waited for the lane's one device stage
    (timings.queue_wait_s); own_service records the batch's time less that wait. A fake
    clock makes each batch take 10 ms, 6 of them waiting."""
    import time
    from types import SimpleNamespace

    from hybridgnn.profiling import runner
    from hybridgnn.types import StageTimings

    clock = [0.0]
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))

    def shared(worker, seeds):
        clock[0] += 0.010
        return SimpleNamespace(timings=StageTimings(queue_wait_s=0.006))

    cfg = ProfileConfig(bins=2, min_samples=1, max_batch=4)
    for own, want in ((False, 0.010), (True, 0.004)):
        samples, _ = run_closed_loop(shared, 1, BatchGenerator(np.ones(100), cfg), cfg, own_service=own)
        np.testing.assert_allclose(samples.seconds, want, rtol=1e-9)
    # a wait longer than the measured time (clocks differ) never makes a time negative
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: 0.0, monotonic=time.monotonic))
    samples, _ = run_closed_loop(shared, 1, BatchGenerator(np.ones(100), cfg), cfg, own_service=True)
    assert min(samples.seconds) > 0


def test_a_split_lanes_capacity_is_at_most_what_its_one_device_stage_finishes():
    fast_host = DeviceCurves(curve(lambda x: 1e-3), curve(lambda x: 2e-3), 16, cores_used=16)
    split = dataclasses.replace(fast_host, device_share=curve(lambda x: 5e-4))
    # 16 workers at 1 ms would finish 16,000 batches/s; one stage at 0.5 ms finishes 2,000
    assert capacity(fast_host, 100.0, 10.0) == pytest.approx(16_000 * 10)
    assert capacity(split, 100.0, 10.0) == pytest.approx(2_000 * 10)


def test_runner_surfaces_a_pipeline_error():
    gen = BatchGenerator(np.ones(100), ProfileConfig(bins=2, min_samples=1, max_batch=4))

    def broken(worker, seeds):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_closed_loop(broken, 2, gen, ProfileConfig(bins=2, min_samples=1, max_batch=4))


def test_profile_end_to_end_on_a_small_graph(tiny_dataset, tiny_model, tmp_path):
    from hybridgnn.config import PipelineConfig, SamplingConfig, ServeConfig
    from hybridgnn.profiling.profile import build_profile
    from hybridgnn.scheduler.policy import Profile, ProfileMismatch

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"))
    data = build_profile(cfg, ProfileConfig(bins=4, min_samples=5, max_batch=64, budget_s=20), progress=False)
    prof = Profile(data)
    path = prof.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert set(again.devices) == {"cpu", "gpu"} and set(again.data["points"]) == {
        "cpu_preferred", "gpu_preferred", "latency_preferred", "throughput_preferred"}
    again.check_matches(again.data["dataset"]["fingerprint"], tiny_model, (5, 3))
    with pytest.raises(ProfileMismatch, match="fanouts"):
        again.check_matches(again.data["dataset"]["fingerprint"], tiny_model, (10, 5))
    with pytest.raises(ProfileMismatch, match="dataset"):
        again.check_matches("0000", tiny_model, (5, 3))
    pol = again.policy("slo:500")
    assert pol.max_batch_psgs > 0 and pol.predicted_p99_s <= 0.5 + 1e-9
    assert again.policy("latency").psgs_threshold >= 0
    with pytest.raises(ValueError, match="policy must be .*slo:<ms> or slo-mean:<ms>"):
        again.policy("fastest")
    with pytest.raises(ValueError, match="slo:<milliseconds>"):
        again.policy("slo:soon")
    import json

    bad = tmp_path / "bad.json"
    for edit, match in ((lambda d: [], "holds a JSON list"), (lambda d: {**d, "dataset": None}, "TypeError"),
                        (lambda d: {k: v for k, v in d.items() if k != "fanouts"}, "KeyError: 'fanouts'"),
                        (lambda d: {**d, "bin_edges": []}, "bin_edges must be at least two increasing numbers")):
        bad.write_text(json.dumps(edit(data)))
        with pytest.raises(ValueError, match=match):
            Profile.load(bad)
    from hybridgnn.profiling.plot import plot_profile

    pngs = plot_profile(again, tmp_path / "p")
    assert all(p.stat().st_size > 1000 for p in pngs)
    # a dotted name keeps its dots: g.v2.json's plots went to g.png and g.svg, over g.json's
    assert [p.name for p in plot_profile(again, tmp_path / "g.v2")] == ["g.v2.png", "g.v2.svg"]


def test_a_split_cpu_lane_is_profiled_as_served_with_its_device_share(tiny_dataset, tiny_model, monkeypatch):
    from hybridgnn.config import PipelineConfig, SamplingConfig, ServeConfig
    from hybridgnn.profiling import profile as profile_mod
    from hybridgnn.profiling.profile import build_profile
    from hybridgnn.scheduler.policy import Profile

    own_service = {}
    real = profile_mod.run_closed_loop

    def recording(run_batch, workers, gen, cfg, **kw):
        own_service[len(own_service)] = kw.get("own_service", False)
        return real(run_batch, workers, gen, cfg, **kw)

    monkeypatch.setattr(profile_mod, "run_closed_loop", recording)
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      cpu_pipeline=PipelineConfig(split=True, workers=2),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=1))
    data = build_profile(cfg, ProfileConfig(bins=3, min_samples=5, max_batch=32, budget_s=15), progress=False)
    # the split lane's batches are timed without their wait for its one device stage
    assert own_service == {0: True, 1: False}  # cpu, then gpu
    cpu = data["pipelines"]["cpu"]
    assert cpu["split"] is True and not data["pipelines"]["gpu"]["split"] and not cpu["other_lane_loaded"]
    total, share = Curve(**cpu["curves"]["mean"]), Curve(**cpu["curves"]["device"])
    assert np.all(share(total.psgs) <= total(total.psgs) * 1.5)  # a share of the batch's time (bins differ)
    prof = Profile(data)
    assert prof.devices["cpu"].device_share is not None and prof.devices["gpu"].device_share is None
    pol = prof.policy("slo:500")  # chosen on one simulated device
    assert pol.predicted_p99_s <= 0.5 + 1e-9 and pol.predicted_seeds_per_s > 0
    # --adapt's re-fit keeps the device share (the lanes stay on one simulated device)
    live = {"cpu": (np.asarray(cpu["raw"]["psgs"]), np.asarray(cpu["raw"]["seconds"]))}
    assert prof.refit(live, min_bin_samples=1).devices["cpu"].device_share is not None
    # profiled beside the other lane's device work: the curves hold the contention, no share
    loaded = build_profile(cfg, ProfileConfig(bins=2, min_samples=3, max_batch=16, budget_s=5,
                                              other_lane_loaded=True), progress=False)
    assert loaded["pipelines"]["cpu"]["other_lane_loaded"] and "device" not in loaded["pipelines"]["cpu"]["curves"]
    assert Profile(loaded).devices["cpu"].device_share is None


def test_adapt_moves_the_threshold_towards_live_curves_within_a_bounded_step(tiny_dataset, tiny_model, tmp_path):
    import asyncio

    from hybridgnn.config import (
        PipelineConfig,
        PolicyConfig,
        SamplingConfig,
        ServeConfig,
    )
    from hybridgnn.profiling.profile import build_profile
    from hybridgnn.scheduler.policy import Profile
    from hybridgnn.serving.core.engine import Engine

    base = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                       gpu_pipeline=PipelineConfig(name="gpu", device="cpu"))
    prof = Profile(build_profile(base, ProfileConfig(bins=4, min_samples=5, max_batch=64, budget_s=20),
                                 progress=False))
    path = prof.save(tmp_path / "p.json")
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"),
                      policy=PolicyConfig(profile=path, policy="slo:50", adapt=True, adapt_min_batches=50))

    def twenty_times_slower(xs):
        """Live batches 20x the profiled mean with the profile's own spread around it, so
        the re-fitted curves are the profiled ones scaled by 20 however noisy the profile
        run was (a stall there widens its tail; spread-free samples could then look faster)."""
        cpu = prof.devices["cpu"]
        ratios = cpu.service_ratios()
        return [(float(x), 20 * float(cpu.mean(x)) * float(ratios[i % len(ratios)])) for i, x in enumerate(xs)]

    async def scenario():
        engine = Engine(cfg, Telemetry())
        await engine.start()
        try:
            before = engine._control.policy
            assert not engine.adapt_once()  # nothing recorded yet
            # the CPU pipeline has become 20x slower than profiled: it may take far less
            edges = np.asarray(prof.data["bin_edges"])
            xs = np.exp(np.random.default_rng(0).uniform(np.log(edges[0]), np.log(edges[-1]), 400))
            _record(engine._control, "cpu", twenty_times_slower(xs))
            engine._control.count_admitted(8)  # traffic since the last step: something new to re-fit from
            assert engine.adapt_once()
            # batches run 20x slower than profiled, and the server says so
            assert engine._control.service_stretch()["cpu"] == pytest.approx(20, rel=0.5)
            assert engine.metadata()["service_stretch"] == engine._control.service_stretch()
            after = engine._control.policy
            cpu_before, cpu_after = before.pipeline_limits["cpu"], after.pipeline_limits["cpu"]
            assert cpu_after < cpu_before
            if np.isfinite(before.psgs_threshold) and before.psgs_threshold > 0:
                assert after.psgs_threshold >= before.psgs_threshold / 2 - 1e-9  # bounded step
            assert "hybridgnn_policy_changes_total 1.0" in engine.stats.exposition()[0].decode()
        finally:
            await engine.stop()

    asyncio.run(scenario())

    # the serving loop makes the same choice in a helper process, off the event loop
    fast = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, adapt_interval_s=0.2))

    async def background():
        engine = Engine(fast)
        await engine.start()
        try:
            before = engine._control.policy.pipeline_limits["cpu"]
            _record(engine._control, "cpu", twenty_times_slower(xs))
            engine._control.count_admitted(8)
            deadline = time.monotonic() + 60
            while engine._control.policy.pipeline_limits["cpu"] >= before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # polling the policy, bounded by the deadline
            assert engine._control.policy.pipeline_limits["cpu"] < before
        finally:
            await engine.stop()

    edges = np.asarray(prof.data["bin_edges"])
    xs = np.exp(np.random.default_rng(0).uniform(np.log(edges[0]), np.log(edges[-1]), 400))
    asyncio.run(background())


def test_slo_choice_counts_no_cpu_rate_where_the_gpu_takes_every_batch():
    """The GPU's tail is below the CPU's at every PSGS, so the threshold is 0: the CPU
    pipeline sees only what spills from a saturated GPU, and the prediction (which
    bench/slo_batching offers load from) is the GPU's alone."""
    cpu = DeviceCurves(curve(lambda x: 4e-3 + 1e-6 * x), curve(lambda x: 8e-3 + 2e-6 * x), 2, cores_used=2)
    gpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-8 * x), curve(lambda x: 2e-3 + 2e-8 * x), 2)
    load = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)
    both = choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.030, 10.0, lo=10, hi=1e5, load=load)
    alone = choose_for_slo({"gpu": gpu}, 0.030, 10.0, lo=10, hi=1e5, load=load)
    assert both.psgs_threshold == 0 and both.pipeline_limits["cpu"] > 0  # the CPU may still take spills
    assert both.predicted_seeds_per_s == pytest.approx(alone.predicted_seeds_per_s)


DEMO_PROFILE = __import__("pathlib").Path(__file__).parents[2] / "profiles" / "demo-sage-2core-epyc.json"


def _edited_profile(tmp_path, edit):
    import copy
    import json

    data = json.loads(DEMO_PROFILE.read_text())
    edit(data := copy.deepcopy(data))
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        for k in keys[:-1]:
            data = data[k]
        data[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    # a billion workers: the SLO simulation allocated a slot per worker (8 GB) and scanned
    # them all per batch; 65,536 took 6.5 minutes
    (_set("pipelines", "gpu", "workers", 10**9), r"workers must be a whole number in \[1, 1024\]"),
    (_set("pipelines", "cpu", "workers", 0), "workers must be"),  # predicted negative or zero throughput
    (_set("pipelines", "cpu", "workers", "2"), "workers must be"),  # a TypeError past the loader
    (_set("pipelines", "cpu", "workers", float("inf")), "workers must be"),  # OverflowError
    (_set("pipelines", "cpu", "torch_threads", "x"), "torch_threads must be"),
    (_set("mean_seed_psgs", 0), "mean_seed_psgs must be finite positive"),  # ZeroDivisionError
    (_set("mean_seed_psgs", float("nan")), "mean_seed_psgs must be finite positive"),
    (_set("seed_psgs_quantiles", [0.0]), "seed_psgs_quantiles must be finite positive"),  # ZeroDivisionError
    (_set("seed_psgs_quantiles", [-5.0, float("nan")]), "seed_psgs_quantiles must be finite positive"),
    (_set("seed_psgs_quantiles", [[1, 2], [3]]), "seed_psgs_quantiles must be positive numbers"),
    (_set("bin_edges", [0, 100]), "bin_edges must be finite positive"),  # "math domain error"
    (_set("bin_edges", [100, 10]), "bin_edges must be at least two increasing"),
    (_set("pipelines", {}), "no pipelines"),  # "min() arg is an empty sequence"
    # numpy's "operands could not be broadcast together" and "could not convert string to float"
    (lambda d: d["pipelines"]["cpu"]["raw"]["seconds"].pop(), "raw psgs and seconds must be two lists of as many"),
    (_set("pipelines", "gpu", "raw", "psgs", ["a"]), "raw psgs and seconds must be numbers"),
])
@pytest.mark.parametrize("spec", ["slo:30", "latency"])
def test_a_profile_with_values_the_choice_cannot_use_is_refused_at_load(tmp_path, edit, match, spec):
    from hybridgnn.scheduler.policy import Profile

    path = _edited_profile(tmp_path, edit)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        Profile.load(path).policy(spec, load=ServingLoad(cores=2))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("spec", ["slo:inf", "slo:Infinity", "slo-mean:inf", "slo:nan", "slo:0", "slo:-5"])
def test_an_slo_that_is_not_a_positive_finite_number_is_refused_in_words(tmp_path, spec):
    """slo:inf was refused as "min() arg is an empty sequence"."""
    from hybridgnn.scheduler.policy import Profile

    prof = Profile.load(_edited_profile(tmp_path, lambda data: None))
    with pytest.raises(ValueError, match="the SLO must be a positive, finite number of milliseconds"):
        prof.policy(spec, load=ServingLoad(cores=2))


def test_a_profile_save_interrupted_mid_write_leaves_the_old_one(tmp_path, monkeypatch):
    """It was written in place: a kill mid-write left a truncated profile where the old one was."""
    from pathlib import Path

    from hybridgnn.scheduler.policy import Profile

    path = _edited_profile(tmp_path, lambda data: None)
    old = path.read_text()
    prof = Profile.load(path)
    real_write = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        prof.save(path)
    monkeypatch.undo()
    assert path.read_text() == old and sorted(tmp_path.iterdir()) == [path]
    assert Profile.load(prof.save(path)).data == prof.data


def test_a_profile_that_is_not_a_regular_file_of_a_profiles_size_is_refused_unread(tmp_path):
    """A FIFO no one writes to hung the server's start; /dev/zero was read until memory ran out."""
    import os

    from hybridgnn.scheduler.policy import MAX_PROFILE_BYTES, Profile

    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", "/dev/zero"):
        with pytest.raises(ValueError, match="is not a regular file"):
            Profile.load(path)
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(MAX_PROFILE_BYTES + 1)  # sparse: no disk taken
    with pytest.raises(ValueError, match="past the 268,435,456 a `hybridgnn profile` writes"):
        Profile.load(tmp_path / "huge.json")


def test_a_profile_path_that_is_a_directory_is_a_value_error(tmp_path):
    from hybridgnn.scheduler.policy import Profile

    with pytest.raises(ValueError, match="cannot read profile"):
        Profile.load(tmp_path)




def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                        max_leaves=8)


FIELDS = [("mean_seed_psgs",), ("seed_psgs_quantiles",), ("bin_edges",), ("pipelines",), ("pipelines", "cpu"),
          ("pipelines", "cpu", "workers"), ("pipelines", "gpu", "torch_threads"), ("pipelines", "cpu", "curves"),
          ("pipelines", "cpu", "curves", "mean"), ("pipelines", "gpu", "curves", "tail", "seconds"),
          ("pipelines", "cpu", "curves", "mean", "psgs"), ("pipelines", "cpu", "raw"),
          ("pipelines", "gpu", "raw", "seconds"), ("pipelines", "cpu", "curves", "device"), ("dataset",),
          ("fanouts",)]


def test_any_json_in_any_profile_field_loads_or_is_one_value_error():
    """Whatever a damaged or hand-edited profile holds in a field, loading it and taking an
    operating point either works or raises ValueError (what serve turns into one line)."""
    import copy
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from hybridgnn.scheduler.policy import Profile

    base = json.loads(DEMO_PROFILE.read_text())

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(FIELDS), _json_values())
    def check(field, value):
        data = copy.deepcopy(base)
        target = data
        for k in field[:-1]:
            target = target[k]
        target[field[-1]] = value
        try:
            prof = Profile(data)
        except ValueError:
            return
        except (KeyError, TypeError, IndexError, AttributeError):
            return  # what Profile.load turns into its one-line ValueError
        try:
            prof.policy("latency")
        except ValueError:
            pass

    check()


def _record(control, pipeline: str, batches) -> None:
    for psgs, seconds in batches:
        control.record(pipeline, psgs, seconds)


def test_an_slo_choice_is_the_same_every_time_and_holds_no_nan(tmp_path):
    from hybridgnn.scheduler.policy import Profile

    prof = Profile.load(_edited_profile(tmp_path, lambda data: None))
    first, again = (prof.policy("slo:40", batching_wait_s=0.002, load=ServingLoad(cores=2)) for _ in range(2))
    assert first == again
    values = [first.psgs_threshold, first.max_batch_psgs, first.predicted_seeds_per_s, first.predicted_p99_s,
              *first.pipeline_limits.values()]
    assert all(v >= 0 and not math.isnan(v) for v in values) and first.predicted_p99_s <= 0.040


def test_slo_choice_sends_every_batch_to_the_cpu_when_the_gpu_fits_none():
    cpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-6 * x), curve(lambda x: 2e-3 + 2e-6 * x), 2, cores_used=2)
    gpu = DeviceCurves(curve(lambda x: 1.0 + 0 * x), curve(lambda x: 2.0 + 0 * x), 2)  # a second a batch
    load = ServingLoad(request_seeds=4, frontend_cpu_s=0.0, cores=2)
    c = choose_for_slo({"cpu": cpu, "gpu": gpu}, 0.030, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=load)
    assert c.pipeline_limits["gpu"] == 0 and c.pipeline_limits["cpu"] > 0
    assert math.isinf(c.psgs_threshold)  # not the crossing, which would send big batches to the GPU


def test_slo_choice_predicts_seeds_not_requests_per_second():
    from hybridgnn.scheduler.queueing import Simulator, best_bound

    gpu = DeviceCurves(curve(lambda x: 1e-3 + 1e-7 * x), curve(lambda x: 2e-3 + 2e-7 * x), 2)
    load = ServingLoad(request_seeds=8, frontend_cpu_s=0.0, cores=2)
    c = choose_for_slo({"gpu": gpu}, 0.030, 10.0, batching_wait_s=0.002, lo=10, hi=1e5, load=load)
    sim = Simulator(gpu.model(True), np.atleast_1d(10.0), load, batching_wait_s=0.002)
    ceiling = gpu.tail.max_psgs_within(0.030 - 0.002)
    rps = best_bound(sim, 0.030, min(sim.mean_request_psgs, ceiling), ceiling).requests_per_s
    assert c.predicted_seeds_per_s == pytest.approx(8 * rps)  # seeds/s: 8 seeds a request


def test_measured_service_ratios_are_used_as_measured():
    cpu = curve(lambda x: 1e-3 + 1e-6 * x)
    measured = np.array([0.5, 1.0, 3.0])
    np.testing.assert_array_equal(DeviceCurves(cpu, cpu, 1, ratios=measured).service_ratios(), measured)
    derived = DeviceCurves(cpu, curve(lambda x: 2 * (1e-3 + 1e-6 * x)), 1).service_ratios()
    assert np.quantile(derived, 0.99) == pytest.approx(2.0, rel=0.15)  # the tail's ratio to the mean, at p99


def test_a_named_policy_is_its_own_point_and_bounds_no_batch(tmp_path):
    from hybridgnn.scheduler.policy import Profile

    prof = Profile.load(DEMO_PROFILE)
    points = prof.points()
    for spec, key in (("latency", "latency_preferred"), ("throughput", "throughput_preferred"),
                      ("cpu", "cpu_preferred"), ("gpu", "gpu_preferred")):
        p = prof.policy(spec)
        assert p.psgs_threshold == points[key].psgs_threshold, spec
        assert math.isinf(p.max_batch_psgs) and p.pipeline_limits == {}
    assert len({points[k].psgs_threshold for k in ("cpu_preferred", "gpu_preferred")}) == 2  # told apart
    alone = Profile.load(_edited_profile(tmp_path, lambda d: d["pipelines"].pop("gpu")))
    with pytest.raises(ValueError, match=r"only \['cpu'\] is served: give --policy slo:<ms>"):
        alone.policy("latency")


def test_slo_mean_bounds_batches_by_the_mean_curve():
    from hybridgnn.scheduler.policy import Profile

    prof = Profile.load(DEMO_PROFILE)
    strict, loose = prof.policy("slo:30", load=ServingLoad(cores=2)), prof.policy("slo-mean:30", load=ServingLoad(cores=2))
    assert loose.predicted_seeds_per_s > strict.predicted_seeds_per_s


@pytest.mark.parametrize("edit, match", [
    (_set("bin_edges", [100, 100]), "bin_edges must be at least two increasing"),
    (_set("schema_version", 2), "profile schema_version 2; this build reads 1"),
    # an integer past int64 made an object array: a TypeError traceback choosing the policy
    (_set("pipelines", "cpu", "curves", "tail", "seconds", 0, 10**30), None),
    (_set("pipelines", "cpu", "curves", "mean", "psgs", -1, 10**400), "must be numbers"),  # OverflowError
    (_set("pipelines", "cpu", "curves", "mean", "seconds", 0, True), "must be numbers"),
])
def test_a_profile_of_another_schema_or_one_empty_bin_is_refused(tmp_path, edit, match):
    from hybridgnn.scheduler.policy import Profile

    if match is None:  # loaded, and a policy chosen from it
        Profile.load(_edited_profile(tmp_path, edit)).policy("slo:30", load=ServingLoad(cores=2))
        return
    with pytest.raises(ValueError, match=match):
        Profile.load(_edited_profile(tmp_path, edit))


def test_a_refit_replaces_only_bins_with_enough_live_samples():
    from hybridgnn.scheduler.policy import Profile

    prof = Profile.load(DEMO_PROFILE)
    before = prof.data["pipelines"]["cpu"]["bins"]
    x = float(before["psgs"][len(before["psgs"]) // 2])
    few = {"cpu": (np.full(19, x), np.full(19, 9.0))}  # 19 batches of 9 s in one bin
    assert prof.refit(few, min_bin_samples=20).data["pipelines"]["cpu"]["bins"] == before
    enough = {"cpu": (np.full(20, x), np.full(20, 9.0))}
    assert 9.0 in prof.refit(enough, min_bin_samples=20).data["pipelines"]["cpu"]["bins"]["mean_s"]
