"""The --adapt control's decisions (scheduler/control.py): how far a step moves the
policy in force, what a profile must hold to be re-fitted, and when there is nothing to
re-fit from."""

import dataclasses
import math
from pathlib import Path

import pytest

from hybridgnn.config import PipelineConfig, PolicyConfig, ServeConfig
from hybridgnn.scheduler.control import PolicyControl
from hybridgnn.scheduler.policy import Policy, Profile

DEMO_PROFILE = Path(__file__).parents[2] / "profiles" / "demo-sage-2core-epyc.json"


def _control(profile: Path = DEMO_PROFILE, policy: str = "slo:30", adapt: bool = True, **kw) -> PolicyControl:
    """A control whose profile is loaded (load() replaces it, as serve does)."""
    cfg = ServeConfig(dataset_dir=Path("/nonexistent"), model_dir=Path("/nonexistent"),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"),
                      policy=PolicyConfig(profile=profile, policy=policy, adapt=adapt, **kw))
    control = PolicyControl(cfg, ("cpu", "gpu"))
    control.profile = Profile.load(profile)
    return control


def _policy(threshold: float, bound: float = 1000.0) -> Policy:
    return Policy("slo:30", threshold, bound, {"cpu": bound, "gpu": bound}, None, None)


LO, HI = 28.8528, 62464.0  # the demo profile's smallest and largest bin edges


@pytest.mark.parametrize("current, target, expected", [
    (100.0, 400.0, 200.0),
    (100.0, 10.0, 50.0),
    (100.0, math.inf, 200.0),  # was inf: all on the CPU in one step
    (100.0, 0.0, 50.0),
    (100.0, math.nan, None),  # was NaN: every batch to the GPU (NaN compares false)
    (100.0, -5.0, None),
    (math.inf, 100.0, HI / 2),  # was 100: a step of any size
    (math.inf, 0.0, HI / 2),
    (math.inf, 1e6, 1e6),  # from inf, never past the target
    (0.0, 1000.0, LO * 2),  # was 1000
    (0.0, math.inf, LO * 2),  # was inf
    (0.0, 10.0, 10.0),
    (math.inf, math.inf, None),
    (0.0, 0.0, None),
])
def test_an_adapt_step_moves_the_threshold_by_at_most_the_max_step_and_never_to_nan_or_inf(current, target,
                                                                                           expected):
    control = _control()
    control.policy = _policy(current)
    step = control.step_towards(_policy(target))
    if expected is None:
        assert step is None
    else:
        assert step.psgs_threshold == pytest.approx(expected, rel=1e-4)


def test_steps_towards_all_cpu_or_all_gpu_stay_finite_and_bounded():
    control = _control(adapt_max_step=1.5)
    for target in (math.inf, 0.0, math.nan):
        control.policy = _policy(100.0)
        for _ in range(200):
            step = control.step_towards(_policy(target, bound=target))
            if step is None:
                break
            for new, old in ((step.psgs_threshold, control.policy.psgs_threshold),
                             (step.max_batch_psgs, control.policy.max_batch_psgs)):
                assert math.isfinite(new) and new >= 0
                assert old / 1.5 - 1e-9 <= new <= old * 1.5 + 1e-9
            control.policy = step


def test_each_pipelines_batch_bound_steps_as_the_others_do():
    """The pipelines' bounds jumped to the target's in one step, however far."""
    control = _control()
    control.policy = Policy("slo:30", 100.0, 1000.0, {"cpu": 1000.0, "gpu": 1000.0}, None, None)
    step = control.step_towards(Policy("slo:30", 100.0, 1000.0, {"cpu": 1e6, "gpu": 10.0}, None, None))
    assert step.pipeline_limits == pytest.approx({"cpu": 2000.0, "gpu": 500.0})
    assert step.psgs_threshold == 100.0 and step.max_batch_psgs == 1000.0


def _edited(tmp_path, edit) -> Path:
    import json

    data = json.loads(DEMO_PROFILE.read_text())
    edit(data["pipelines"]["cpu"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


BROKEN_BINS = [
    lambda p: p.pop("bins"),  # KeyError at every step
    lambda p: p.__setitem__("bins", "x"),  # AttributeError
    lambda p: p["bins"].__setitem__("count", [1]),  # IndexError
    lambda p: p["bins"].__setitem__("psgs", p["bins"]["psgs"][::-1]),  # knots must increase
    lambda p: p["bins"]["mean_s"].__setitem__(0, 0.0),  # a zero latency
]


@pytest.mark.parametrize("edit", BROKEN_BINS, ids=["no bins", "not an object", "counts cut short", "decreasing", "zero"])
def test_serve_with_adapt_refuses_a_profile_it_cannot_refit_in_one_line(tmp_path, monkeypatch, edit):
    """The bins every --adapt step re-fits from are checked at load: a profile lacking
    them served, and then logged a traceback (or a warning) every interval."""
    from hybridgnn.errors import ConfigError

    monkeypatch.setattr(Profile, "check_matches", lambda *a: None)
    path = _edited(tmp_path, edit)
    control = _control(path)
    with pytest.raises(ConfigError, match=r"cannot be re-fitted for --adapt") as info:
        control.load("fingerprint")
    assert "\n" not in str(info.value)
    # without --adapt the bins are not read: the same profile serves
    assert _control(path, "latency", adapt=False).load("fingerprint").psgs_threshold >= 0


def test_serve_with_adapt_loads_a_profile_hybridgnn_profile_wrote(monkeypatch):
    monkeypatch.setattr(Profile, "check_matches", lambda *a: None)
    assert _control().load("fingerprint").name == "slo:30"


def test_a_profile_of_other_pipelines_is_served_with_a_warning_naming_them(monkeypatch, caplog):
    """A profile made with --workers 2 served with --workers 8 predicted for 2, silently."""
    monkeypatch.setattr(Profile, "check_matches", lambda *a: None)
    with caplog.at_level("WARNING", logger="hybridgnn.scheduler.control"):
        _control(policy="latency", adapt=False).load("fingerprint")
    assert not caplog.records  # the demo profile's own pipelines: nothing to say
    cfg = ServeConfig(dataset_dir=Path("/nonexistent"), model_dir=Path("/nonexistent"),
                      cpu_pipeline=PipelineConfig(workers=8, processes=True),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"),
                      policy=PolicyConfig(profile=DEMO_PROFILE, policy="latency"))
    with caplog.at_level("WARNING", logger="hybridgnn.scheduler.control"):
        PolicyControl(cfg, ("cpu", "gpu")).load("fingerprint")
    [record] = caplog.records
    assert "cpu workers 2, serving 8; cpu processes False, serving True" in record.getMessage()


def test_adapt_keeps_the_policy_while_no_request_comes():
    """Batches recorded under 1,000 requests/s (their service stretched by the front end),
    then no traffic: the next steps have nothing new to re-fit from. They re-read the same
    batches at a rate of 0, as if unstretched, and moved the policy on no news."""
    import time

    import numpy as np

    from hybridgnn.scheduler.queueing import ServingLoad

    control = _control(adapt_min_batches=50)
    prof, pc = control.profile, control.cfg.policy
    control.policy = prof.policy("slo:30", batching_wait_s=control.cfg.batcher.max_wait_s,
                                 load=ServingLoad.from_policy(pc))
    edges = prof.data["bin_edges"]
    xs = np.exp(np.random.default_rng(0).uniform(np.log(edges[0]), np.log(edges[-1]), 400))
    for name, dev in prof.devices.items():
        stretch = dev.model().stretch(1000.0, ServingLoad.from_policy(pc))
        ratios = dev.service_ratios()
        for i, x in enumerate(xs):
            control.record(name, float(x), stretch * float(dev.mean(x)) * float(ratios[i % len(ratios)]))
    control._adapt_mark = (time.perf_counter() - 1.0, 0, 0)
    for _ in range(1000):
        control.count_admitted(8)
    assert control.adapt_inputs() is not None  # a busy second: re-fit from it
    for _ in range(3):  # then nothing comes
        assert control.adapt_inputs() is None
        assert control.adapt_once() is None


def test_requests_of_no_seeds_among_the_admitted_do_not_end_the_adapt_loop():
    """A mean below one seed a request (new-node requests count none) was refused by the
    serving load, outside the loop's error handling: the loop ended unlogged."""
    import time

    control = _control(adapt_min_batches=1)
    for name in control.profile.devices:
        control.record(name, 10.0, 0.001)
    control._adapt_mark = (time.perf_counter() - 1.0, 0, 0)
    control.count_admitted(1)
    for _ in range(3):
        control.count_admitted(0)
    inputs = control.adapt_inputs()
    assert inputs is not None and inputs[-1].request_seeds == 1.0


def test_each_windows_batches_have_their_own_request_rates_stretch_divided_out():
    """Every recorded batch was divided by the latest window's stretch: batches from a busy
    window (slower for the front end's share of the cores) read as a slower pipeline once
    a quiet window followed."""
    import time

    import numpy as np

    from hybridgnn.scheduler.queueing import ServingLoad

    control = _control(adapt_min_batches=10)
    load = ServingLoad.from_policy(control.cfg.policy)
    name = "cpu"
    dev = control.profile.devices[name]
    xs = np.geomspace(100.0, 10_000.0, 20)

    def window(rps: float, requests: int) -> float:
        stretch = dev.model().stretch(rps, load)
        for x in xs:  # batches as they ran: the profile's mean, stretched at this rate
            control.record(name, float(x), stretch * float(dev.mean(x)))
        control._adapt_mark = (time.perf_counter() - requests / rps, *control.admitted)
        for _ in range(requests):
            control.count_admitted(8)
        return stretch

    busy = window(1200.0, 1200)
    assert busy > 2  # the busy window's batches ran more than twice as long
    control.adapt_inputs()
    window(5.0, 5)  # then a quiet one
    psgs, seconds = control.adapt_inputs()[2][name]
    np.testing.assert_allclose(seconds, np.tile(dev.mean(xs), 2), rtol=0.02)  # both: as profiled


def _recorded(control, n: int, seconds_of) -> None:
    """n batches per pipeline across the profile's PSGS range, then a window of requests."""
    import time

    import numpy as np

    edges = control.profile.data["bin_edges"]
    xs = np.geomspace(edges[0], edges[-1], n)
    for name, dev in control.profile.devices.items():
        for x in xs:
            control.record(name, float(x), seconds_of(dev, float(x)))
    control._adapt_mark = (time.perf_counter() - 1.0, 0, 0)
    for _ in range(10):
        control.count_admitted(8)


def test_adapt_waits_for_its_minimum_of_batches_and_never_scales_live_times_again():
    control = _control(adapt_min_batches=30, service_scale=3.0)
    _recorded(control, 29, lambda dev, x: float(dev.mean(x)))
    assert control.adapt_inputs() is None  # 29 of the 30 it needs
    _recorded(control, 1, lambda dev, x: float(dev.mean(x)))
    inputs = control.adapt_inputs()
    assert inputs is not None and {len(s[0]) for s in inputs[2].values()} == {30}
    assert inputs[-1].service_scale == 1.0  # live times already carry the drift --service-scale stood for


def test_a_stretch_past_what_the_front_end_can_serve_leaves_live_times_as_they_ran(monkeypatch):
    """At a rate where the model says the front end takes every core (stretch inf), the
    batches were divided by inf: re-fitted as taking no time at all."""
    from hybridgnn.scheduler.queueing import PipelineModel

    control = _control(adapt_min_batches=5)
    monkeypatch.setattr(PipelineModel, "stretch", lambda self, rps, load: math.inf)
    _recorded(control, 5, lambda dev, x: 0.01)
    samples = control.adapt_inputs()[2]
    assert {float(s) for _, secs in samples.values() for s in secs} == {0.01}


def test_the_service_stretch_of_batches_that_ran_as_profiled_is_one():
    """Live over profiled, both as medians of time ÷ the mean curve: batches that run at the
    profile's own spread read as 1, not as that spread."""
    import numpy as np

    control = _control()
    for name, dev in control.profile.devices.items():
        ratios = dev.service_ratios()
        for i, x in enumerate(np.geomspace(50.0, 50_000.0, len(ratios))):
            control.record(name, float(x), float(dev.mean(x)) * float(ratios[i]))
    stretch = control.service_stretch(last=10_000)
    assert set(stretch) == {"cpu", "gpu"}
    for name, dev in control.profile.devices.items():
        assert abs(float(np.median(dev.service_ratios())) - 1) > 0.01  # so the division is seen
        assert stretch[name] == pytest.approx(1.0, abs=0.01)


def test_a_profile_that_does_not_name_its_threads_measured_one_thread_a_worker(monkeypatch, tmp_path, caplog):
    import json

    monkeypatch.setattr(Profile, "check_matches", lambda *a: None)
    data = json.loads(DEMO_PROFILE.read_text())
    for p in data["pipelines"].values():
        p.pop("torch_threads")
    path = tmp_path / "older.json"
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="hybridgnn.scheduler.control"):
        _control(path, policy="latency", adapt=False).load("fingerprint")
    assert not caplog.records


def test_an_operating_point_on_a_cpu_only_server_says_it_is_the_default_and_what_to_give(monkeypatch):
    """`serve --profile P` on a CPU-only server said "policy 'latency' with profile P: policy
    'latency' picks a point between the CPU and GPU pipelines, ... (use slo:<ms>)": a policy
    the user never gave, named twice, and no flag to give instead."""
    from hybridgnn.errors import ConfigError

    monkeypatch.setattr(Profile, "check_matches", lambda *args, **kwargs: None)
    cfg = ServeConfig(dataset_dir=Path("/nonexistent"), model_dir=Path("/nonexistent"),
                      policy=PolicyConfig(profile=DEMO_PROFILE))
    with pytest.raises(ConfigError) as info:
        PolicyControl(cfg, ("cpu",)).load("any")
    said = str(info.value)
    assert f"profile {DEMO_PROFILE}: policy 'latency' (the default) picks a point between" in said
    assert said.count("latency") == 1 and "only ['cpu'] is served" in said and "--policy slo:<ms>" in said
    cfg = dataclasses.replace(cfg, policy=PolicyConfig(profile=DEMO_PROFILE, policy="throughput"))
    with pytest.raises(ConfigError, match=r"policy 'throughput' picks a point"):
        PolicyControl(cfg, ("cpu",)).load("any")
