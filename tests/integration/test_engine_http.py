"""The engine and its HTTP server in process: failure paths that are awkward to provoke in
a subprocess, and the API's answers through the HTTP server."""

import asyncio

import numpy as np
import pytest

from hybridgnn.config import BatcherConfig, SamplingConfig, ServeConfig
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.serving.core.engine import Engine
from tests.support.engine_client import body, with_client


def test_http_answers_and_errors(tiny_dataset, tiny_model):
    """Statuses, JSON messages and headers of the API through the HTTP server."""
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    async def scenario(engine, client):
        seen = []
        for method, path, kwargs in [
            ("GET", "/v2/health/ready", {}),
            ("GET", "/v2/models", {}),
            ("GET", "/v2/models/hybridgnn/versions/1/ready", {}),
            ("GET", "/v2/models/other", {}),
            ("GET", "/v2/nothing", {}),
            ("DELETE", "/v2/models/hybridgnn/infer", {}),
            ("POST", "/v2/models/hybridgnn/ready", {}),
            ("POST", "/v2/models/hybridgnn/infer", {"data": b"{not json"}),
            ("POST", "/v2/models/hybridgnn/infer", {"json": body([-1])}),
            ("POST", "/v2/models/hybridgnn/infer", {"data": b"x" * (cfg.server.max_body_bytes + 1)}),
            ("POST", "/v2/models/hybridgnn/graph", {"json": {}}),
        ]:
            resp = await client.request(method, path, **kwargs)
            seen.append((resp.status, await resp.json(), resp.headers.get("Allow")))
        ok = await client.post("/v2/models/hybridgnn/infer", json=body([1, 2]))
        assert ok.status == 200 and ok.content_type == "application/json"
        head = await client.head("/v2/health/live")
        assert head.status == 200 and await head.read() == b""
        return seen

    seen = asyncio.run(with_client(cfg, scenario))
    statuses = [s for s, _, _ in seen]
    assert statuses == [200, 200, 200, 404, 404, 405, 405, 400, 400, 413, 403]
    assert seen[4][1] == {"error": "no such endpoint: GET /v2/nothing"}
    assert seen[5][2] == "POST" and seen[6][2] == "GET, HEAD"
    assert "unknown model 'other'" in seen[3][1]["error"]
    assert "not valid JSON" in seen[7][1]["error"] and ">= 0" in seen[8][1]["error"]
    assert "limit 16777216 bytes" in seen[9][1]["error"]
    assert "disabled" in seen[10][1]["error"]



def test_a_failing_batch_answers_500_and_the_server_lives_on(tiny_dataset, tiny_model, monkeypatch):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))
    real_run = BatchExecutor.run
    calls = {"n": 0}

    def flaky(self, seeds, timings=None):
        calls["n"] += 1
        if seeds.size == 3:  # the poisoned request
            raise RuntimeError("simulated kernel failure")
        return real_run(self, seeds, timings)

    async def scenario(engine, client):
        monkeypatch.setattr(BatchExecutor, "run", flaky)
        bad = await client.post("/v2/models/hybridgnn/infer", json=body([1, 2, 3]))
        assert bad.status == 500
        assert "simulated kernel failure" in (await bad.json())["error"]
        good = await client.post("/v2/models/hybridgnn/infer", json=body([1, 2]))
        assert good.status == 200
        assert engine.pending == 0
        metrics = await (await client.get("/metrics")).text()
        assert 'hybridgnn_batch_errors_total{pipeline="cpu"} 1.0' in metrics

    asyncio.run(with_client(cfg, scenario))


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(tiny_dataset, tiny_model):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      batcher=BatcherConfig(max_wait_s=0.02))

    async def scenario(engine, client):
        rng = np.random.default_rng(0)
        requests = [rng.integers(0, 3000, size=int(rng.integers(1, 6))).tolist() for _ in range(40)]
        responses = await asyncio.gather(*(client.post("/v2/models/hybridgnn/infer", json=body(r))
                                           for r in requests))
        for ids, resp in zip(requests, responses, strict=True):
            assert resp.status == 200
            out = {o["name"]: o for o in (await resp.json())["outputs"]}
            assert out["predictions"]["shape"] == [len(ids)]
        metrics = await (await client.get("/metrics")).text()
        count = [line for line in metrics.splitlines() if line.startswith("hybridgnn_batch_requests_count")]
        assert float(count[0].split()[-1]) < 40  # fewer batches than requests: they were merged

    asyncio.run(with_client(cfg, scenario))


def test_mismatched_model_and_dataset_are_refused(tiny_dataset, tiny_model, tmp_path):

    from hybridgnn.errors import ConfigError
    from hybridgnn.graph.generate import generate_csbm

    generate_csbm(tmp_path / "other", num_nodes=200, feature_dim=7, seed=0)
    with pytest.raises(ConfigError, match="expects 16-dim features"):
        Engine(ServeConfig(dataset_dir=tmp_path / "other", model_dir=tiny_model))
    with pytest.raises(ConfigError, match="one fanout per layer"):
        Engine(ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5,))))


def test_fanouts_past_the_models_layers_are_not_sampled(tiny_dataset, tiny_model, caplog):
    """A hop past the last layer cannot change an answer; it was sampled for nothing."""
    import logging

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3, 2)))

    async def scenario(engine, client):
        r = await client.post("/v2/models/hybridgnn/infer", json=body([1, 2]))
        return r.status, tuple(engine.cfg.sampling.fanouts)

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(with_client(cfg, scenario)) == (200, (5, 3))
    assert any("give 3 hops but the model has 2 layers; sampling the first 2" in r.getMessage()
               for r in caplog.records)


def test_precomputed_mode_without_embeddings_is_a_clear_4xx(tiny_dataset, tiny_model):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    async def scenario(engine, client):
        r = await client.post("/v2/models/hybridgnn/infer", json={**body([1]), "parameters": {"mode": "precomputed"}})
        assert r.status == 409
        assert "hybridgnn precompute" in (await r.json())["error"]
        new = {"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16},
                          {"name": "edge_index", "shape": [2, 1], "datatype": "INT64", "data": [3000, 1]}]}
        r = await client.post("/v2/models/hybridgnn/infer", json=new)
        assert r.status == 409 and "precomputed embeddings" in (await r.json())["error"]
        r = await client.post("/v2/models/hybridgnn/infer", json={**new, "parameters": {"mode": "sampled"}})
        assert r.status == 200  # sampling needs no stored embeddings
        assert engine.pending == 0

    asyncio.run(with_client(cfg, scenario))


def test_a_plain_request_is_refused_before_decoding_when_the_lane_is_past_its_bound(tiny_dataset, tiny_model):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    async def scenario(engine, client):
        lane = engine._admission.lanes["sampled"]
        for _ in range(10):
            lane.observe(1.0, 10.0)  # 10 s per unit of work: anything queued is past the bound
        lane.add(1.0)
        try:
            # an id no graph has: a 429 shows it was refused before its tensor was decoded
            # (and validated); a body that is not JSON is still a 400 (its header is read first)
            r = await client.post("/v2/models/hybridgnn/infer", json=body([10**12]))
            assert r.status == 429 and "Retry-After" in r.headers
            assert "queueing delay" in (await r.json())["error"]
            r = await client.post("/v2/models/hybridgnn/infer", data=b'{"inputs": [{"name": "node_ids", ')
            assert r.status == 400
            # a request naming a mode takes the full path, which validates it first
            r = await client.post("/v2/models/hybridgnn/infer", data=b'{"parameters": {"mode": "precomputed"}, ')
            assert r.status == 400
        finally:
            lane.remove(1.0)
        assert (await client.post("/v2/models/hybridgnn/infer", json=body([1, 2]))).status == 200

    asyncio.run(with_client(cfg, scenario))


def test_pipelined_requests_are_not_refused_for_waiting_behind_their_own_connection(tiny_dataset, tiny_model):
    """HTTP/1.1 answers a connection's requests in order, so a pipelined request waits for
    the ones before it. That wait is the client's doing, not the server's load: 60
    requests pipelined on one connection to an idle server with a 20 ms bound are all
    answered (counted from the first byte, the last ones waited far past the bound)."""
    import json

    from hybridgnn.config import AdmissionConfig

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      admission=AdmissionConfig(max_queue_delay_s=0.02))

    async def scenario(engine, client):
        reader, writer = await asyncio.open_connection("127.0.0.1", client._base_url.port)
        payloads = [json.dumps(body([i, i + 1])).encode() for i in range(60)]
        writer.write(b"".join(b"POST /v2/models/hybridgnn/infer HTTP/1.1\r\nHost: t\r\nContent-Type: "
                              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(p), p) for p in payloads))
        await writer.drain()
        statuses = []
        for _ in payloads:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                         .split(b":")[1])
            await reader.readexactly(length)
            statuses.append(int(head[9:12]))
        writer.close()
        assert statuses == [200] * 60

    asyncio.run(with_client(cfg, scenario))
