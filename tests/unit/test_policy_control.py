"""The --adapt control's decisions (scheduler/control.py): how far a step moves the
policy in force, what a profile must hold to be re-fitted, and when there is nothing to
re-fit from."""

import math
from pathlib import Path

import pytest

from hybridgnn.config import PipelineConfig, PolicyConfig, ServeConfig
from hybridgnn.scheduler.control import PolicyControl
from hybridgnn.scheduler.policy import Policy, Profile

DEMO_PROFILE = Path(__file__).parents[2] / "profiles" / "demo-sage-2core-epyc.json"


def _control(**policy) -> PolicyControl:
    cfg = ServeConfig(dataset_dir=Path("/nonexistent"), model_dir=Path("/nonexistent"),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"),
                      policy=PolicyConfig(profile=DEMO_PROFILE, policy="slo:30", adapt=True, **policy))
    control = PolicyControl(cfg, ("cpu", "gpu"))
    control.profile = Profile.load(DEMO_PROFILE)
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
