import pytest

from hybridgnn.config import RouterConfig
from hybridgnn.scheduler.router import Router
from hybridgnn.types import QueueLoad

IDLE = QueueLoad(depth=0, workers=2)
BUSY = QueueLoad(depth=10, workers=2)


def test_single_pipeline_takes_everything():
    r = Router(RouterConfig(psgs_threshold=5), ("cpu",))
    assert r.threshold == float("inf")
    plan = r.route(1e9, {"cpu": BUSY})
    assert (plan.pipeline, plan.reason, plan.batch_psgs) == ("cpu", "only", 1e9)


def test_threshold_splits_cpu_and_gpu():
    r = Router(RouterConfig(psgs_threshold=100), ("cpu", "gpu"))
    assert r.route(99.9, {"cpu": IDLE, "gpu": IDLE}).pipeline == "cpu"
    assert r.route(100, {"cpu": IDLE, "gpu": IDLE}).pipeline == "gpu"


def test_spill_only_when_other_has_slack():
    r = Router(RouterConfig(psgs_threshold=100), ("cpu", "gpu"))
    plan = r.route(10, {"cpu": BUSY, "gpu": IDLE})
    assert (plan.pipeline, plan.reason) == ("gpu", "spill")
    plan = r.route(10, {"cpu": BUSY, "gpu": BUSY})
    assert (plan.pipeline, plan.reason) == ("cpu", "threshold")


def test_fallback_and_errors():
    r = Router(RouterConfig(psgs_threshold=1), ("cpu", "gpu"))
    plan = r.route(5, {"cpu": IDLE, "gpu": IDLE})
    assert r.fallback(plan).pipeline == "cpu" and r.fallback(plan).reason == "fallback"
    with pytest.raises(LookupError):
        r.fallback(r.route(0, {"cpu": IDLE, "gpu": IDLE}))
    with pytest.raises(ValueError, match="unknown pipeline"):
        Router(RouterConfig(), ("tpu",))
    with pytest.raises(ValueError):
        r.set_threshold(-1)


def test_no_spill_beyond_what_the_other_pipeline_may_take():
    from types import SimpleNamespace

    r = Router(RouterConfig(psgs_threshold=1), ("cpu", "gpu"))
    r.apply_policy(SimpleNamespace(psgs_threshold=100.0, pipeline_limits={"cpu": 500.0}))  # an SLO policy's limits
    assert r.threshold == 100.0
    assert r.route(400, {"cpu": IDLE, "gpu": BUSY}).reason == "spill"
    plan = r.route(600, {"cpu": IDLE, "gpu": BUSY})
    assert (plan.pipeline, plan.reason) == ("gpu", "threshold")


def test_spill_off_keeps_every_batch_where_the_threshold_puts_it():
    r = Router(RouterConfig(psgs_threshold=0, spill=False), ("cpu", "gpu"))
    plan = r.route(10, {"cpu": IDLE, "gpu": BUSY})
    assert (plan.pipeline, plan.reason) == ("gpu", "threshold")


def test_a_split_cpu_lanes_device_work_counts_as_the_gpus_load():
    r = Router(RouterConfig(psgs_threshold=100.0), ("cpu", "gpu"))
    cpu_busy_on_device = QueueLoad(depth=10, workers=2, on_device=8)  # its batches wait for the GPU
    assert r.route(10.0, {"cpu": cpu_busy_on_device, "gpu": IDLE}).reason == "threshold"  # no spill onto it
    assert r.route(10.0, {"cpu": BUSY, "gpu": IDLE}).pipeline == "gpu"  # sampling backlog only: spill
    assert Router.device_load({"cpu": cpu_busy_on_device, "gpu": IDLE}) == QueueLoad(8, 2)


def test_a_queue_is_saturated_from_its_bound_per_worker_on():
    r = Router(RouterConfig(psgs_threshold=100, saturation_batches_per_worker=2.0), ("cpu", "gpu"))
    assert r.saturated(QueueLoad(depth=4, workers=2)) and not r.saturated(QueueLoad(depth=3, workers=2))
    assert not r.saturated(QueueLoad(depth=4, workers=4))  # the bound grows with the workers
    at_bound = {"cpu": QueueLoad(depth=4, workers=2), "gpu": QueueLoad(depth=3, workers=2)}
    assert r.route(10, at_bound).reason == "spill"  # the CPU is full at 4, the GPU not yet at 3
    assert r.route(10, {**at_bound, "gpu": QueueLoad(depth=4, workers=2)}).reason == "threshold"


def test_a_batch_of_exactly_the_other_pipelines_limit_spills():
    from types import SimpleNamespace

    r = Router(RouterConfig(), ("cpu", "gpu"))
    r.apply_policy(SimpleNamespace(psgs_threshold=100.0, pipeline_limits={"cpu": 500.0}))
    assert r.route(500, {"cpu": IDLE, "gpu": BUSY}).reason == "spill"


def test_a_threshold_that_is_not_a_number_and_a_router_of_nothing_are_refused():
    r = Router(RouterConfig(psgs_threshold=100), ("cpu", "gpu"))
    with pytest.raises(ValueError, match="psgs threshold"):
        r.set_threshold(float("nan"))  # NaN compares false: every batch went to the GPU
    assert r.threshold == 100
    with pytest.raises(ValueError, match="at least one pipeline"):
        Router(RouterConfig(), ())


def test_a_gpu_only_router_has_no_fallback():
    r = Router(RouterConfig(), ("gpu",))
    with pytest.raises(LookupError, match="no fallback pipeline for 'gpu'"):
        r.fallback(r.route(5, {"gpu": IDLE}))
