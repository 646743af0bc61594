"""Heterogeneous models served for real: node outputs and link scores over HTTP equal
plain PyG's whole-graph forward (fanouts >= the largest degree) for to_hetero(GraphSAGE)
and a HeteroConv model on a two-type and a three-type graph; both pipelines (the GPU
pipeline's code on CPU tensors); `hybridgnn serve` with tritonclient over HTTP and gRPC,
and the errors a client gets for what it gets wrong."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridgnn
from hybridgnn.config import PipelineConfig, RouterConfig, ServeConfig
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from tests.support.engine_client import with_client
from tests.support.hetero import HeteroSAGE, built, sage, whole
from tests.support.server import ServerProcess, free_port

pytestmark = pytest.mark.filterwarnings("ignore:There exist node types")
FULL = [1000, 1000]  # above every degree: samples hold whole neighbourhoods


def _models(graph):
    yield "to_hetero(GraphSAGE)", sage(graph)
    yield "HeteroConv", HeteroSAGE(graph.metadata(), graph.node_types, out_channels=8)


@pytest.fixture(scope="module", params=["recsys", "academic"])
def served(request, tmp_path_factory):
    """(graph, [(name, model dir, PyG's whole-graph outputs)]) for one schema."""
    root = tmp_path_factory.mktemp(f"hs-{request.param}")
    graph = HeteroGraphStore.open(generate_hetero(root / "g", kind=request.param, num_nodes=240, avg_degree=5,
                                                  seed=3))
    x, ei = whole(graph)
    out = []
    for i, (name, model) in enumerate(_models(graph)):
        model = built(model, graph, seed=i)
        with torch.no_grad():
            want = model(x, ei)
        path = hybridgnn.save_model(model, root / f"m{i}", metadata=graph.metadata(), fanouts=FULL,
                                    link_decoder="dot")
        out.append((name, path, want))
    return graph, root / "g", out


def _node(ntype, ids):
    return {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": list(map(int, ids))}],
            "parameters": {"node_type": ntype}, "outputs": [{"name": "logits"}]}


def _pair(s, d, src, dst):
    return {"inputs": [{"name": "src_ids", "datatype": "INT64", "shape": [len(src)], "data": list(map(int, src))},
                       {"name": "dst_ids", "datatype": "INT64", "shape": [len(dst)], "data": list(map(int, dst))}],
            "parameters": {"src_type": s, "dst_type": d}}


async def _post(client, body):
    r = await client.post("/v2/models/hybridgnn/infer", json=body)
    return r.status, await r.json()


def _config(dataset, model, **kw) -> ServeConfig:
    return ServeConfig(dataset_dir=dataset, model_dir=model, cpu_pipeline=PipelineConfig(workers=2), **kw)


def test_served_outputs_and_scores_equal_pyg_on_the_whole_graph(served):
    graph, dataset, models = served
    rng = np.random.default_rng(0)

    for name, path, want in models:
        async def check(engine, client, want=want, name=name):
            meta = (await (await client.get("/v2/models/hybridgnn")).json())["parameters"]
            assert [t["name"] for t in meta["node_types"]] == graph.node_types
            assert meta["edge_types"] == [list(e) for e in graph.edge_types] and meta["link_decoder"] == "dot"
            bodies, expected = [], []
            for t in want:  # every output type, all its nodes over a few requests sent at once
                for chunk in np.array_split(np.arange(graph.num_nodes(t)), 4):
                    bodies.append(_node(t, chunk))
                    expected.append(want[t][chunk])
            for s, d in meta["link_types"]:
                src, dst = rng.integers(0, graph.num_nodes(s), 40), rng.integers(0, graph.num_nodes(d), 40)
                bodies.append(_pair(s, d, src, dst))
                expected.append((want[s][src] * want[d][dst]).sum(-1))
            answers = await asyncio.gather(*(_post(client, b) for b in bodies))
            for (status, j), exp in zip(answers, expected, strict=True):
                assert status == 200, j
                got = torch.tensor(j["outputs"][0]["data"]).reshape(exp.shape)
                torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5, msg=name)

        asyncio.run(with_client(_config(dataset, path), check))


def test_fanouts_past_the_models_layers_are_not_sampled(served, caplog):
    """A hop past the last layer cannot change an answer: it is cut (with a warning), and
    the answers stay PyG's whole-graph ones."""
    import logging

    from hybridgnn.config import SamplingConfig

    graph, dataset, models = served
    _, path, want = models[0]
    t = graph.node_types[0]
    ids = np.arange(0, graph.num_nodes(t), 7)

    async def check(engine, client):
        status, j = await _post(client, _node(t, ids))
        assert status == 200, j
        torch.testing.assert_close(torch.tensor(j["outputs"][0]["data"]).reshape(len(ids), -1), want[t][ids],
                                   atol=1e-5, rtol=1e-5)
        return {len(f) for f in engine.fanouts.values()}

    with caplog.at_level(logging.WARNING):
        hops = asyncio.run(with_client(_config(dataset, path, sampling=SamplingConfig((1000, 1000, 1000))), check))
    assert hops == {2}
    assert any("give 3 hops but the model has 2 layers" in r.getMessage() for r in caplog.records)


def test_both_pipelines_route_by_typed_psgs_and_answer_alike(served):
    graph, dataset, models = served
    _, path, want = models[0]
    t = graph.node_types[0]
    ids = np.arange(0, graph.num_nodes(t), 5)

    async def check(engine, client):
        assert engine.metadata()["pipelines"] == ["cpu", "gpu"]
        status, j = await _post(client, _node(t, ids))
        assert status == 200, j
        torch.testing.assert_close(torch.tensor(j["outputs"][0]["data"]).reshape(len(ids), -1), want[t][ids],
                                   atol=1e-5, rtol=1e-5)
        assert engine.snapshot().queue_depths == {"cpu": 0, "gpu": 0}
        text = (await (await client.get("/metrics")).text())
        routed = [ln for ln in text.splitlines() if ln.startswith("hybridgnn_routing_decisions_total")
                  and 'pipeline="gpu"' in ln]
        assert routed and float(routed[0].split()[-1]) >= 1, text[:2000]

    cfg = _config(dataset, path, gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=1),
                  router=RouterConfig(psgs_threshold=0.0))  # every batch is "large": the GPU pipeline's code
    asyncio.run(with_client(cfg, check))


def test_top_k_and_errors_that_name_the_field(served):
    graph, dataset, models = served
    _, path, want = models[0]

    async def check(engine, client):
        s, d = engine.link_pairs[0]
        cands = np.arange(min(30, graph.num_nodes(d)))
        body = {"inputs": [{"name": "src_ids", "datatype": "INT64", "shape": [2], "data": [0, 1]},
                           {"name": "candidate_ids", "datatype": "INT64", "shape": [len(cands)],
                            "data": cands.tolist()}],
                "parameters": {"src_type": s, "dst_type": d, "k": 4}}
        status, j = await _post(client, body)
        assert status == 200, j
        out = {o["name"]: o for o in j["outputs"]}
        best = torch.topk(want[s][[0, 1]] @ want[d][cands].T, 4, dim=1)
        assert out["topk_ids"]["shape"] == [2, 4]
        assert out["topk_ids"]["data"] == cands[best.indices.numpy()].reshape(-1).tolist()
        torch.testing.assert_close(torch.tensor(out["topk_scores"]["data"]).reshape(2, 4), best.values,
                                   atol=1e-5, rtol=1e-5)
        n = graph.num_nodes(s)
        for bad, words in ((_node("nope", [0]), "parameters.node_type: unknown node type 'nope'"),
                           (_pair(s, d, [0, 1], [0]), "src_ids and dst_ids must have the same length"),
                           (_pair(s, d, [n], [0]), f"src_ids: id {n} is out of range for node type {s!r}")):
            status, j = await _post(client, bad)
            assert status == 400 and words in j["error"], j

    asyncio.run(with_client(_config(dataset, path), check))


def test_the_seed_log_of_a_served_hetero_graph_feeds_workload_build(served, tmp_path):
    """serve --seed-log writes the requests' seeds per node type (node ids, both ends of
    pairs, a top-k's seeds and candidates) at SIGTERM; workload build turns them into FAP
    tables that put the requested nodes above what uniform seeds give them."""
    import json
    import subprocess
    import sys

    import requests

    from hybridgnn.workload.typed import TypedWorkloadTables

    graph, dataset, models = served
    _, path, _ = models[0]
    log = tmp_path / "seeds.counts.npz"
    srv = ServerProcess(dataset, path, "--workers", "1", "--seed-log", str(log)).wait_ready()
    want = {}

    def counted(t, ids):
        want.setdefault(t, np.zeros(graph.num_nodes(t), np.int64))
        np.add.at(want[t], ids, 1)

    try:
        session = requests.Session()
        s, d = [tuple(p) for p in session.get(f"{srv.url}/v2/models/hybridgnn", timeout=30).json()["parameters"]
                ["link_types"]][0]
        t, hot = graph.node_types[0], np.arange(5)
        bodies = [_node(t, hot)] * 10 + [_pair(s, d, [0, 1], [1, 1])]
        cands = np.arange(min(6, graph.num_nodes(d)))
        bodies.append({"inputs": [{"name": "src_ids", "datatype": "INT64", "shape": [1], "data": [2]},
                                  {"name": "candidate_ids", "datatype": "INT64", "shape": [len(cands)],
                                   "data": cands.tolist()}], "parameters": {"src_type": s, "dst_type": d, "k": 2}})
        for body in bodies:
            r = session.post(f"{srv.url}/v2/models/hybridgnn/infer", json=body, timeout=60)
            assert r.status_code == 200, r.text
        for _ in range(10):
            counted(t, hot)
        counted(s, [0, 1, 2])
        counted(d, np.r_[[1, 1], cands])
    finally:
        assert srv.stop() == 0, srv.output()  # SIGTERM: the log is written at stop
    with np.load(log, allow_pickle=False) as stored:
        assert {k: stored[k].tolist() for k in stored.files} == {k: v.tolist() for k, v in want.items()}
    done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "workload", "build",
                           "--dataset", str(dataset), "--fanouts", "2,2", "--seeds", str(log)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    logged = TypedWorkloadTables.load_or_build(graph, [2, 2], log, save=False)
    assert json.loads(done.stdout)["seeds"] == logged.seed_key
    uniform = TypedWorkloadTables.build(graph, [2, 2], "uniform")
    fap, flat = np.asarray(logged.fap[t][t]), np.asarray(uniform.fap[t][t])
    # the requested nodes take 10/10 of type t's seeds (uniform: 5 of n), so most of the reads
    assert fap[hot].sum() > 0.9 and fap[hot].sum() > 5 * flat[hot].sum()
    cold = np.setdiff1d(np.arange(graph.num_nodes(t)), hot)
    assert fap[cold].sum() < flat[cold].sum()


def test_precomputed_mode_answers_nodes_pairs_and_a_whole_type_top_k(served, tmp_path):
    import shutil

    from hybridgnn.embeddings.hetero import hetero_precompute
    from hybridgnn.models.hetero_checkpoint import open_hetero_model

    graph, dataset, models = served
    _, saved, want = models[1]  # the HeteroConv model: heads on its outputs
    path = Path(shutil.copytree(saved, tmp_path / "m"))

    def precomputed(body):
        return {**body, "parameters": {**body["parameters"], "mode": "precomputed"}}

    async def before(engine, client):
        assert engine.metadata()["modes"] == ["sampled"]
        status, j = await _post(client, precomputed(_node(graph.node_types[0], [0])))
        assert status == 409 and "hybridgnn precompute" in j["error"], j

    asyncio.run(with_client(_config(dataset, path), before))
    hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)

    async def after(engine, client):
        meta = (await (await client.get("/v2/models/hybridgnn")).json())["parameters"]
        assert meta["modes"] == ["sampled", "precomputed"] and meta["embeddings_computed_unix_s"] > 0
        s, d = meta["link_types"][0]
        src = np.array([0, 2, 2, 7]) % graph.num_nodes(s)
        dst = np.array([1, 0, 5, 3]) % graph.num_nodes(d)
        k = 5
        top = {"inputs": [{"name": "src_ids", "datatype": "INT64", "shape": [2], "data": src[:2].tolist()}],
               "parameters": {"src_type": s, "dst_type": d, "k": k}}
        bodies = [precomputed(_node(t, np.arange(graph.num_nodes(t)))) for t in want]
        bodies += [precomputed(_pair(s, d, src, dst)), precomputed(top)]
        answers = await asyncio.gather(*(_post(client, b) for b in bodies))
        for (status, j), t in zip(answers, want, strict=False):
            assert status == 200, j
            got = torch.tensor(j["outputs"][0]["data"]).reshape(want[t].shape)
            torch.testing.assert_close(got, want[t], atol=1e-5, rtol=1e-5)
        (ps, pj), (ts, tj) = answers[-2:]
        assert ps == 200 and ts == 200, (pj, tj)
        torch.testing.assert_close(torch.tensor(pj["outputs"][0]["data"]), (want[s][src] * want[d][dst]).sum(-1),
                                   atol=1e-5, rtol=1e-5)
        out = {o["name"]: o for o in tj["outputs"]}
        best = torch.topk(want[s][src[:2]] @ want[d].T, k, dim=1)  # over every node of the type
        assert out["topk_ids"]["shape"] == [2, k] and out["topk_ids"]["data"] == best.indices.reshape(-1).tolist()
        torch.testing.assert_close(torch.tensor(out["topk_scores"]["data"]).reshape(2, k), best.values,
                                   atol=1e-5, rtol=1e-5)
        status, j = await _post(client, {**top, "parameters": {**top["parameters"], "mode": "sampled"}})
        assert status == 400 and "mode 'precomputed'" in j["error"], j

    asyncio.run(with_client(_config(dataset, path), after))


def test_new_nodes_over_http_equal_pyg_with_the_nodes_added(served, tmp_path):
    import shutil

    from hybridgnn.embeddings.hetero import hetero_precompute
    from hybridgnn.graph.hetero import reverse_edge_type
    from hybridgnn.models.hetero_checkpoint import open_hetero_model

    graph, dataset, models = served
    _, saved, want = models[0]
    path = Path(shutil.copytree(saved, tmp_path / "m"))
    hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    t = graph.node_types[0]  # user (recsys) or paper (academic)
    e = next(e for e in graph.edge_types if e[0] == t and reverse_edge_type(graph.edge_types, e) is not None)
    rev, other, n = reverse_edge_type(graph.edge_types, e), e[2], graph.num_nodes(t)
    rng = np.random.default_rng(4)
    features = rng.standard_normal((2, graph.nodes[t].feature_dim)).astype(np.float32)
    neighbors = rng.choice(graph.num_nodes(other), 5, replace=False)
    query_index = np.array([0, 0, 0, 1, 1])
    # PyG over the graph with both query nodes and their edges (and the reverse edges) added
    x, ei = whole(graph)
    x = {**x, t: torch.cat([x[t], torch.from_numpy(features)])}
    added = torch.from_numpy(np.stack([n + query_index, neighbors]))
    ei = {**ei, e: torch.cat([ei[e], added], 1), rev: torch.cat([ei[rev], added.flip(0)], 1)}
    with torch.no_grad():  # the served model is golden-checked equal to the PyG model it was saved from
        exact = open_hetero_model(path, graph)[0](x, ei)[t][n:]

    async def check(engine, client):
        meta = engine.metadata()
        assert "new_nodes" in meta["request_kinds"]
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, features.shape[1]],
                            "data": features.reshape(-1).tolist()},
                           {"name": "neighbor_ids", "datatype": "INT64", "shape": [5], "data": neighbors.tolist()},
                           {"name": "query_index", "datatype": "INT64", "shape": [5], "data": query_index.tolist()}],
                "parameters": {"node_type": t, "edge_type": "__".join(e), "mode": "full"}}
        status, j = await _post(client, body)
        assert status == 200, j
        out = {o["name"]: o for o in j["outputs"]}
        torch.testing.assert_close(torch.tensor(out["logits"]["data"]).reshape(exact.shape), exact, atol=1e-5,
                                   rtol=1e-5)
        pairs = [p for p in meta["link_types"] if p[0] == t]
        if pairs:  # the new nodes' top-k of every node of a type, against its stored outputs
            d = pairs[0][1]
            ranked = {**body, "parameters": {**body["parameters"], "dst_type": d, "k": 3},
                      "outputs": [{"name": "topk_ids"}, {"name": "topk_scores"}]}
            status, j = await _post(client, ranked)
            assert status == 200, j
            best = torch.topk(exact @ want[d].T, 3, dim=1)
            got = {o["name"]: o["data"] for o in j["outputs"]}
            assert got["topk_ids"] == best.indices.reshape(-1).tolist()
            torch.testing.assert_close(torch.tensor(got["topk_scores"]).reshape(2, 3), best.values, atol=1e-5,
                                       rtol=1e-5)
        bad = {**body, "parameters": {**body["parameters"], "edge_type": "nope"}}
        status, j = await _post(client, bad)
        assert status == 400 and "parameters.edge_type" in j["error"], j

    asyncio.run(with_client(_config(dataset, path), check))


def test_hetero_refuses_what_it_does_not_serve(served, tmp_path):
    graph, dataset, models = served
    _, path, _ = models[0]
    from hybridgnn.config import UpdateConfig
    from hybridgnn.errors import ConfigError

    cfg = dataclasses.replace(_config(dataset, path), updates=UpdateConfig(token="a-long-token"))
    with pytest.raises(ConfigError, match="graph updates are not served for heterogeneous graphs"):
        asyncio.run(with_client(cfg, None))
    other = HeteroGraphStore.open(generate_hetero(tmp_path / "o", kind="recsys" if len(graph.node_types) == 3
                                                  else "academic", num_nodes=60, avg_degree=3, seed=1))
    with pytest.raises(ConfigError, match="lacks"):
        asyncio.run(with_client(_config(other.root, path), None))


grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")


def test_hybridgnn_serve_answers_tritonclient_over_http_and_grpc(served, tmp_path):
    import shutil

    from hybridgnn.embeddings.hetero import hetero_precompute
    from hybridgnn.models.hetero_checkpoint import open_hetero_model

    graph, dataset, models = served
    _, saved, want = models[0]
    path = Path(shutil.copytree(saved, tmp_path / "m"))  # with precomputed embeddings: new nodes too
    hetero_model = open_hetero_model(path, graph)[0]
    hetero_precompute(hetero_model, graph, path, progress=False)
    port = free_port()
    srv = ServerProcess(dataset, path, "--workers", "1", "--grpc-port", str(port)).wait_ready()
    try:
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        h = httpclient.InferenceServerClient(srv.url.removeprefix("http://"))
        meta = h.get_model_metadata("hybridgnn")
        assert meta["parameters"]["edge_types"] == [list(e) for e in graph.edge_types]
        assert {i["name"] for i in meta["inputs"]} == {"node_ids", "src_ids", "dst_ids", "candidate_ids", "features",
                                                        "neighbor_ids", "query_index", "edge_type"}
        assert {o.name for o in g.get_model_metadata("hybridgnn").outputs} >= {"scores", "topk_ids"}
        s, d = [tuple(p) for p in meta["parameters"]["link_types"]][0]
        src, dst = np.array([0, 3, 5], np.int64), np.array([2, 2, 1], np.int64)
        for client, mod in ((g, grpcclient), (h, httpclient)):
            a, b = mod.InferInput("src_ids", [3], "INT64"), mod.InferInput("dst_ids", [3], "INT64")
            a.set_data_from_numpy(src)
            b.set_data_from_numpy(dst)
            res = client.infer("hybridgnn", [a, b], parameters={"src_type": s, "dst_type": d},
                               outputs=[mod.InferRequestedOutput("scores")])
            np.testing.assert_allclose(res.as_numpy("scores"), (want[s][src] * want[d][dst]).sum(-1).numpy(),
                                       atol=1e-5, rtol=1e-5)
            n = mod.InferInput("node_ids", [2], "INT64")
            n.set_data_from_numpy(np.array([1, 0], np.int64))
            res = client.infer("hybridgnn", [n], parameters={"node_type": s})
            np.testing.assert_allclose(res.as_numpy("logits"), want[s][[1, 0]].numpy(), atol=1e-5, rtol=1e-5)
            with pytest.raises(mod.InferenceServerException) as err:
                client.infer("hybridgnn", [a, n], parameters={"src_type": s, "dst_type": d})
            assert "do not make a request" in err.value.message()
            # a new node of type s joined to two existing nodes, each edge's relation named (BYTES)
            e = next(e for e in graph.edge_types if e[0] == s)
            feats = np.full((1, graph.nodes[s].feature_dim), 0.5, np.float32)
            inputs = [mod.InferInput("features", list(feats.shape), "FP32"),
                      mod.InferInput("neighbor_ids", [2], "INT64"), mod.InferInput("edge_type", [2], "BYTES")]
            inputs[0].set_data_from_numpy(feats)
            inputs[1].set_data_from_numpy(np.array([0, 1], np.int64))
            inputs[2].set_data_from_numpy(np.array(["__".join(e).encode()] * 2, dtype=np.object_))
            res = client.infer("hybridgnn", inputs, parameters={"node_type": s, "mode": "full"})
            x, ei = whole(graph)
            n_s = graph.num_nodes(s)
            x[s] = torch.cat([x[s], torch.from_numpy(feats)])
            added = torch.tensor([[n_s, n_s], [0, 1]])
            ei[e] = torch.cat([ei[e], added], 1)
            rev = next((f for f in graph.edge_types if f[1] == f"rev_{e[1]}" and f[0] == e[2]), None)
            if rev is None and graph.symmetric(e):  # a relation stored both ways (paper cites paper)
                rev = e
            if rev is not None:
                ei[rev] = torch.cat([ei[rev], added.flip(0)], 1)
            with torch.no_grad():
                exact = hetero_model(x, ei)[s][n_s:]
            np.testing.assert_allclose(res.as_numpy("logits"), exact.numpy(), atol=1e-5, rtol=1e-5)
        with pytest.raises(grpcclient.InferenceServerException) as err:
            c = grpcclient.InferInput("node_ids", [1], "INT64")
            c.set_data_from_numpy(np.array([0], np.int64))
            g.infer("hybridgnn", [c], parameters={"node_type": "nope"})
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "node_type" in err.value.message()
    finally:
        assert srv.stop() == 0


def test_bench_loads_a_heterogeneous_model_by_node_type_over_http_and_grpc(served, capsys):
    """`hybridgnn bench` read num_nodes from the metadata, which a heterogeneous model
    lacks (a KeyError); --node-type names the type of the ids it sends."""
    import json

    from hybridgnn.cli.main import main

    graph, dataset, models = served
    ntype = graph.node_types[0]
    port = free_port()
    srv = ServerProcess(dataset, models[0][1], "--workers", "1", "--grpc-port", str(port)).wait_ready()
    try:
        for flags in ([], ["--json-body"], ["--protocol", "grpc", "--grpc-target", f"127.0.0.1:{port}"]):
            assert main(["bench", "--url", srv.url, "--node-type", ntype, "--rate", "40", "--duration-s", "0.5",
                         "--nodes-per-request", "3", *flags]) == 0
            res = json.loads(capsys.readouterr().out)
            assert res["sent"] > 0 and res["ok"] == res["sent"], (flags, res)
    finally:
        srv.stop()
