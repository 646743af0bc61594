"""The HTTP connection keeps the API's route per request target (serving/http/server.py
keep_route): a target seen before is answered by the same endpoint without asking the API
again, an endpoint that raises still gets a 500 on a kept route, and the table stays
bounded whatever targets a client makes up. No sockets (a transport that records), but
the HTTP connection itself, so it lives beside the protocol tests."""

from __future__ import annotations

import asyncio

from hybridgnn.serving.http import server as http_server
from hybridgnn.serving.http.protocol import Connection
from hybridgnn.serving.http.reply import Reply
from hybridgnn.serving.http.server import HttpServer
from tests.support.transport import RecordingTransport


class _Api:
    draining = False

    def __init__(self):
        self.asked: list[str] = []

    def route(self, method: str, path: str):
        self.asked.append(path)
        if path == "/boom":
            return self._boom, {}
        if path.startswith("/ok"):
            return (lambda request: Reply(200, b'{"ok": true}')), {"path": path}
        return Reply.error(404, f"no route for {path}")

    @staticmethod
    def _boom(request):
        raise RuntimeError("an endpoint's bug")

    def internal_error(self, where: str, exc=None) -> Reply:
        return Reply.error(500, f"internal error in {where}")


def _get(target: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % target


def _serve(requests: list[bytes]) -> tuple[_Api, list[bytes], HttpServer]:
    async def main():
        api = _Api()
        server = HttpServer(api, max_body_bytes=1 << 20, answers_per_turn=1 << 20)
        conn, transport = Connection(server), RecordingTransport()
        conn.connection_made(transport)
        for wire in requests:
            conn.data_received(wire)
        return api, transport.out, server

    return asyncio.run(main())


def test_a_target_seen_before_is_answered_without_asking_the_api_and_404s_are_asked_again():
    api, out, _ = _serve([_get(b"/ok?a=1"), _get(b"/ok?a=1"), _get(b"/ok?a=2"), _get(b"/nope"), _get(b"/nope")])
    assert [o.split(b"\r\n", 1)[0] for o in out] == [b"HTTP/1.1 200 OK"] * 3 + [b"HTTP/1.1 404 Not Found"] * 2
    assert api.asked == ["/ok", "/ok", "/nope", "/nope"]  # per target: a=2 is another one


def test_an_endpoint_that_raises_on_a_kept_route_is_answered_500():
    api, out, _ = _serve([_get(b"/boom"), _get(b"/boom")])
    assert api.asked == ["/boom"]
    assert [o.split(b"\r\n", 1)[0] for o in out] == [b"HTTP/1.1 500 Internal Server Error"] * 2
    assert b"internal error in GET /boom" in out[1]


def test_the_kept_routes_stay_bounded(monkeypatch):
    monkeypatch.setattr(http_server, "_ROUTES_KEPT", 8)
    long_target = b"/ok/" + b"x" * 300
    _, out, server = _serve([_get(b"/ok/%d" % i) for i in range(20)] + [_get(long_target)])
    assert len(out) == 21 and len(server.routes) <= 8
    assert ("GET", long_target) not in server.routes
