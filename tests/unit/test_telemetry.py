from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.telemetry.metrics import Telemetry
from hybridgnn.types import StageTimings


def test_metrics_are_isolated_per_registry_and_named_by_convention():
    a, b = Telemetry(), Telemetry()  # two registries never collide
    a.batch_done("cpu", StageTimings(0.001, 0.002, 0.003, 0.004), num_seeds=10, num_requests=2, psgs=120.0,
                 sampled_edges=50)
    a.answered(200, seeds=10)
    a.answered(400)
    fams = {f.name: f for f in text_string_to_metric_families(a.exposition()[0].decode())}
    assert all(name.startswith("hybridgnn_") for name in fams)
    sample = [s for s in fams["hybridgnn_stage_seconds"].samples
              if s.name.endswith("_count") and s.labels["stage"] == "compute"]
    assert sample[0].value == 1 and sample[0].labels["pipeline"] == "cpu"
    codes = {s.labels["code"]: s.value for s in fams["hybridgnn_requests"].samples if s.name.endswith("_total")}
    assert codes == {"200": 1.0, "400": 1.0}
    assert "hybridgnn_requests" not in {f.name for f in text_string_to_metric_families(b.exposition()[0].decode())
                                        if any(s.value for s in f.samples)}


def test_an_unloaded_model_versions_series_are_dropped_and_come_back_fresh():
    # a repository server that polls new versions for months exposed (and kept) the series
    # of every version it ever served
    t = Telemetry(model="m")

    def versions(metric: str) -> dict:
        text = t.exposition()[0].decode()
        return {(s.labels.get("model"), s.labels.get("version")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples if s.name == metric}

    one, two = t.for_model("m", "1"), t.for_model("m", "2")
    for view in (one, two):
        view.answered(200, seeds=3)
        view.stage("total", "cpu", 0.01)
    assert set(versions("hybridgnn_seeds_total")) == {("m", "1"), ("m", "2")}
    t.forget_model("m", "2")
    for metric in ("hybridgnn_seeds_total", "hybridgnn_requests_total", "hybridgnn_stage_seconds_count"):
        assert ("m", "2") not in versions(metric) and ("m", "1") in versions(metric), metric
    again = t.for_model("m", "2")  # loaded again: new series, counted from zero
    again.answered(200, seeds=5)
    assert versions("hybridgnn_seeds_total") == {("m", "1"): 3.0, ("m", "2"): 5.0}


def test_the_quick_stages_are_resolved_by_the_latency_buckets():
    # a respond stage takes 20-40 µs and an idle server's batching and queue_wait stages
    # under 50 µs; with 50 µs as the lowest bound nine in ten respond observations fell in
    # one bucket, and a p50 of them read nothing but that bucket's interpolation
    t = Telemetry()
    for seconds in (8e-6, 20e-6, 40e-6):
        t.stage("respond", "cpu", seconds)
    text = t.exposition()[0].decode()
    buckets = [(float(s.labels["le"]), s.value) for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "hybridgnn_stage_seconds_bucket" and s.labels["stage"] == "respond"]
    filled = sorted({next(le for le, count in sorted(buckets) if count >= n) for n in (1, 2, 3)})
    assert len(filled) == 3, f"8, 20 and 40 µs share buckets: {filled}"


def test_readiness_is_the_services_once_it_says_not_every_watched_engines():
    """A model repository watches every engine it built: one loading in the background or a
    retired one draining is not ready while the server serves on. The gauge follows the
    service's ready() (/v2/health/ready), before and after more engines are watched."""
    from hybridgnn.types import EngineSnapshot

    t = Telemetry()

    def snap(ready):
        return lambda: EngineSnapshot(pending=0, pending_capacity=8, ready=ready, queue_depths={"cpu": 0},
                                      psgs_threshold=0.0, max_batch_psgs=1.0, policy="latency")

    def ready_gauge():
        return t.registry.get_sample_value("hybridgnn_ready")

    t.watch(snap(True), ("cpu",))
    assert ready_gauge() == 1.0
    t.for_model("m", "2").watch(snap(False), ("cpu",))  # a version still loading
    assert ready_gauge() == 0.0
    serving = [True]
    t.ready_from(lambda: serving[0])
    assert ready_gauge() == 1.0
    t.for_model("m", "3").watch(snap(False), ("cpu",))  # another, after
    assert ready_gauge() == 1.0
    serving[0] = False  # draining
    assert ready_gauge() == 0.0


def test_the_engine_process_exports_its_own_cpu_and_memory():
    """Read at each scrape: CPU time only grows, and memory is this process's resident set."""
    import re

    from hybridgnn.telemetry import Telemetry

    t = Telemetry()

    def read() -> tuple[float, float]:
        text = t.exposition()[0].decode()
        cpu = float(re.search(r"^hybridgnn_engine_cpu_seconds_total (\S+)$", text, re.M).group(1))
        rss = float(re.search(r"^hybridgnn_engine_resident_memory_bytes (\S+)$", text, re.M).group(1))
        return cpu, rss

    cpu0, rss0 = read()
    held = bytearray(64 << 20)  # touched: resident
    sum(range(200_000))
    cpu1, rss1 = read()
    assert 0 < cpu0 <= cpu1 and rss1 >= rss0 + (48 << 20), (cpu0, cpu1, rss0, rss1)
    del held
