"""Fuzzing the real server (hypothesis, reproducible: derandomize=True): KServe JSON bodies,
binary-tensor bodies with lying Inference-Header-Content-Length, graph updates, and mutated
raw HTTP bytes, 2,000 cases in all against one server process. Every answer: no 5xx (an
HTTP-level 501/505 aside for raw bytes), errors as JSON {"error": ...}, within 5 s; raw bytes
get as many answers as llhttp saw requests; the process stays up, and afterwards a good
inference answers byte for byte as it did before. bench/fuzz.py runs the same generators
for 100,000 cases."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzz import (
    KeepAliveClient,
    NoAnswer,
    Target,
    binary_infer_cases,
    good_case,
    graph_update_cases,
    json_infer_cases,
    raw_http_cases,
    run_case,
)
from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess

TOKEN = "fuzz-update-token"
TIMEOUT_S = 5.0


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


@pytest.fixture(scope="module", params=FRONTENDS, ids=FRONTEND_IDS)
def fuzz(tiny_dataset, tiny_model_pe, request):
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-token", TOKEN,
                        "--update-log", "off", "--frontends", request.param).wait_ready()
    srv.target = Target.discover("127.0.0.1", srv.port, TOKEN)
    srv.client = KeepAliveClient("127.0.0.1", srv.port, TIMEOUT_S)
    good = good_case(srv.target)
    srv.good = good
    srv.before = srv.client.request(good.method, good.path, good.body, good.headers)
    assert srv.before.status == 200, srv.before.body
    srv.cases = 0
    srv.wedged = None
    yield srv
    srv.client.close()
    assert srv.stop() == 0


def good_answers(fuzz) -> bool:
    """Whether the good inference still answers 200 within 2 s (on a connection of its own)."""
    client = KeepAliveClient("127.0.0.1", fuzz.port, 2.0)
    try:
        return client.request(fuzz.good.method, fuzz.good.path, fuzz.good.body, fuzz.good.headers).status == 200
    except (NoAnswer, OSError):
        return False
    finally:
        client.close()


def check(fuzz, case) -> None:
    # A server that stopped answering fails every later case at once (not after a 5 s
    # timeout each, which would make hypothesis's shrinking take hours); the message names
    # the case after which it stopped.
    if fuzz.wedged:
        pytest.fail(f"the server stopped answering after an earlier case: {fuzz.wedged}")
    outcome = run_case(fuzz.client, fuzz.target, case, timeout_s=TIMEOUT_S)
    fuzz.cases += 1
    assert fuzz.proc.poll() is None, f"the server died on {case!r}:\n{fuzz.output()}"
    if outcome.problems and not good_answers(fuzz):
        fuzz.wedged = f"{case!r} -> {outcome.statuses}: {outcome.problems}"
        pytest.fail(f"the server stopped answering after {fuzz.wedged}")
    assert not outcome.problems, f"{case!r} -> {outcome.statuses}: {outcome.problems}"


@fuzz_settings(700)
@given(data=st.data())
def test_json_bodies(fuzz, data):
    check(fuzz, data.draw(json_infer_cases(fuzz.target), label="case"))


@fuzz_settings(300)
@given(data=st.data())
def test_binary_bodies(fuzz, data):
    check(fuzz, data.draw(binary_infer_cases(fuzz.target), label="case"))


@fuzz_settings(400)
@given(data=st.data())
def test_graph_updates(fuzz, data):
    check(fuzz, data.draw(graph_update_cases(fuzz.target), label="case"))


@fuzz_settings(600)
@given(data=st.data())
def test_raw_http(fuzz, data):
    check(fuzz, data.draw(raw_http_cases(fuzz.target), label="case"))


def test_server_unchanged_after_fuzzing(fuzz):
    assert not fuzz.wedged, f"the server stopped answering after {fuzz.wedged}"
    good = fuzz.good
    after = fuzz.client.request(good.method, good.path, good.body, good.headers)
    assert fuzz.proc.poll() is None
    assert after.status == 200 and after.body == fuzz.before.body
    assert fuzz.cases >= 2000 or fuzz.cases == 0  # 0: run alone (-k)
