"""The one error model (hybridgnn/errors.py) and the API's one map from an exception to an
answer (Api.error_reply): statuses, headers, messages, and 500s with a request id for bugs.
Called in process, without sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from types import SimpleNamespace

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from hybridgnn import errors
from hybridgnn.config import SamplingConfig, ServeConfig
from hybridgnn.errors import (
    BadRequest,
    BatchFailed,
    ConfigError,
    Conflict,
    Draining,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RemovedNode,
    ServingError,
    Unauthorized,
    UpdateError,
)
from hybridgnn.serving.http.api import Api, Reply, Request
from hybridgnn.telemetry.metrics import Telemetry
from tests.support.engine_api import run_api
from tests.support.payloads import counter


def stub_api() -> Api:
    """An Api over a stand-in engine: enough for routing and error answers."""
    server = SimpleNamespace(model_name="m", max_body_bytes=10)
    return Api(SimpleNamespace(cfg=SimpleNamespace(server=server), stats=Telemetry(model="m"), model_version="1",
                               queue_bound_s=0.1, ready=True))


def answer(reply: Reply) -> tuple[int, dict, dict]:
    return reply.status, json.loads(reply.body), reply.headers or {}


@pytest.mark.parametrize("exc, status, message, headers", [
    (BadRequest("bad"), 400, "bad", {}),
    (UpdateError("edge [1, 2] is already in the graph"), 400,
     "update rejected, nothing applied: edge [1, 2] is already in the graph", {}),
    (Unauthorized("who?"), 401, "who?", {"WWW-Authenticate": "Bearer"}),
    (Forbidden("no"), 403, "no", {}),
    (NotFound("none"), 404, "none", {}),
    (RemovedNode("node 3 was removed"), 404, "node 3 was removed", {}),
    (MethodNotAllowed("not so", "GET, HEAD"), 405, "not so", {"Allow": "GET, HEAD"}),
    (Conflict("run precompute"), 409, "run precompute", {}),
    (PayloadTooLarge("big"), 413, "big", {}),
    (Overloaded("5 in flight"), 429, "server overloaded: 5 in flight", {"Retry-After": "1"}),
    (Overloaded("slow", retry_after_s=7.2), 429, "server overloaded: slow", {"Retry-After": "8"}),
    (Draining("server is shutting down"), 503, "not accepting requests: server is shutting down",
     {"Retry-After": "1"}),
    (ServingError("teapot", status=418), 418, "teapot", {}),
])
def test_each_serving_error_answers_its_status_headers_and_message(exc, status, message, headers):
    got_status, body, got_headers = answer(stub_api().error_reply(exc))
    assert (got_status, body, got_headers) == (status, {"error": message}, headers)
    assert errors.status_of(exc) == status


def test_refusals_are_counted_by_reason_and_share_their_answer():
    api = stub_api()
    first = api.error_reply(Overloaded("x"))
    assert api.error_reply(Overloaded("x")) is first and first.shared  # one Reply: the protocol keeps its bytes
    assert api.error_reply(Overloaded("x", retry_after_s=5)) is not first  # another Retry-After, another answer
    assert api.error_reply(BadRequest("x")) is not api.error_reply(BadRequest("x"))  # only refusals are shared
    api.error_reply(Draining("x"))
    metrics = api.engine.stats.exposition()[0].decode()
    assert counter(metrics, "hybridgnn_rejected_requests_total", reason="overload") == 3
    assert counter(metrics, "hybridgnn_rejected_requests_total", reason="draining") == 1


@pytest.mark.parametrize("exc", [KeyError("k"), LookupError("no such row"), ValueError("bug"), IndexError(3),
                                 RecursionError(), None])
def test_anything_else_is_a_logged_500_with_a_request_id(exc, caplog):
    with caplog.at_level(logging.ERROR, logger="hybridgnn.serving.http.api"):
        status, body, headers = answer(stub_api().error_reply(exc, "infer"))
    assert status == 500 and set(body) == {"error", "request_id"} and body["error"] == "internal server error"
    assert re.fullmatch(r"[0-9a-f]{12}", body["request_id"])
    line = [r for r in caplog.records if body["request_id"] in r.getMessage()]
    assert line and "infer" in line[0].getMessage()
    assert (line[0].exc_info is not None) == (exc is not None)  # the traceback goes to the log, not the client
    assert "k" not in body["error"] and "bug" not in json.dumps(body)


def test_batch_failures_are_500s_with_their_message_and_a_request_id(caplog):
    with caplog.at_level(logging.ERROR, logger="hybridgnn.serving.http.api"):
        status, body, _ = answer(stub_api().error_reply(BatchFailed("RuntimeError: kernel")))
    assert status == 500 and body["error"] == "inference failed: RuntimeError: kernel"
    assert any(body["request_id"] in r.getMessage() for r in caplog.records)
    assert errors.status_of(RuntimeError()) == 500


def test_routing_errors_use_the_same_table():
    api = stub_api()
    assert answer(api.route("GET", "/nothing")) == (404, {"error": "no such endpoint: GET /nothing"}, {})
    assert answer(api.route("POST", "/v2/health/live"))[2] == {"Allow": "GET, HEAD"}
    assert answer(api.route("PUT", "/v2/models/m/infer"))[0] == 405
    endpoint, params = api.route("GET", "/v2/models/other")
    assert answer(endpoint(Request(params, {}, b""))) == (
        404, {"error": "unknown model 'other'; this server serves ['m']"}, {})


def test_a_bug_in_an_endpoint_is_a_500_not_a_4xx():
    api = stub_api()
    api.engine.model = None  # model_metadata reads engine.model.spec: AttributeError, a bug
    endpoint, params = api.route("GET", "/v2/models/m")
    status, body, _ = answer(endpoint(Request(params, {}, b"")))
    assert status == 500 and "request_id" in body
    assert api.internal_error("HTTP parser", NotFound("x")).status == 404  # the HTTP layer maps the same way


def test_config_errors_are_value_errors_and_carry_the_dataset_kinds():
    from hybridgnn.graph.store import DatasetError
    from hybridgnn.models.checkpoint import CheckpointError
    from hybridgnn.scheduler.policy import ProfileMismatch

    for cls in (DatasetError, CheckpointError, ProfileMismatch):
        assert issubclass(cls, ConfigError) and issubclass(cls, ValueError)
    assert not issubclass(ConfigError, ServingError)


def test_brief_keeps_client_values_short_and_printable():
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert len(errors.brief(deep)) < 40
    assert len(errors.brief("x" * 10_000)) < 80 and len(errors.brief(list(range(10_000)))) < 80
    assert len(errors.brief(10 ** 5000)) < 80  # past the int-to-text limit: no ValueError either


# --- through a real engine (no sockets): bodies that used to answer 500 ---------------------
async def call(api: Api, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
    reply = endpoint(Request(params, headers or {}, body))
    if not isinstance(reply, Reply):
        reply = await reply
    return reply.status, json.loads(reply.body)


def new_node_body(edges: list[list[int]], mode: str, q: int = 2) -> bytes:
    feats = np.random.default_rng(0).standard_normal((q, 16)).astype(np.float32)
    ei = np.asarray(edges, dtype=np.int64).reshape(2, -1)
    return json.dumps({
        "inputs": [{"name": "features", "shape": [q, 16], "datatype": "FP32", "data": feats.reshape(-1).tolist()},
                   {"name": "edge_index", "shape": list(ei.shape), "datatype": "INT64",
                    "data": ei.reshape(-1).tolist()}],
        "parameters": {"mode": mode, "gamma": 0.5}}).encode()


def test_client_bodies_that_were_500s(tiny_dataset, tiny_model_pe):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)))

    async def scenario(api, engine):
        out = {}
        nest = b"[" * 5000 + b"]" * 5000
        out["deep"] = await call(api, b'{"inputs": ' + nest + b"}")
        out["deep_id"] = await call(api, b'{"id": ' + b"[" * 1000 + b"]" * 1000 + b', "inputs": [1]}')
        out["digits"] = await call(api, b'{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", '
                                        b'"data": [' + b"1" * 5000 + b"]}]}")
        out["mode"] = await call(api, json.dumps({
            "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}],
            "parameters": {"mode": [[["x" * 1000]]]}}).encode())
        for mode in ("full", "pe", "srpe", "sampled"):
            out[mode] = await call(api, new_node_body([[], []], mode))
            out[mode + "_one_isolated"] = await call(api, new_node_body([[3000], [7]], mode))
        metrics = engine.stats.exposition()[0].decode()
        return out, metrics

    out, metrics = run_api(cfg, scenario)
    assert out["deep"][0] == 400 and "nested too deeply" in out["deep"][1]["error"]
    assert out["deep_id"][0] == 400
    assert out["digits"][0] == 400 and "4300 digits" in out["digits"][1]["error"]
    assert out["mode"][0] == 400 and len(out["mode"][1]["error"]) < 300
    for mode in ("full", "pe", "srpe", "sampled"):
        for key in (mode, mode + "_one_isolated"):
            status, body = out[key]
            assert status == 200, (key, body)
            emb = {o["name"]: o for o in body["outputs"]}["logits"]
            assert emb["shape"][0] == 2 and np.isfinite(emb["data"]).all()
    # an edge-less query node's answer is the same in every mode (its own features only)
    rows = {m: np.asarray({o["name"]: o for o in out[m][1]["outputs"]}["logits"]["data"]) for m in
            ("full", "pe", "srpe", "sampled")}
    for m in ("pe", "srpe", "sampled"):
        np.testing.assert_allclose(rows[m], rows["full"], rtol=1e-4, atol=1e-5)
    assert counter(metrics, "hybridgnn_requests_total", code="400", model="hybridgnn", version="1") == 4


def test_a_lookup_error_inside_the_engine_is_a_500_not_a_409(tiny_dataset, tiny_model_pe, monkeypatch):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)))

    def broken(self, node_ids, with_embeddings):
        raise LookupError("an internal table lacks a key")

    async def scenario(api, engine):
        api.lookups = None  # the engine's own lookup, not the HTTP server's (tests/unit/test_local_lookups.py)
        monkeypatch.setattr(type(engine._side), "_rows", broken)  # under the inline and the awaited lookup
        return await call(api, json.dumps({
            "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}],
            "parameters": {"mode": "precomputed"}}).encode())

    status, body = run_api(cfg, scenario)
    assert status == 500 and body["error"] == "internal server error" and "request_id" in body


def test_update_errors_through_the_api(tiny_dataset, tiny_model_pe, tmp_path):
    from hybridgnn.config import UpdateConfig

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)),
                      updates=UpdateConfig(token="12345678", max_request_updates=100,
                                           log=str(tmp_path / "updates.sqlite")))
    auth = {"authorization": "Bearer 12345678"}

    def update(*inputs) -> bytes:
        return json.dumps({"inputs": [{"name": n, "datatype": d, "shape": list(np.shape(v)),
                                       "data": np.ravel(v).tolist()} for n, d, v in inputs]}).encode()

    async def post(api, body, headers):
        endpoint, params = api.route("POST", "/v2/models/hybridgnn/graph")
        reply = await endpoint(Request(params, headers, body))
        return reply.status, json.loads(reply.body), reply.headers or {}

    async def scenario(api, engine):
        out = {"auth": await post(api, update(("remove_nodes", "INT64", [1])), {"authorization": "Bearer nope"}),
               "unknown": await post(api, update(("add_edges", "INT64", [[0, 999_999]])), auth),
               "too_many": await post(api, update(("remove_nodes", "INT64", list(range(101)))), auth),
               "deep": await post(api, b'{"inputs": ' + b"[" * 3000 + b"]" * 3000 + b"}", auth),
               "ok": await post(api, update(("add_edges", "INT64", [[0, 2999]])), auth)}
        out["new_node_after_update"] = await call(api, new_node_body([[3000], [5]], "full", q=1))
        out["sampled_new_node_after_update"] = await call(api, new_node_body([[3000], [5]], "sampled", q=1))
        return out

    out = run_api(cfg, scenario)
    assert out["auth"][0] == 401 and out["auth"][2] == {"WWW-Authenticate": "Bearer"}
    status, body, _ = out["unknown"]
    assert status == 400 and body["error"].startswith("update rejected, nothing applied: ") and "unknown node" in \
        body["error"]
    assert out["too_many"][0] == 413
    assert out["deep"][0] == 400 and "nested too deeply" in out["deep"][1]["error"]
    assert out["ok"][0] == 200, out["ok"]
    assert out["new_node_after_update"][0] == 200  # evaluated on the current graph
    assert out["sampled_new_node_after_update"][0] == 200  # keyed draws read the current graph too


def test_each_lane_admits_with_the_wait_in_the_front_end(tiny_dataset, tiny_model_pe, tmp_path):
    """Lookups (kept fresh under updates), new nodes and graph updates each pass their
    lane's admission with what the request already waited in the front end; a wait past
    the bound is refused 429 + Retry-After and nothing is applied."""
    from hybridgnn.config import UpdateConfig

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)),
                      updates=UpdateConfig(token="12345678", log=str(tmp_path / "updates.sqlite")))
    lookup = json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}],
                         "parameters": {"mode": "precomputed"}}).encode()
    update = json.dumps({"inputs": [{"name": "add_edges", "datatype": "INT64", "shape": [1, 2],
                                     "data": [0, 2999]}]}).encode()
    auth = {"authorization": "Bearer 12345678"}

    async def answer_of(reply):
        return reply if isinstance(reply, Reply) else await reply

    async def scenario(api, engine):
        seen = []
        admit = engine.admit
        engine.admit = lambda lane, work, waited_s=0.0: (seen.append((lane, waited_s)), admit(lane, work, waited_s))[1]
        infer, params = api.route("POST", "/v2/models/hybridgnn/infer")
        graph, _ = api.route("POST", "/v2/models/hybridgnn/graph")
        bound = engine._admission.bound_s
        out = {}
        for waited in (0.01, 2 * bound):
            out["lookup", waited] = await answer_of(infer(Request(params, {}, lookup, waited)))
            out["new_node", waited] = await answer_of(infer(Request(params, {}, new_node_body([[3000], [7]], "full"),
                                                                     waited)))
            out["update", waited] = await answer_of(graph(Request(params, auth, update, waited)))
        return seen, out, bound, engine.graph_version

    seen, out, bound, version = run_api(cfg, scenario)
    assert ("lookup", 0.01) in seen and ("new_nodes", 0.01) in seen and ("updates", 0.01) in seen
    for kind in ("lookup", "new_node", "update"):
        assert out[kind, 0.01].status == 200, (kind, out[kind, 0.01].body)
        refused = out[kind, 2 * bound]
        assert refused.status == 429 and refused.headers["Retry-After"], (kind, refused.body)
    assert version == 1  # the refused update applied nothing


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(message=st.text(), status=st.sampled_from([400, 404, 429, 503]))
def test_an_error_body_is_the_json_of_its_message(message, status):
    """Reply.error builds its body without json.dumps (refusals are answered by the thousand
    per second); the bytes must be the same."""
    from hybridgnn.serving.http.api import Reply

    reply = Reply.error(status, message)
    assert reply.body == json.dumps({"error": message}).encode() and reply.status == status
    assert json.loads(reply.body) == {"error": message}


def test_a_request_past_the_target_of_a_standing_queue_is_refused_but_health_is_answered(tiny_dataset, tiny_model):
    """The front end decides (its queue stands and the request waited over the target);
    the infer endpoint refuses it before decoding, with Retry-After, as one shared Reply
    counted each time; a health check that waited as long is still answered; a draining
    engine answers its own 503 instead."""
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    async def scenario(api, engine):
        endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
        refused = [endpoint(Request(params, {}, b"not even JSON", 0.03, standing=True)) for _ in range(2)]
        live, _ = api.route("GET", "/v2/health/live")
        health = live(Request({}, {}, b"", 0.03, standing=True))
        counted = engine._admission.describe(), engine.model_stats.report("hybridgnn", "1")
        engine.draining = True
        good = json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}]})
        draining = endpoint(Request(params, {}, good.encode(), 0.03, standing=True))
        engine.draining = False
        return refused, health, counted, draining

    refused, live, (admission, stats), draining = run_api(cfg, scenario)
    status, body, headers = answer(refused[0])
    assert status == 429 and headers["Retry-After"] == "1"
    assert re.fullmatch(r"server overloaded: waited over \d+ ms in a standing queue of the front end; retry later",
                        body["error"])
    assert refused[1] is refused[0] and refused[0].shared
    assert live.status == 200
    assert admission["refused_standing_queue"] == 2 and admission["refused_by_delay"] == 2
    assert stats["inference_stats"]["fail"]["count"] == 2
    assert draining.status == 503 and draining is not refused[0]  # its own answer, not the standing 429


def test_a_sampled_inference_whose_declared_ids_would_pass_the_bound_is_refused_before_decoding(
        tiny_dataset, tiny_model):
    """Under overload most requests are refused, and a decode costs more than the rest of a
    refusal: a sampled inference is judged first by the ids its header declares (at the
    PSGS per seed of admitted requests), so one whose ids are out of range, which a decode
    would answer 400, is refused 429; a request that fits under the bound is still decoded
    and judged by its own ids (400)."""
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    def body(n: int) -> bytes:
        return json.dumps({"inputs": [{"name": "node_ids", "shape": [n], "datatype": "INT64",
                                       "data": [10**9] * n}]}).encode()

    async def scenario(api, engine):
        lane = engine._admission.lanes["sampled"]
        for _ in range(16):
            lane.observe(1.0, 0.001)  # a millisecond per PSGS, one server
        lane.servers, lane.full_batch = 1, 1e9
        per_seed = engine._admitted_seed_psgs
        lane.queued = 50.0  # 50 ms queued: half the 100 ms bound
        endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
        many = int(80 / per_seed) + 1  # ~80 ms more: past the bound
        refused = endpoint(Request(params, {}, body(many), 0.0))
        decoded = endpoint(Request(params, {}, body(1), 0.0))
        huge = [endpoint(Request(params, {}, json.dumps(
            {"inputs": [{"name": "node_ids", "shape": [10**11], "datatype": "INT64", "data": [1]}],
             "parameters": {"mode": mode}}).encode(), 0.0)) for mode in ("sampled", "precomputed")]
        return refused, decoded, lane.queued, huge

    refused, decoded, queued, huge = run_api(cfg, scenario)
    for reply in huge:  # too many ids is the request's fault at any load: 400, never a 429 to retry
        assert answer(reply)[:2] == (400, {"error": "node_ids holds 100000000000 ids; at most 8192 per request"})
    status, message, headers = answer(refused)
    assert status == 429 and headers["Retry-After"], message
    assert message["error"].startswith("server overloaded: predicted queueing delay")
    status, message, _ = answer(decoded)
    assert status == 400 and "10000000" in message["error"], message
    assert queued == 50.0  # neither added work


def test_every_request_of_a_batch_is_answered_once_when_one_answer_fails(tiny_dataset, tiny_model):
    """The engine calls each request's on_done in the call that completes its batch. One
    that raises is reported to the loop's exception handler; the requests after it in the
    batch are still answered, and nothing stays pending."""
    from hybridgnn.config import BatcherConfig

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      batcher=BatcherConfig(max_wait_s=0.2))

    async def scenario(api, engine):
        reported, answers = [], []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx.get("exception")))

        def failing(result, error):
            raise RuntimeError("an answer that fails")

        engine.submit(np.array([1]), on_done=failing)
        engine.submit(np.array([2, 3]), on_done=lambda result, error: answers.append((result, error)))
        last = await engine.submit(np.array([4]))  # the same batch (the batcher waits up to 200 ms)
        return reported, answers, last, engine.pending

    reported, answers, last, pending = run_api(cfg, scenario)
    assert [type(e) for e in reported] == [RuntimeError]
    assert len(answers) == 1 and answers[0][1] is None and answers[0][0].logits.shape[0] == 2
    assert last.logits.shape[0] == 1 and pending == 0
