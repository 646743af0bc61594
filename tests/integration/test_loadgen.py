"""The open-loop load generator against a local aiohttp server whose behaviour each
model name picks: status counting, latency from the scheduled arrival, connection
reuse and closing, and requests that never get an answer."""

import asyncio

import pytest
from aiohttp import web

from hybridgnn.bench.loadgen import run_load


async def handler(request: web.Request) -> web.Response:
    body = await request.read()
    kind = request.match_info["model"]
    if kind == "bad":  # a message naming the request's ids: every answer differs
        return web.json_response({"error": f"node_ids: unknown node {body[-24:].hex()}"}, status=400)
    if kind == "slow":
        await asyncio.sleep(0.03)
    if kind == "hang":
        await asyncio.sleep(3600)
    status = {"busy": 429, "fail": 500}.get(kind, 200)
    resp = web.Response(body=b"x" * 1000, status=status)
    if kind == "close":
        resp.force_close()
    return resp


async def serving(scenario):
    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await scenario(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def load(model: str, **kw):
    async def scenario(url):
        return await run_load(url, model, num_nodes=100, nodes_per_request=3, **kw)
    return asyncio.run(serving(scenario))


@pytest.mark.parametrize("model", ["ok", "close"])
def test_every_request_is_answered_on_kept_or_closed_connections(model):
    res = load(model, rate=400, duration_s=0.5)
    assert res.sent > 100 and res.ok == res.sent and res.errors == res.rejected == 0
    assert res.seeds_per_s == pytest.approx(3 * res.achieved_rps)


def test_refusals_and_failures_are_counted_apart():
    assert load("busy", rate=200, duration_s=0.3).rejected > 0
    fail = load("fail", rate=200, duration_s=0.3)
    assert fail.errors == fail.sent and fail.ok == 0
    assert fail.error_messages == {"500": ["x" * 197 + "..."]}  # a body that is not JSON: its text, cut short


def test_the_report_says_what_failing_answers_said_a_few_distinct_messages_per_status():
    bad = load("bad", rate=300, duration_s=0.5)
    assert bad.errors == bad.sent > 50 and bad.error_statuses == {"400": bad.sent}
    messages = bad.error_messages["400"]
    assert len(messages) == 3 and len(set(messages)) == 3, messages
    assert all(m.startswith("node_ids: unknown node ") for m in messages)


def test_latency_runs_from_the_scheduled_arrival_and_load_stays_open_loop():
    res = load("slow", rate=300, duration_s=0.5, keep_latencies=True)
    # each answer takes 30 ms while requests arrive every ~3 ms: many are in flight at
    # once (an open loop never waits for answers), and none is faster than the server
    assert res.ok == res.sent and res.p50_ms >= 30
    assert len(res.latencies_ms) == res.sent


def test_requests_never_answered_fail_after_the_timeout():
    res = load("hang", rate=50, duration_s=0.2, timeout_s=0.5)
    assert res.ok == 0 and res.errors == res.sent > 0
    assert res.connect_errors == 0  # the connections opened; the server never answered
    assert res.error_messages == {"-1": ["no answer within 0.5 s of the last arrival"]}


def test_connections_that_cannot_open_are_counted_as_the_clients_limit():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = asyncio.run(run_load(f"http://127.0.0.1:{port}", "ok", num_nodes=100, rate=100, duration_s=0.2,
                               timeout_s=5))
    assert res.sent > 0 and res.ok == 0 and res.errors == res.connect_errors == res.sent
    assert list(res.error_messages) == ["-2"] and "refused" in res.error_messages["-2"][0].lower()
