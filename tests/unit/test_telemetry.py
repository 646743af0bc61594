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
