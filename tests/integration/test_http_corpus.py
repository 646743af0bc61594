"""Request smuggling and abuse, byte for byte, against the real server: every payload of
tests/support/http_corpus.py on a raw socket of its own, checked against what llhttp
(httptools) makes of the same bytes plus the server's own rules (one Host header in
HTTP/1.1, a 64 KiB head, max_body_bytes): rejected bytes get exactly one HTTP-level error
(JSON {"error": ...}) after the requests before them, then the connection closes; accepted
bytes get exactly one answer per request llhttp saw, never one to a request it did not see.
Afterwards a good inference answers as it did before, from the same process."""

from __future__ import annotations

import pytest

from tests.support.fuzz import (
    KeepAliveClient,
    Target,
    exchange,
    exchange_problems,
    good_case,
    llhttp_verdict,
)
from tests.support.http_corpus import CORPUS
from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess

DEADLINE_S = 3.0  # per payload: answers and the close must come within this


@pytest.fixture(scope="module", params=FRONTENDS, ids=FRONTEND_IDS)
def corpus_server(tiny_dataset, tiny_model_pe, request):
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--frontends", request.param).wait_ready()
    target = Target.discover("127.0.0.1", srv.port)
    client = KeepAliveClient(target.host, target.port)
    good = good_case(target)
    before = client.request(good.method, good.path, good.body, good.headers)
    assert before.status == 200, before.body
    srv.target, srv.client, srv.good, srv.before = target, client, good, before
    yield srv
    client.close()
    assert srv.stop() == 0


def test_corpus_is_large_and_mixed():
    verdicts = [llhttp_verdict(p.segments) for p in CORPUS]
    assert len(CORPUS) >= 60 and len({p.name for p in CORPUS}) == len(CORPUS)
    assert sum(v.rejected for v in verdicts) >= 30 and sum(not v.rejected for v in verdicts) >= 20


@pytest.mark.parametrize("payload", CORPUS, ids=[p.name for p in CORPUS])
def test_payload(corpus_server, payload):
    v = llhttp_verdict(payload.segments)
    # Half-close only where the server may keep the connection open; elsewhere it must close
    # by itself (after an error, a request without keep-alive, an upgrade).
    half_close = payload.half_close if payload.half_close is not None else not v.close
    ex = exchange(corpus_server.target.host, corpus_server.target.port, payload.segments, half_close=half_close,
                  deadline_s=DEADLINE_S)
    problems = exchange_problems(v, ex, require_close=not half_close)
    if not any(b"/smuggled" in url for url in v.urls):
        problems += [f"answered a smuggled request: {r.status} {r.body[:120]!r}" for r in ex.final
                     if b"GET /smuggled" in r.body]
    assert corpus_server.proc.poll() is None, f"the server died on {payload.name}:\n{corpus_server.output()}"
    assert not problems, (f"{payload.name}: llhttp says {v.describe()}; got {[r.status for r in ex.responses]}, "
                          f"closed={ex.closed}: {problems}")


def test_good_request_unchanged_after_corpus(corpus_server):
    good = corpus_server.good
    after = corpus_server.client.request(good.method, good.path, good.body, good.headers)
    assert corpus_server.proc.poll() is None
    assert after.status == 200 and after.body == corpus_server.before.body
