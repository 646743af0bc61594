import dataclasses

import pytest

from hybridgnn.config import (
    BatcherConfig,
    PipelineConfig,
    RouterConfig,
    SamplingConfig,
    ServerConfig,
    env_default,
    parse_cpus,
    parse_fanouts,
)


def test_parse_fanouts():
    assert parse_fanouts("15,10,5") == (15, 10, 5)
    assert parse_fanouts([3, 2]) == (3, 2)
    with pytest.raises(ValueError, match="positive"):
        parse_fanouts("3,0")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_fanouts("a,b")
    with pytest.raises(ValueError, match="at least one hop"):
        parse_fanouts("")


def test_parse_cpus():
    assert parse_cpus("1") == (1,)
    assert parse_cpus("3,0-1") == (0, 1, 3)
    assert parse_cpus(" 2 - 4 , 2") == (2, 3, 4)
    assert parse_cpus("") == () and parse_cpus([2, 1, 2]) == (1, 2)
    for bad in ("a", "1-", "3-1", "-2", "1.5", "0-100000000", "4096"):
        with pytest.raises(ValueError, match="cores must be"):
            parse_cpus(bad)


def test_worker_cores_pin_processes_only():
    assert PipelineConfig(processes=True, cpus=(1, 3)).cpus == (1, 3)
    with pytest.raises(ValueError, match="need --worker-processes"):
        PipelineConfig(cpus=(1,))
    with pytest.raises(ValueError, match="distinct core numbers"):
        PipelineConfig(processes=True, cpus=(1, 1))
    with pytest.raises(ValueError, match="distinct core numbers"):
        PipelineConfig(processes=True, cpus=(-1,))


@pytest.mark.parametrize("make, match", [
    (lambda: SamplingConfig(fanouts=(5, -1)), "positive"),
    (lambda: BatcherConfig(max_batch_seeds=0), "max_batch_seeds"),
    (lambda: BatcherConfig(max_wait_s=-1), "max_wait_s"),
    (lambda: BatcherConfig(max_pending_requests=0), "max_pending_requests"),
    (lambda: PipelineConfig(workers=0), "workers"),
    (lambda: RouterConfig(psgs_threshold=-1), "psgs_threshold"),
    (lambda: ServerConfig(port=70000), "port"),
    (lambda: ServerConfig(model_name="a/b"), "model_name"),
])
def test_bad_values_are_quoted(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_defaults_are_valid_and_frozen():
    cfg = RouterConfig()
    assert cfg.psgs_threshold is None  # +inf without a GPU pipeline; with one, the PSGS of 64 average seeds
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.psgs_threshold = 3  # frozen


def test_env_default(monkeypatch):
    monkeypatch.setenv("HYBRIDGNN_PORT", "9123")
    assert env_default("PORT", 8000, int) == 9123
    monkeypatch.setenv("HYBRIDGNN_PORT", "x")
    with pytest.raises(ValueError, match="HYBRIDGNN_PORT"):
        env_default("PORT", 8000, int)
    assert env_default("NOT_SET_ANYWHERE", 5, int) == 5
