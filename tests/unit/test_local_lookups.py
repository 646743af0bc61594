"""Precomputed lookups a front-end process answers itself (serving/v2/lookups.py), against
a real engine in this process (no sockets): the same bytes as the engine's own answer, the
same counts once reported, and the engine still answers everything else."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.config import SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.errors import BadRequest
from hybridgnn.serving.frontend import FrontendApi
from hybridgnn.serving.http.api import Api
from hybridgnn.serving.http.codec import parse_infer
from hybridgnn.serving.http.lookups import QUICK_MAX_BODY, HttpLookups
from hybridgnn.serving.http.reply import Reply, Request
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.v2.lookups import (
    LOCAL_MAX_IDS,
    QUICK_MAX_IDS,
    LocalAnswers,
    LocalLookups,
    lookup_specs,
)
from tests.support.engine_api import run_api
from tests.support.payloads import counter


def sample(metrics: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"{name} {labels} not in metrics")


class RecordingLink:
    """An engine link that records what the front end sends (nothing is answered)."""

    def __init__(self):
        self.sent: list[bytes] = []
        self.notes: list[bytes] = []
        self.on_flush = None

    def request(self, make_frame, waiter) -> bool:
        self.sent.append(make_frame(len(self.sent) + 1))
        return True

    def note(self, data: bytes) -> None:
        self.notes.append(data)


async def engine_reply(api: Api, body: bytes, headers: dict | None = None) -> Reply:
    """The engine's own answer (V2Service.infer), not the HTTP server's lookup."""
    lookups, api.lookups = api.lookups, None
    try:
        return await _reply(api, body, headers)
    finally:
        api.lookups = lookups


async def _reply(api: Api, body: bytes, headers: dict | None = None) -> Reply:
    endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
    reply = endpoint(Request(params, headers or {}, body))
    return reply if isinstance(reply, Reply) else await reply


def infer_body(ids, **kw) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)}],
                       **kw}).encode()


def front_end(api: Api) -> tuple[FrontendApi, RecordingLink]:
    link = RecordingLink()
    setup = {"lookups": lookup_specs(api.service), "queue_bound_s": api.engine.queue_bound_s}
    return FrontendApi(link, setup), link


def here(fe: FrontendApi, body: bytes, headers: dict | None = None) -> Reply:
    endpoint, params = fe.route("POST", "/v2/models/hybridgnn/infer")
    return endpoint(Request(params, headers or {}, body))


@pytest.fixture(scope="module")
def pe_cfg(tiny_dataset, tiny_model_pe):
    return ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)))


LOOKUPS = [
    infer_body([0, 5, 2999], parameters={"mode": "precomputed"}),
    infer_body([7], parameters={"mode": "precomputed"}, outputs=[{"name": "embeddings"}], id="abc"),
    infer_body([3, 3, 1], parameters={"mode": "precomputed", "binary_data_output": True}),
    infer_body([11, 12], parameters={"mode": "precomputed"},
               outputs=[{"name": "predictions"}, {"name": "logits", "parameters": {"binary_data": True}}]),
    infer_body(list(range(LOCAL_MAX_IDS)), parameters={"mode": "precomputed"}, outputs=[{"name": "logits"}]),
]
FORWARDED = [
    infer_body([1], parameters={"mode": "sampled"}),
    infer_body([1]),  # the engine's default mode
    infer_body([1], parameters={"mode": "precomputed", "min_graph_version": 0}),
    infer_body([1], parameters={"mode": "precomputed", "something": 1}),
    infer_body(list(range(LOCAL_MAX_IDS + 1)), parameters={"mode": "precomputed"}),
    infer_body([3000], parameters={"mode": "precomputed"}),  # past the graph: the engine's 400
    infer_body([-1], parameters={"mode": "precomputed"}),
    infer_body([1], parameters={"mode": "precomputed"}, outputs=[{"name": "nope"}]),
]


def test_a_lookup_answered_here_is_the_engines_answer_byte_for_byte_and_the_rest_goes_to_it(pe_cfg):
    async def scenario(api, engine):
        fe, link = front_end(api)
        assert fe.local is not None
        pairs = []
        for body in LOOKUPS:
            mine = here(fe, body)
            assert isinstance(mine, Reply), body[:120]
            pairs.append((mine, await engine_reply(api, body)))
        assert not link.sent
        for i, body in enumerate(FORWARDED):
            assert not isinstance(here(fe, body), Reply) and len(link.sent) == i + 1, body[:120]
        fe.quiet = True  # the engine silent: a lookup is not answered here (its count would pile up)
        here(fe, LOOKUPS[0])
        assert len(link.sent) == len(FORWARDED) + 1
        return pairs

    for mine, theirs in run_api(pe_cfg, scenario):
        assert (mine.status, mine.content_type, mine.headers, mine.body) == \
            (theirs.status, theirs.content_type, theirs.headers, theirs.body)


def test_a_front_end_that_drains_or_sees_a_standing_queue_leaves_lookups_to_the_engine(pe_cfg):
    async def scenario(api, engine):
        fe, link = front_end(api)
        body = LOOKUPS[0]
        endpoint, params = fe.route("POST", "/v2/models/hybridgnn/infer")
        late = endpoint(Request(params, {}, body, waited_s=2 * fe.local.bound_s))
        standing = endpoint(Request(params, {}, body, standing=True))
        fe.draining = True
        draining = here(fe, body)
        return [late, standing, draining], link

    replies, link = run_api(pe_cfg, scenario)
    assert not any(isinstance(r, Reply) for r in replies) and len(link.sent) == 3


def test_lookups_answered_here_are_counted_by_the_engine_as_its_own(pe_cfg):
    n = 5

    async def scenario(api, engine):
        fe, link = front_end(api)
        body = infer_body([1, 2], parameters={"mode": "precomputed"})
        for _ in range(n):
            assert here(fe, body).status == 200
        before = engine.model_stats.report("hybridgnn", "1")
        fe.send_counts()
        assert len(link.notes) == 1 and not fe.local.local.counted.size
        kind = wire.FRAME.unpack_from(link.notes[0])[1]
        assert kind == wire.LOCAL
        model, version, seconds, respond_s, rows = wire.decode_local(memoryview(link.notes[0])[wire.FRAME.size:])
        api.service.count_local(model, version, seconds, respond_s, rows)
        after_local = engine.model_stats.report("hybridgnn", "1")
        for _ in range(n):
            assert (await engine_reply(api, body)).status == 200
        after_engine = engine.model_stats.report("hybridgnn", "1")
        return before, after_local, after_engine, engine.stats.exposition()[0].decode()

    before, local, own, metrics = run_api(pe_cfg, scenario)
    assert before["inference_count"] == 0
    # n answers counted from the front end, then n by the engine itself: the same counts
    assert local["inference_count"] == 2 * n and own["inference_count"] == 4 * n
    for stage, got in local["inference_stats"].items():
        assert own["inference_stats"][stage]["count"] == 2 * got["count"], stage
    assert local["inference_stats"]["success"]["count"] == n
    assert counter(metrics, "hybridgnn_requests_total", code="200", model="hybridgnn", version="1") == 2 * n
    assert counter(metrics, "hybridgnn_seeds_total", model="hybridgnn", version="1") == 4 * n
    for stage in ("total", "respond"):
        assert sample(metrics, "hybridgnn_stage_seconds_count", stage=stage, pipeline="precomputed",
                      model="hybridgnn", version="1") == 2 * n


def test_an_engine_whose_rows_change_or_are_not_stored_offers_no_lookups(tiny_dataset, tiny_model, tiny_model_pe,
                                                                         tmp_path):
    updating = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)),
                           updates=UpdateConfig(token="12345678", log=str(tmp_path / "updates.sqlite")))
    without = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)))

    async def scenario(api, engine):
        return lookup_specs(api.service), engine.local_lookup_spec()

    for cfg in (updating, without):
        specs, spec = run_api(cfg, scenario)
        assert specs == [] and spec is None


def test_a_front_end_that_cannot_map_the_rows_answers_none_itself(tmp_path):
    spec = {"model": "m", "version": "1", "final": str(tmp_path / "gone.npy"), "num_nodes": 3, "max_nodes": 8}
    fe = FrontendApi(RecordingLink(), {"lookups": [spec], "queue_bound_s": 1.0})
    assert fe.local is None


def test_rows_that_do_not_cover_the_graph_are_refused(tmp_path):
    np.save(tmp_path / "final.npy", np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="do not cover"):
        LocalLookups([{"model": "m", "version": "1", "final": str(tmp_path / "final.npy"), "num_nodes": 3,
                       "max_nodes": 8}])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["m", "n"]), st.floats(0, 10), st.floats(0, 1), st.integers(0, 64)),
                max_size=40))
def test_counts_taken_are_every_answer_added_once(answers):
    counted = LocalAnswers()
    for model, total, respond, rows in answers:
        counted.add(model, "1", total, respond, rows)
    assert counted.size == len(answers)
    got = {}
    for head, blob in counted.take():
        frame = wire.encode_local(head, blob)
        model, version, seconds, respond_s, rows = wire.decode_local(memoryview(frame)[wire.FRAME.size:])
        got[model] = (seconds.tolist(), respond_s.tolist(), rows)
    assert counted.size == 0 and counted.take() == []
    for model in ("m", "n"):
        mine = [a for a in answers if a[0] == model]
        if mine:
            assert got[model] == ([a[1] for a in mine], [a[2] for a in mine], sum(a[3] for a in mine))
        else:
            assert model not in got


def test_a_local_frame_that_does_not_add_up_breaks_the_link():
    frame = wire.encode_local({"model": "m", "version": "1", "count": 3, "rows": 1}, np.zeros(4, "<f8").tobytes())
    with pytest.raises(wire.WireError):
        wire.decode_local(memoryview(frame)[wire.FRAME.size:])


def test_the_http_server_in_the_engines_process_answers_lookups_itself_and_every_read_counts_them(pe_cfg):
    """One process (--frontends 1): the Api answers a lookup as the engine does, without the
    engine's inference path, and a statistics read or a scrape straight after counts it."""
    async def scenario(api, engine):
        assert api.lookups is not None
        seen = []
        original = api.service.infer
        api.service.infer = lambda *a, **k: seen.append(a) or original(*a, **k)
        mine = [await _reply(api, body) for body in LOOKUPS]
        assert not seen  # none went through the engine's inference path
        stats = api.service.statistics("hybridgnn")[0]
        metrics = api.service.metrics()[0].decode()
        theirs = [await engine_reply(api, body) for body in LOOKUPS]
        assert len(seen) == len(LOOKUPS)
        return mine, theirs, stats, metrics

    mine, theirs, stats, metrics = run_api(pe_cfg, scenario)
    for a, b in zip(mine, theirs, strict=True):
        assert (a.status, a.content_type, a.headers, a.body) == (b.status, b.content_type, b.headers, b.body)
    assert stats["inference_stats"]["success"]["count"] == len(LOOKUPS)
    assert sample(metrics, "hybridgnn_requests_total", model="hybridgnn", version="1", code="200") == len(LOOKUPS)


def _random_lookup(rng: np.random.Generator) -> bytes:
    """A lookup body a client might send, good or bad: ids in or out of range (or not ints),
    outputs in any order (or unknown), binary or JSON, an id, stray parameters."""
    n = int(rng.choice([0, 1, 2, 5, 300, LOCAL_MAX_IDS + 1]))
    ids = (rng.integers(0, 3000, size=n) if rng.random() < 0.8 else rng.integers(-2, 3002, size=n)).tolist()
    data = ids if rng.random() < 0.9 else [str(i) for i in ids]
    params: dict = {"mode": str(rng.choice(["precomputed", "precomputed", "sampled", "Precomputed"]))}
    if rng.random() < 0.2:
        params["binary_data_output"] = bool(rng.random() < 0.5)
    if rng.random() < 0.1:
        params[str(rng.choice(["min_graph_version", "gamma", "x"]))] = int(rng.integers(0, 3))
    if rng.random() < 0.1:
        del params["mode"]
    body = {"inputs": [{"name": str(rng.choice(["node_ids", "node_ids", "nodes"])),
                        "shape": [n] if rng.random() < 0.95 else [n + 1],
                        "datatype": str(rng.choice(["INT64", "INT64", "INT32", "FP32"])), "data": data}],
            "parameters": params}
    if rng.random() < 0.5:
        names = ["logits", "embeddings", "predictions", "nope"]
        body["outputs"] = [{"name": str(rng.choice(names)), **({"parameters": {"binary_data": True}}
                                                                if rng.random() < 0.3 else {})}
                           for _ in range(int(rng.integers(0, 4)))]
    if rng.random() < 0.3:
        body["id"] = str(rng.choice(["a", "", "x" * 300])) if rng.random() < 0.8 else 7
    return json.dumps(body).encode()


def test_any_lookup_body_is_answered_here_as_the_engine_answers_it_or_left_to_the_engine(pe_cfg):
    """Seeded fuzz (one engine for every case): a body the front end answers gets the
    engine's bytes; every other (bad ones included) goes to the engine untouched."""
    rng = np.random.default_rng(38)

    async def scenario(api, engine):
        fe, link = front_end(api)
        answered = forwarded = 0
        for _ in range(400):
            body = _random_lookup(rng)
            mine = here(fe, body)
            if isinstance(mine, Reply):
                theirs = await engine_reply(api, body)
                assert (mine.status, mine.content_type, mine.headers, mine.body) == \
                    (theirs.status, theirs.content_type, theirs.headers, theirs.body), body[:200]
                answered += 1
            else:
                forwarded += 1
                assert len(link.sent) == forwarded
        return answered, forwarded

    answered, forwarded = run_api(pe_cfg, scenario)
    assert answered >= 20 and forwarded >= 20, (answered, forwarded)


def test_rows_rewritten_since_the_engine_opened_them_are_not_answered_from(pe_cfg):
    """A precompute that rewrote the files after the engine started: a front end (re)started
    then would read other rows than the engine's, so it answers none itself."""
    import os

    async def scenario(api, engine):
        specs = lookup_specs(api.service)
        fine = FrontendApi(RecordingLink(), {"lookups": specs, "queue_bound_s": 1.0}).local is not None
        final = specs[0]["final"]
        st = os.stat(final)
        os.utime(final, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        try:
            rewritten = FrontendApi(RecordingLink(), {"lookups": specs, "queue_bound_s": 1.0}).local
        finally:
            os.utime(final, ns=(st.st_atime_ns, st.st_mtime_ns))
        return fine, rewritten

    fine, rewritten = run_api(pe_cfg, scenario)
    assert fine and rewritten is None


QUICK = [
    infer_body([0], parameters={"mode": "precomputed"}),
    infer_body([2999, 0, 2999], parameters={"mode": "precomputed"}),
    infer_body([7], parameters={"mode": "precomputed"}, outputs=[{"name": "logits"}]),
    infer_body([7, 8], parameters={"mode": "precomputed"}, outputs=[{"name": "predictions"}, {"name": "embeddings"},
                                                                     {"name": "predictions"}]),
    infer_body([5], parameters={"mode": "precomputed"}, outputs=[], id="req-1"),
    infer_body([5], parameters={"mode": "precomputed"}, id=12),
    infer_body(list(range(QUICK_MAX_IDS)), parameters={"mode": "precomputed"}, outputs=[{"name": "logits"}]),
]
NOT_QUICK = [  # each is answered some other way (here by the general lane, or by the engine)
    infer_body([True], parameters={"mode": "precomputed"}),
    infer_body([1], parameters={"mode": "precomputed", "binary_data_output": False}),
    infer_body([1], parameters={"mode": "sampled"}),
    infer_body([1]),  # the engine's default mode is sampled
    infer_body([-1], parameters={"mode": "precomputed"}),
    infer_body([3000], parameters={"mode": "precomputed"}),
    infer_body(list(range(QUICK_MAX_IDS + 1)), parameters={"mode": "precomputed"}),
    infer_body([1], parameters={"mode": "precomputed"}, id=True),
    infer_body([1], parameters={"mode": "precomputed"}, outputs=[{"name": "logits", "parameters": {}}]),
    infer_body([1], parameters={"mode": "precomputed"}, outputs=[{"name": "nope"}]),
    infer_body([1], parameters={"mode": "precomputed"}, model_name="hybridgnn"),
    json.dumps({"inputs": [{"name": "node_ids", "shape": [1.0], "datatype": "INT64", "data": [1]}],
                "parameters": {"mode": "precomputed"}}).encode(),
    json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT32", "data": [1]}],
                "parameters": {"mode": "precomputed"}}).encode(),
    json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [[1]]}],
                "parameters": {"mode": "precomputed"}}).encode(),
    b'{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1' + b'0' * 30 + b']}],'
    b' "parameters": {"mode": "precomputed"}}',
    b'{"inputs": [',
]


def test_the_quick_lane_answers_the_commonest_lookups_with_the_general_lanes_bytes_and_nothing_else(pe_cfg):
    """HttpLookups.quick_reply answers the plain JSON lookups most clients send straight from
    the body; its bytes are those of the general lane (parse_infer, then reply()) and of the
    engine. Anything else it leaves (None) to the general lane, which decides it."""
    async def scenario(api, engine):
        fe, _ = front_end(api)
        local, out = fe.local, []
        for body in QUICK:
            quick = local.quick_reply(Request({}, {}, body), "hybridgnn", None)
            assert quick is not None, body[:120]
            general = local.reply(*parse_infer(body, None, "hybridgnn", None))
            out.append((quick, general, await engine_reply(api, body)))
        for body in NOT_QUICK:
            assert local.quick_reply(Request({}, {}, body), "hybridgnn", None) is None, body[:120]
        body = QUICK[0]
        assert local.quick_reply(Request({}, {}, body), "other", None) is None
        assert local.quick_reply(Request({}, {}, body, standing=True), "hybridgnn", None) is None
        assert local.quick_reply(Request({}, {}, body, waited_s=1e9), "hybridgnn", None) is None
        assert local.quick_reply(Request({}, {"inference-header-content-length": str(len(body))}, body),
                                 "hybridgnn", None) is None
        return out

    for replies in run_api(pe_cfg, scenario):
        assert len({(r.status, r.content_type, str(r.headers), r.body) for r in replies}) == 1


def test_any_lookup_the_quick_lane_answers_is_answered_as_the_general_lane_answers_it(pe_cfg):
    """Seeded fuzz over _random_lookup's bodies: whenever the quick lane answers, the general
    lane gives the same bytes; and it does answer a good share of them."""
    rng = np.random.default_rng(39)

    async def scenario(api, engine):
        fe, _ = front_end(api)
        quick_answers = 0
        for _ in range(1500):
            body = _random_lookup(rng)
            quick = fe.local.quick_reply(Request({}, {}, body), "hybridgnn", None)
            if quick is None:
                continue
            quick_answers += 1
            general = fe.local.reply(*parse_infer(body, None, "hybridgnn", None))
            assert general is not None, body[:200]
            assert (quick.status, quick.content_type, quick.headers, quick.body) == \
                (general.status, general.content_type, general.headers, general.body), body[:200]
        return quick_answers

    assert run_api(pe_cfg, scenario) >= 30


@pytest.fixture(scope="module")
def http_lookups(pe_cfg):
    """HttpLookups over the engine's stored rows, outside the engine (no counts sent)."""
    async def scenario(api, engine):
        return lookup_specs(api.service), api.engine.queue_bound_s

    specs, bound_s = run_api(pe_cfg, scenario)
    return HttpLookups(specs, bound_s, lambda taken: None)


_JSON_SCALARS = st.none() | st.booleans() | st.integers(-3, 3003) | st.floats(allow_nan=False, width=32) | \
    st.text(max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(-2, 3002) | _JSON_SCALARS, max_size=QUICK_MAX_IDS + 2),
       shape=st.sampled_from(["n", "n+1", "float", "2d", "missing"]),
       params=st.sampled_from([{"mode": "precomputed"}, {}, None, {"mode": "precomputed", "x": 1}, [],
                               {"mode": "precomputed", "binary_data_output": True}]),
       outputs=st.none() | st.lists(st.sampled_from(["logits", "embeddings", "predictions", "node_ids", 3]),
                                    max_size=4),
       rid=st.none() | _JSON_SCALARS, extra=st.sampled_from([None, "model_name", "inputs2"]))
def test_the_quick_lane_never_answers_otherwise_than_the_general_lane(http_lookups, ids, shape, params, outputs,
                                                                     rid, extra):
    """Property: for bodies near the quick lane's form (one field off at a time, or several),
    quick_reply never raises, and what it answers the general lane answers byte for byte."""
    n = len(ids)
    tensor = {"name": "node_ids", "datatype": "INT64", "data": ids,
              "shape": {"n": [n], "n+1": [n + 1], "float": [float(n)], "2d": [1, n]}.get(shape)}
    if shape == "missing":
        del tensor["shape"]
    body: dict = {"inputs": [tensor]}
    if params is not None:
        body["parameters"] = params
    if outputs is not None:
        body["outputs"] = [{"name": name} for name in outputs]
    if rid is not None:
        body["id"] = rid
    if extra is not None:
        body[extra] = 1
    raw = json.dumps(body).encode()
    quick = http_lookups.quick_reply(Request({}, {}, raw), "hybridgnn", None)
    if quick is None:
        return
    general = http_lookups.reply(*parse_infer(raw, None, "hybridgnn", None))
    assert general is not None
    assert (quick.status, quick.content_type, quick.headers, quick.body) == \
        (general.status, general.content_type, general.headers, general.body)


def _synthetic_lookups(tmp_path, **spec) -> HttpLookups:
    """HttpLookups over small stored rows written here (no engine): 10 nodes, 3 logits, 4
    embedding columns (float16, as a compact store keeps them)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "final.npy", rng.standard_normal((10, 3)).astype(np.float32))
    np.save(tmp_path / "hidden.npy", rng.standard_normal((10, 4)).astype(np.float16))
    base = {"model": "m", "version": "1", "final": str(tmp_path / "final.npy"), "hidden": str(tmp_path / "hidden.npy"),
            "num_nodes": 10, "feature_dim": 5, "max_nodes": 1024, "default_outputs": None, "default_mode": "sampled"}
    return HttpLookups([{**base, **spec}], 1.0, lambda taken: None)


@pytest.mark.parametrize("spec", [{}, {"default_mode": "precomputed"}, {"default_outputs": ["predictions", "logits"]},
                                  {"default_mode": "precomputed", "default_outputs": ["embeddings"]},
                                  {"max_nodes": 3}])
def test_the_quick_lane_follows_each_models_defaults_and_limits_as_the_general_lane_does(tmp_path, spec):
    lookups = _synthetic_lookups(tmp_path, **spec)
    tensor = {"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [4]}
    bodies = [{"inputs": [tensor], "parameters": {"mode": "precomputed"}},
              {"inputs": [tensor]}, {"inputs": [tensor], "parameters": {}},
              {"inputs": [{**tensor, "shape": [4], "data": [1, 2, 3, 9]}], "parameters": {"mode": "precomputed"}},
              {"inputs": [{**tensor, "parameters": {"binary_data_size": 0}}], "parameters": {"mode": "precomputed"}},
              {"inputs": [tensor], "parameters": {"mode": "precomputed"}, "outputs": [{"name": "embeddings"}]}]
    answered = []
    for version in (None, "1", "2"):
        for i, body in enumerate(bodies):
            raw = json.dumps(body).encode()
            quick = lookups.quick_reply(Request({}, {}, raw), "m", version)
            try:
                general = lookups.reply(*parse_infer(raw, None, "m", version))
            except Exception:  # refused by the general way's parsing: the quick lane must not answer
                general = None
            if quick is None:
                continue
            again = lookups.quick_reply(Request({}, {}, raw), "m", version)  # from its kept form, if kept
            assert again is not None and _same(again, quick), (spec, version, body)
            answered.append((version, i))
            assert general is not None, (spec, version, body)
            assert (quick.status, quick.content_type, quick.headers, quick.body) == \
                (general.status, general.content_type, general.headers, general.body), (spec, version, body)
    assert {(None, 0), ("1", 0)} <= set(answered)  # the plain lookup, in every setting
    if spec.get("default_mode") == "precomputed":  # and without naming the mode
        assert {(None, 1), (None, 2)} <= set(answered)
    assert not any(v == "2" for v, _ in answered)  # a version this server does not serve


def answered_as_the_general_lane_or_left(http_lookups, body: bytes) -> None:
    """The quick lane answers `body` with the general lane's bytes, or leaves it (None)."""
    answered = http_lookups.quick_reply(Request({}, {}, body), "hybridgnn", None)
    if answered is None:
        return
    try:
        general = http_lookups.reply(*parse_infer(body, None, "hybridgnn", None))
    except BadRequest:
        general = None
    assert general is not None and _same(answered, general), body


def _same(a: Reply, b: Reply) -> bool:
    return (a.status, a.content_type, a.headers, a.body) == (b.status, b.content_type, b.headers, b.body)


def test_a_kept_form_answers_any_ids_without_parsing_with_the_general_lanes_bytes(pe_cfg, monkeypatch):
    """Once the quick lane answered a body, a body of the same form (its text but the ids
    and a string request id) is answered from the kept form, without parsing the JSON, with
    the bytes of the general lane and of the engine: one or many ids, one or several
    outputs, with or without a request id, repeated."""
    from hybridgnn.serving.http import lookups as http_lookups_module

    rng = np.random.default_rng(40)
    kept = [b for b in QUICK if not isinstance(json.loads(b).get("id"), int)]
    assert any("id" in json.loads(b) for b in kept)
    plain = [chr(c) for c in range(0x20, 0x7f) if chr(c) not in '"\\']

    async def scenario(api, engine):
        fe, _ = front_end(api)
        local = fe.local
        for body in kept:
            assert local.quick_reply(Request({}, {}, body), "hybridgnn", None) is not None
        with monkeypatch.context() as m:
            m.setattr(http_lookups_module, "quick_loads", lambda data: pytest.fail("a kept form was parsed"))
            out = []
            for body in kept:
                n = len(json.loads(body)["inputs"][0]["data"])
                for _ in range(5):
                    ids = rng.integers(0, 3000, size=n).tolist()
                    tensor = json.loads(body)
                    tensor["inputs"][0]["data"] = ids
                    if "id" in tensor:  # a tracing client's own id, any plain characters
                        tensor["id"] = "".join(rng.choice(plain, size=int(rng.integers(0, 40))))
                    again = json.dumps(tensor).encode()
                    out.append((again, local.quick_reply(Request({}, {}, again), "hybridgnn", None)))
        for again, formed in out:
            assert formed is not None, again[:120]
            general = local.reply(*parse_infer(again, None, "hybridgnn", None))
            assert _same(formed, general) and _same(formed, await engine_reply(api, again)), again[:160]
        return len(out)

    assert run_api(pe_cfg, scenario) == 5 * len(kept)


def test_bodies_whose_ids_cannot_be_read_from_their_text_keep_no_form(http_lookups):
    """A form is kept only where the ids the text shows are the input's data: not with a
    request id that is not a plain string (a number, an escape, other characters), not
    where the key is escaped, not with a second `"data"` or `"id"` in the body (the last is
    the one parsed); the others are still answered, by the quick lane."""
    tensor = '{"name": "node_ids", "shape": [1], "datatype": "INT64", %s: [5]}'
    bodies = [
        infer_body([5], parameters={"mode": "precomputed"}, id=7),
        infer_body([5], parameters={"mode": "precomputed"}, id="a\\b"),
        infer_body([5], parameters={"mode": "precomputed"}, id="caf\u00e9"),
        infer_body([5], parameters={"mode": "precomputed"}, id="x" * 129),
        b'{"id": "a", "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [5]}], '
        b'"parameters": {"mode": "precomputed"}, "id": "b"}',
        ('{"inputs": [%s], "parameters": {"mode": "precomputed"}}' % (tensor % '"d\\u0061ta"')).encode(),
    ]
    http_lookups._forms.clear()
    for body in bodies:
        assert http_lookups.quick_reply(Request({}, {}, body), "hybridgnn", None) is not None, body
    assert not http_lookups._forms
    data_twice = ('{"inputs": [%s], "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}'
                  % (tensor % '"data": [6], "data"')).encode()  # the last "data" is the one parsed
    answered = http_lookups.quick_reply(Request({}, {}, data_twice), "hybridgnn", None)
    assert answered is None or not http_lookups._forms


_SHADOWED = '{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", %s}], ' \
    '"parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}'


@pytest.mark.parametrize("template", [
    _SHADOWED % '"data": [%d], "d\\u0061ta": [7]',  # the literal "data" shadowed by an escaped one
    '{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [%d]}], "\\u0069nputs": '
    '[{"name": "node_ids", "shape": [1], "datatype": "INT64", "d\\u0061ta": [7]}], "parameters": {"mode": '
    '"precomputed"}}',
    '{"parameters": {"data": [%d]}, "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", '
    '"d\\u0061ta": [7]}], "parameters": {"mode": "precomputed"}}',
])
def test_a_literal_data_that_a_duplicate_key_shadows_keeps_no_form(http_lookups, template):
    """Keys spelled with escapes can make the one literal `"data"` a key the parser then
    shadows: a body with an escape keeps no form, so later ids in the shadowed list are
    never read as the input's."""
    http_lookups._forms.clear()
    first = (template % 7).encode()
    assert http_lookups.quick_reply(Request({}, {}, first), "hybridgnn", None) is not None
    assert not http_lookups._forms
    other = (template % 3).encode()
    quick = http_lookups.quick_reply(Request({}, {}, other), "hybridgnn", None)
    assert quick is not None and _same(quick, http_lookups.reply(*parse_infer(other, None, "hybridgnn", None)))
    assert quick.body == http_lookups.quick_reply(Request({}, {}, first), "hybridgnn", None).body  # node 7's


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="0123456789 ,\n\t-+.eE[]\"x", max_size=24))
def test_a_kept_form_with_any_ids_text_answers_as_the_general_lane_or_leaves_it(http_lookups, text):
    """Property: a body of a kept form with anything in place of its ids (bad numbers,
    leading zeros, too many or too few, out of range, not numbers) is answered with the
    general lane's bytes, or left to it (None)."""
    for n in (1, 3):
        template = infer_body(list(range(n)), parameters={"mode": "precomputed"}, outputs=[{"name": "logits"}])
        assert http_lookups.quick_reply(Request({}, {}, template), "hybridgnn", None) is not None
        start = template.index(b'"data": [') + len(b'"data": [')
        end = template.index(b"]", start)
        body = template[:start] + text.encode() + template[end:]
        formed = http_lookups.quick_reply(Request({}, {}, body), "hybridgnn", None)
        if formed is None:
            continue
        general = http_lookups.reply(*parse_infer(body, None, "hybridgnn", None))
        assert general is not None and _same(formed, general), body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet='ab7 "\\u00e9\t{}:,\x00\x7f\xe9', max_size=24), before=st.booleans())
def test_a_kept_form_with_anything_in_its_request_ids_place_answers_as_the_general_lane_or_leaves_it(
        http_lookups, text, before):
    """Property: a body of a kept form with a request id, with anything in place of the id's
    text (quotes, escapes, control and non-ASCII characters, JSON that ends the string
    early), is answered with the general lane's bytes, or left to it (None)."""
    rid = {"id": "req-1"}
    template = infer_body([3], parameters={"mode": "precomputed"}, outputs=[{"name": "logits"}], **rid)
    if before:  # the id ahead of the data
        template = b'{"id": "req-1", ' + template[1:].replace(b', "id": "req-1"', b"")
    assert http_lookups.quick_reply(Request({}, {}, template), "hybridgnn", None) is not None
    assert any(form.with_id for form in http_lookups._forms.values())
    start = template.index(b'"id": "') + len(b'"id": "')
    body = template[:start] + text.encode() + template[template.index(b'"', start):]
    answered_as_the_general_lane_or_left(http_lookups, body)


def test_kept_forms_are_bounded(http_lookups, monkeypatch):
    from hybridgnn.serving.http import lookups as http_lookups_module

    monkeypatch.setattr(http_lookups_module, "FORMS_KEPT", 4)
    http_lookups._forms.clear()
    for spaces in range(10):  # the same lookup in ten forms
        body = infer_body([1], parameters={"mode": "precomputed"}).replace(b"{", b"{" + b" " * spaces, 1)
        assert http_lookups.quick_reply(Request({}, {}, body), "hybridgnn", None) is not None
        assert len(http_lookups._forms) <= 4


_NO_ID = object()  # a body without an id
_RIDS = st.one_of(st.just(_NO_ID), st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False),
                  *[st.text(alphabet="ab7 /<>&{}:,[]id-", max_size=12)] * 6,  # plain: a hole of the form
                  st.text(alphabet='ab7 "\\/<>&\u00e9\u2028\t\x00\x7f{}:,[]id', max_size=12),
                  st.text(alphabet="abc", min_size=126, max_size=130))


@st.composite
def _lookup_forms(draw) -> dict:
    """How a client writes its lookups: the keys' order, blanks, outputs, and where its
    request id sits (the body's, a parameter, the input's, or the body's twice)."""
    return {"order": draw(st.permutations(["id", "inputs", "parameters", "outputs"])),
            "tensor": draw(st.permutations(["name", "shape", "datatype", "data"])),
            "outputs": draw(st.sampled_from([None, [], [{"name": "logits"}], [{"name": "embeddings"}, {"name": "logits"}],
                                             [{"name": "predictions"}, {"name": "predictions"}]])),
            "where": draw(st.sampled_from(["body", "body", "body", "parameters", "input", "twice"])),
            "blanks": draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " :\t")])), "n": draw(st.integers(1, 3))}


def _lookup_body(form: dict, ids: list[int], rid, second) -> bytes:
    tensor = {"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}
    parts = {"inputs": [{key: tensor[key] for key in form["tensor"]}], "parameters": {"mode": "precomputed"},
             "outputs": form["outputs"]}
    if rid is not _NO_ID:
        {"body": parts, "twice": parts, "parameters": parts["parameters"], "input": parts["inputs"][0]}[
            form["where"]]["id"] = rid
    doc = {key: parts[key] for key in form["order"] if key in parts and parts[key] is not None}
    sep, colon = form["blanks"]
    text = json.dumps(doc, separators=(sep, colon), ensure_ascii=False)
    if form["where"] == "twice" and rid is not _NO_ID:  # the last of two is the one parsed
        text = text[:-1] + sep + '"id"' + colon + json.dumps(second) + "}"
    return text.encode()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(form=_lookup_forms(), rid=_RIDS,
       others=st.lists(st.tuples(st.lists(st.integers(0, 3005), min_size=1, max_size=3), _RIDS), max_size=5))
def test_lookups_of_any_form_with_any_request_id_are_answered_as_the_general_lane_answers_them(
        http_lookups, form, rid, others):
    """Property: whatever form a client's lookups take (keys in any order, any blanks, any
    outputs) and whatever its request id is (a plain string, one with quotes, escapes or
    other characters, too long, a number, null, or none; in the body, in the parameters or
    the input, or twice, the last as in the first body), once the quick lane kept the form,
    a body of it with other ids and another request id is answered with the general lane's
    bytes, or left to it."""
    http_lookups._forms.clear()
    first = _lookup_body(form, list(range(form["n"])), rid, rid)
    http_lookups.quick_reply(Request({}, {}, first), "hybridgnn", None)
    for ids, other in [(list(range(form["n"])), rid), *others]:
        body = _lookup_body(form, ids, _NO_ID if rid is _NO_ID else other, rid)
        answered_as_the_general_lane_or_left(http_lookups, body)


def test_large_answers_are_encoded_in_turns_with_the_bytes_and_counts_of_one_call(pe_cfg, monkeypatch):
    """An answer whose JSON outputs exceed a piece is encoded over several turns of the loop
    (one of 8192 x 256 embeddings held it 80-140 ms, every other client waiting): by the
    engine, by the HTTP server's lookups and by a front end from the engine's frame, each
    a Later of the bytes one encoder call writes, and counted once encoded."""
    import hybridgnn.serving.http.codec as codec
    import hybridgnn.serving.http.lookups as lookups

    turned = []

    def counted_in_turns(*args):
        turned.append(1)
        return real_in_turns(*args)

    real_in_turns = lookups.in_turns
    monkeypatch.setattr(lookups, "in_turns", counted_in_turns)
    # past the quick lane's bodies (whose small answers are spliced into kept forms at once)
    bodies = [body + b" " * QUICK_MAX_BODY for body in (
        LOOKUPS[0], LOOKUPS[2], infer_body(list(range(40)), parameters={"mode": "precomputed"}))]

    class WaiterLink(RecordingLink):
        def request(self, make_frame, waiter) -> bool:
            self.waiter = waiter
            return super().request(make_frame, waiter)

    async def settled(reply) -> Reply:
        return reply if isinstance(reply, Reply) else await reply

    async def through_front_end(api, fe, body) -> Reply:
        """The front end's reply to body from the engine's ANSWER frame."""
        inp, _ = parse_infer(body, None, "hybridgnn", None, 0.0, False)
        frame = api.service.infer(inp, lambda answer: wire.encode_answer(7, answer), lambda failure: failure)
        frame = frame if isinstance(frame, bytes) else await frame
        assert not isinstance(here(fe, body), Reply)
        return await settled(fe.link.waiter[1](wire.ANSWER, memoryview(frame)[wire.FRAME.size:]))

    async def replies(api, fe) -> list[tuple[Reply, Reply, Reply]]:
        out = []
        for b in bodies:
            endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
            mine = await settled(endpoint(Request(params, {}, b)))  # the HTTP server's lookups
            lookups, api.lookups = api.lookups, None
            try:
                theirs = await settled(endpoint(Request(params, {}, b)))  # the engine's
            finally:
                api.lookups = lookups
            out.append((mine, theirs, await through_front_end(api, fe, b)))
        return out

    async def scenario(api, engine):
        fe = FrontendApi(WaiterLink(), {"queue_bound_s": api.engine.queue_bound_s})  # no lookups of its own
        whole = await replies(api, fe)
        assert not turned
        monkeypatch.setattr(codec, "_PIECE_VALUES", 4)
        api.lookups.send_counts()
        before = engine.model_stats.report("hybridgnn", "1")["inference_count"]
        pieced = await replies(api, fe)
        api.lookups.send_counts()
        after = engine.model_stats.report("hybridgnn", "1")["inference_count"]
        return whole, pieced, after - before

    whole, pieced, counted = run_api(pe_cfg, scenario)
    # the lookups', the engine's and the front end's, in turns; not the binary one's (a copy)
    assert len(turned) == 3 * (len(bodies) - 1)
    assert counted == 3 * (3 + 3 + 40)  # the lookups, the engine and its answer to the front end: once each
    for row_whole, row_pieced in zip(whole, pieced, strict=True):
        for a, b in zip(row_whole, row_pieced, strict=True):
            assert a.status == 200 and (a.status, a.content_type, a.headers, a.body) == \
                (b.status, b.content_type, b.headers, b.body)


def test_an_answer_whose_encoding_fails_in_turns_is_counted_as_failed_not_answered(pe_cfg, monkeypatch):
    """The engine counts a large answer once its turns are done: one whose encoding raised
    on the way is the HTTP 500 the client gets (as one that raises at once is), not a 200
    and its rows (it was counted a 200 with every row, the client holding a 500)."""
    import hybridgnn.serving.http.codec as codec

    body = infer_body(list(range(40)), parameters={"mode": "precomputed"})

    def failing(arr):
        raise TypeError("an output the encoder cannot write")

    async def scenario(api, engine):
        assert (await engine_reply(api, body)).status == 200
        before = engine.model_stats.report("hybridgnn", "1")
        monkeypatch.setattr(codec, "_PIECE_VALUES", 4)  # every output in pieces: one turn each
        monkeypatch.setattr(codec, "_json_values", failing)  # called for the pieces only
        reply = await engine_reply(api, body)
        return before, reply, engine.model_stats.report("hybridgnn", "1"), engine.stats.exposition()[0].decode()

    before, reply, after, metrics = run_api(pe_cfg, scenario)
    assert reply.status == 500 and b"internal server error" in reply.body
    assert after["inference_count"] == before["inference_count"]
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"]
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    assert counter(metrics, "hybridgnn_requests_total", code="200", model="hybridgnn", version="1") == 1
    assert counter(metrics, "hybridgnn_requests_total", code="500", model="hybridgnn", version="1") == 1
