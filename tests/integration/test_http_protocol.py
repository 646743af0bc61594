"""The built-in HTTP/1.1 server (serving/http/) over real sockets on 127.0.0.1, with an
API of test endpoints: framing, keep-alive, pipelining, limits, errors, idle timeout, close."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridgnn.serving.http.api import Reply
from hybridgnn.serving.http.protocol import Connection
from hybridgnn.serving.http.server import HttpServer
from tests.support.transport import RecordingTransport


class _Engine:
    draining = False


class EchoApi:
    """route() like serving/api.Api: /echo (sync), /later?ms (a future), /async (a coroutine), /boom (raises)."""

    def __init__(self):
        self.engine = _Engine()
        self.shared = Reply.error(429, "one shared refusal", {"Retry-After": "1"})
        self.shared.shared = True

    @property
    def draining(self):  # as Api.draining: the server is shutting down
        return self.engine.draining

    def internal_error(self, where, exc=None):
        return Reply.json({"error": "internal server error", "request_id": "test"}, 500)

    def route(self, method, path):
        if path == "/echo":
            return (lambda req: Reply.json({"method": method, "body": req.body.decode("latin-1"),
                                            "headers": req.headers})), {}
        if path == "/later":
            return self._later, {}
        if path == "/async":
            return self._async, {}
        if path == "/waited":
            return (lambda req: Reply.json({"waited_s": req.waited_s, "body": req.body.decode("latin-1")})), {}
        if path == "/shared":
            return (lambda req: self.shared), {}
        if path == "/boom":
            return (lambda req: 1 / 0), {}
        return Reply.error(404, f"no such endpoint: {method} {path}")

    def _later(self, req):
        fut = asyncio.get_running_loop().create_future()
        delay = float(req.body or b"0.05")
        asyncio.get_running_loop().call_later(delay, fut.set_result, Reply.json({"slept": delay}))
        return fut

    async def _async(self, req):
        await asyncio.sleep(0.01)
        return Reply.json({"async": True})


async def read_response(reader: asyncio.StreamReader, head_only: bool = False):
    """(status, headers, body) of one response; the first line may be a 100 Continue."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    body = b"" if head_only else await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    return status, headers, body


def run(fn, **server_kwargs):
    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=server_kwargs.pop("max_body_bytes", 1000), **server_kwargs)
        await server.start("127.0.0.1", 0)
        try:
            return await fn(server)
        finally:
            close_opened()
            await server.close(1.0)

    return asyncio.run(main())


_opened: list[asyncio.StreamWriter] = []


def close_opened() -> None:
    """Close what connect() opened and a test left open, on the loop that opened it."""
    while _opened:
        _opened.pop().close()


async def connect(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    _opened.append(writer)
    return reader, writer


async def closed_by_server(reader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


def test_keep_alive_serves_many_requests_on_one_connection():
    async def go(server):
        reader, writer = await connect(server)
        for i in range(3):
            writer.write(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n{i}".encode())
            status, headers, body = await read_response(reader)
            assert status == 200 and json.loads(body)["body"] == str(i)
            assert headers["connection"] == "keep-alive" and headers["content-type"] == "application/json"
            assert "date" in headers
        writer.close()

    run(go)


def test_a_shared_reply_is_encoded_once_per_date_and_connection_mode():
    """A Reply marked shared answers many requests: its bytes are kept per Date second, and
    keep-alive, close and HEAD each get their own (the answer is otherwise the same)."""
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET /shared HTTP/1.1\r\nHost: t\r\n\r\n" * 2 + b"HEAD /shared HTTP/1.1\r\nHost: t\r\n\r\n"
                     + b"GET /shared HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        answers = [await read_response(reader) for _ in range(2)]
        head = await read_response(reader, head_only=True)
        last = await read_response(reader)
        for status, headers, body in answers + [last]:
            assert status == 429 and json.loads(body) == {"error": "one shared refusal"}
            assert headers["retry-after"] == "1" and "date" in headers
        assert [a[1]["connection"] for a in answers] == ["keep-alive"] * 2 and last[1]["connection"] == "close"
        assert head[0] == 429 and head[1]["content-length"] == str(len(answers[0][2]))
        assert await closed_by_server(reader)
        kept = {key[1:]: wire for key, wire in server._kept.items()}
        assert set(kept) <= {(True, False), (True, True), (False, False)} and (False, False) in kept
        writer.close()

    run(go)


def test_pipelined_requests_are_answered_in_order():
    async def go(server):
        reader, writer = await connect(server)
        # the first answer comes later than the second would: order must still hold
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\n0.1"
                     b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\nGET /async HTTP/1.1\r\nHost: t\r\n\r\n")
        first = await read_response(reader)
        second = await read_response(reader)
        third = await read_response(reader)
        assert json.loads(first[2]) == {"slept": 0.1}
        assert json.loads(second[2])["method"] == "GET"
        assert json.loads(third[2]) == {"async": True}
        writer.close()

    run(go)


def test_request_delivered_byte_by_byte():
    async def go(server):
        reader, writer = await connect(server)
        for b in b"POST /echo?x=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nX-Thing:  v \r\n\r\nhello":
            writer.write(bytes([b]))
            await writer.drain()
        status, _, body = await read_response(reader)
        out = json.loads(body)
        assert status == 200 and out["body"] == "hello" and out["headers"]["x-thing"] == "v"
        writer.close()

    run(go)


@pytest.mark.parametrize("pieces", [1, 7])
def test_chunked_body_with_extensions_and_trailers(pieces):
    async def go(server):
        reader, writer = await connect(server)
        raw = (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n"
               b"Authorization: Bearer late\r\n\r\n")
        step = max(1, len(raw) // pieces)
        for i in range(0, len(raw), step):
            writer.write(raw[i:i + step])
            await writer.drain()
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "hello 0123456789"
        # trailer fields are dropped: merged, a late Authorization passed for a header field
        assert set(json.loads(body)["headers"]) == {"host", "transfer-encoding"}
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")  # the connection is still usable
        assert (await read_response(reader))[0] == 200
        writer.close()

    run(go)


@pytest.mark.parametrize("raw,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET /echo HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET /ec\x01ho HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\n folded: x\r\n\r\n", 400),
    (b"GET echo HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    (b"GET /echo HTTP/2.0\r\n\r\n", 505),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    # a coding before chunked: the body would be read still coded (a gzip body as JSON)
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: magic\r\n\r\n", 417),
])
def test_malformed_requests_get_a_json_error_and_a_closed_connection(raw, status):
    async def go(server):
        reader, writer = await connect(server)
        writer.write(raw)
        got, headers, body = await read_response(reader)
        assert got == status and "error" in json.loads(body)
        assert headers["connection"] == "close"
        assert await closed_by_server(reader)
        # the server itself is fine
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()

    run(go)


def test_limits_431_and_413():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 431 and "head" in json.loads(body)["error"]
        assert await closed_by_server(reader)

        reader, writer = await connect(server)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"x" * 1000)
        status, _, body = await read_response(reader)
        assert status == 413 and "limit 1000 bytes" in json.loads(body)["error"]
        writer.write(b"x" * 4000)  # the rest of the declared body is taken in, then the server closes
        assert await closed_by_server(reader)

        reader, writer = await connect(server)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + b"3E8\r\n" + b"x" * 1000
                     + b"\r\n1\r\nx\r\n0\r\n\r\n")
        assert (await read_response(reader))[0] == 413

    run(go, max_header_bytes=4096)


def test_a_head_of_many_small_fields_is_431():
    """Each header field costs a parser callback (about 1.5 µs): a 60 KiB head of 10,000
    tiny fields held the event loop 15 ms, a hundred times what a body of that size costs.
    Past MAX_HEADER_FIELDS fields (Apache's default limit) a head is refused 431; one at
    the limit is served, trailers counted with it."""
    from hybridgnn.serving.http.message import MAX_HEADER_FIELDS

    async def go(server):
        fields = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS - 1))  # and Host
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and len(json.loads(body)["headers"]) == MAX_HEADER_FIELDS
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n" + fields + b"X-Last: v\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 431 and f"more than {MAX_HEADER_FIELDS} header fields" in json.loads(body)["error"]
        assert await closed_by_server(reader)
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n" + b"a: v\r\n" * 10_000 + b"\r\n")
        assert (await read_response(reader))[0] == 431

    run(go)


def test_expect_100_continue():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert line.startswith(b"HTTP/1.1 100 Continue")
        writer.write(b"body")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "body"

    run(go)


def test_an_http10_request_gets_no_100_continue():
    """RFC 9110 §10.1.1: a 100-continue expectation in an HTTP/1.0 request is ignored (an
    HTTP/1.0 client knows no interim answers: it would read the 100 as the final one)."""
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /echo HTTP/1.0\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.3)
        writer.write(b"body")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "body"

    run(go)


def test_head_http10_connection_close_and_404():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, _ = await read_response(reader, head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        writer.write(b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = await read_response(reader)  # no HEAD body was sent before this answer
        assert status == 404 and json.loads(body) == {"error": "no such endpoint: GET /nope"}
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert (await read_response(reader))[1]["connection"] == "close"
        assert await closed_by_server(reader)

        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
        assert (await read_response(reader))[1]["connection"] == "close"
        assert await closed_by_server(reader)

        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert (await read_response(reader))[1]["connection"] == "keep-alive"
        writer.close()

    run(go)


def test_endpoint_error_is_a_500_and_the_connection_goes_on():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 500 and json.loads(body) == {"error": "internal server error", "request_id": "test"}
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()

    run(go)


def test_client_leaving_mid_request_and_half_close():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\n0.05")
        writer.close()  # gone before the answer
        reader, writer = await connect(server)
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\n0.05")
        writer.write_eof()  # half-close: the answer still comes, then the server closes
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body) == {"slept": 0.05}
        assert await closed_by_server(reader)
        assert not any(c.busy for c in server.connections)

    run(go)


def test_idle_connections_are_closed():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert await closed_by_server(reader)  # then idle past idle_timeout_s

    run(go, idle_timeout_s=0.2)


def test_draining_says_connection_close_and_close_answers_in_flight():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\n0.2")
        deadline = asyncio.get_running_loop().time() + 5
        while not any(c.busy for c in server.connections):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        port = server.port
        server.api.engine.draining = True
        closing = asyncio.ensure_future(server.close(2.0))
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        await closing
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(go)


def test_requests_pipelined_behind_one_in_flight_when_draining_begins_are_all_answered():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\n0.2"
                     b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\nGET /async HTTP/1.1\r\nHost: t\r\n\r\n")
        deadline = asyncio.get_running_loop().time() + 5
        while not any(len(c.queue) == 2 for c in server.connections):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        server.api.engine.draining = True
        answers = [await read_response(reader) for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert [h["connection"] for _, h, _ in answers] == ["keep-alive", "keep-alive", "close"]
        assert json.loads(answers[2][2]) == {"async": True}
        assert await closed_by_server(reader)

    run(go)


def test_bare_lf_in_the_head_is_refused_not_desynced():
    """A Content-Length after a bare LF must not be skipped (the body answered as a second request)."""
    async def go(server):
        reader, writer = await connect(server)
        smuggled = b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n"
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
        status, headers, body = await read_response(reader)
        assert status == 400 and "error" in json.loads(body) and headers["connection"] == "close"
        assert await closed_by_server(reader)  # and no second answer

    run(go)


def test_absolute_form_target_is_served():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET http://t/echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.close()

    run(go)


def test_a_trickled_request_times_out_however_often_bytes_come():
    async def go(server):
        reader, writer = await connect(server)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        head = b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200
        answered = asyncio.ensure_future(read_response(reader))
        for b in head:  # a byte every 10 ms: each would have reset an idle timer
            if answered.done():
                break
            writer.write(bytes([b]))
            await asyncio.sleep(0.01)
        status, headers, body = await answered
        assert status == 408 and "within" in json.loads(body)["error"] and headers["connection"] == "close"
        assert loop.time() - t0 < 0.3 + 1.0
        assert await closed_by_server(reader)

    run(go, request_timeout_s=0.3)


def test_connections_past_the_cap_get_503_and_the_rest_are_served():
    async def go(server):
        held = [await connect(server) for _ in range(3)]
        deadline = asyncio.get_running_loop().time() + 5
        while len(server.connections) < 3:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        reader, writer = await connect(server)
        status, headers, body = await read_response(reader)
        assert status == 503 and int(headers["retry-after"]) >= 1 and "too many connections" in json.loads(body)["error"]
        assert await closed_by_server(reader)
        r0, w0 = held[0]
        w0.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(r0))[0] == 200
        for _, w in held:
            w.close()
        assert server.refused_connections == 1 and refusals == [1]  # counted, and the metric told

    refusals = []
    run(go, max_connections=3, on_refused_connection=lambda: refusals.append(1))


def test_a_client_that_never_reads_does_not_grow_the_server():
    """Pipelined requests sent without reading answers: reading pauses, so what the server
    holds (parsed requests waiting, unanswered) stays bounded."""
    async def go(server):
        reader, writer = await connect(server)
        request = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 500\r\n\r\n" + b"x" * 500
        sent = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while loop.time() < deadline and sent < 64 << 20:
            writer.write(request * 256)
            sent += len(request) * 256
            try:
                await asyncio.wait_for(writer.drain(), 0.2)
            except asyncio.TimeoutError:
                break  # the server stopped reading: our send buffer is full
        conn = next(iter(server.connections))
        assert conn.read_paused
        assert len(conn.queue) <= server.max_pipelined + 256
        assert sent < 64 << 20, "the server kept reading everything"
        writer.transport.abort()

    run(go, max_body_bytes=1000)


def test_one_read_of_many_tiny_pipelined_requests_is_parsed_only_as_they_are_answered():
    """A read (up to 256 KB with uvloop) of thousands of tiny pipelined requests from a client
    that reads no answers: max_pipelined, and at most those of the one slice that got there,
    are parsed and held (a parsed request costs about twenty times its bytes: a 256 KB read
    held 2 MB); the rest waits as bytes and is answered, in order, once the client reads again."""
    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=1000, max_header_bytes=4096, answers_per_turn=1 << 20)
        conn, transport = Connection(server), RecordingTransport()
        conn.connection_made(transport)
        conn.pause_writing()  # the client reads nothing: its answers wait in the write buffer
        n = 8000
        conn.data_received(b"".join(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-I: %d\r\n\r\n" % i for i in range(n)))
        held = len(conn.queue)
        conn.resume_writing()
        return held, server.max_pipelined + server.head_step // 30, b"".join(transport.out), conn

    held, bound, out, conn = asyncio.run(main())
    assert held <= bound, f"{held} parsed requests held for a client that reads nothing"
    assert out.count(b"HTTP/1.1 200 OK") == 8000 and not conn.queue and not conn.unfed
    ids = [int(json.loads(part.split(b"\r\n\r\n", 1)[1])["headers"]["x-i"])
           for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert ids == list(range(8000))


def test_close_answers_requests_in_flight_past_the_deadline_with_503():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /later HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\n5.0")
        deadline = asyncio.get_running_loop().time() + 5
        while not any(c.busy for c in server.connections):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        await server.close(0.1)
        status, headers, body = await read_response(reader)
        assert status == 503 and headers["connection"] == "close" and int(headers["retry-after"]) >= 1
        assert "retry" in json.loads(body)["error"]
        assert await closed_by_server(reader)

    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=1000)
        await server.start("127.0.0.1", 0)
        try:
            await go(server)
        finally:
            close_opened()

    asyncio.run(main())


def test_an_upgrade_request_is_answered_as_plain_http_then_closed():
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n"
                     b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await closed_by_server(reader)

    run(go)


def test_many_small_pipelined_requests_in_one_read_are_not_a_large_head():
    """A single read holding hundreds of small requests (more than max_header_bytes) is not 431."""
    async def go(server):
        reader, writer = await connect(server)
        n = 3000  # ~100 KiB of heads in one write
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n" * n)
        for _ in range(n):
            assert (await read_response(reader))[0] == 200
        writer.close()

    run(go)


@pytest.mark.parametrize("opening, said", [
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: ", "head larger"),
    # a trailer field was held and grown in memory (quadratically in CPU) until the request timeout
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\nX-T: ",
     "trailer section larger"),
])
def test_a_never_ending_header_or_trailer_field_is_431(opening, said):
    async def go(server):
        reader, writer = await connect(server)
        writer.write(opening)
        for _ in range(20):
            writer.write(b"a" * 8192)
        status, _, body = await read_response(reader)
        assert status == 431 and said in json.loads(body)["error"]

    run(go, max_header_bytes=16 * 1024)


def test_a_chunked_body_of_many_chunks_is_not_a_large_trailer():
    async def go(server):
        reader, writer = await connect(server)
        chunks = b"".join(b"3\r\nabc\r\n" for _ in range(300))  # 3,000 bytes of chunk framing
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["body"] == "abc" * 300

    run(go, max_header_bytes=1024)


def test_past_the_turns_share_requests_wait_for_later_turns_and_all_are_answered():
    # One answer per turn of the loop: 40 connections sending at once are answered over
    # 40 turns, each its own answer, pipelined ones in order; the wait shows in waited_s.
    async def go(server):
        conns = [await connect(server) for _ in range(40)]
        for i, (_, writer) in enumerate(conns):
            writer.write(f"POST /waited HTTP/1.1\r\nHost: x\r\nContent-Length: {len(str(i))}\r\n\r\n{i}"
                         f"POST /waited HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz".encode())
        waits = []
        for i, (reader, writer) in enumerate(conns):
            for body in (str(i), "z"):
                status, _, raw = await read_response(reader)
                answer = json.loads(raw)
                assert status == 200 and answer["body"] == body
                waits.append(answer["waited_s"])
            writer.close()
        assert min(waits) >= 0.0 and max(waits) > 0.0
        assert not server.turns.waiting

    run(go, answers_per_turn=1)


def test_a_body_a_slow_link_brings_in_is_not_counted_as_waiting_for_the_server():
    """The front end's wait starts when the request has arrived whole: a body that took
    0.3 s to arrive on an idle server was counted as 0.3 s of waiting, and admission refused
    it (429) however often it was sent, whenever the upload outlasted the bound."""
    async def go(server):
        reader, writer = await connect(server)
        writer.write(b"POST /waited HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.3)  # the client's link, not the server: the rest comes later
        writer.write(b"world")
        status, _, raw = await read_response(reader)
        answer = json.loads(raw)
        assert status == 200 and answer["body"] == "helloworld"
        assert answer["waited_s"] < 0.1, answer
        writer.close()

    run(go)


def test_pipelined_requests_answered_at_once_take_turns_too():
    """Requests answered in the call (a lookup, an error) that one client pipelined in one
    read each spend the turn's share: a read of thousands of them was answered in one go
    (all of a 256 KiB read: 1,800 lookups held the loop 0.1 s per connection, and a flood
    on 25 connections kept a new client's request waiting 3 s). Past the share they wait
    for later turns, in order, and all are answered."""
    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=1000, answers_per_turn=4)
        conn, transport = Connection(server), RecordingTransport()
        conn.connection_made(transport)
        n = 200
        conn.data_received(b"".join(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-I: %d\r\n\r\n" % i for i in range(n)))
        at_once = b"".join(transport.out).count(b"HTTP/1.1 200 OK")
        deadline = asyncio.get_running_loop().time() + 5
        while b"".join(transport.out).count(b"HTTP/1.1 200 OK") < n:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0)  # a turn of the loop
        return at_once, b"".join(transport.out), server

    at_once, out, server = asyncio.run(main())
    assert at_once <= server.turns.per_turn, f"{at_once} answered in the call that read them"
    ids = [int(json.loads(part.split(b"\r\n\r\n", 1)[1])["headers"]["x-i"])
           for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert ids == list(range(200)) and not server.turns.waiting


def test_a_request_behind_a_pipelining_client_waits_for_one_of_its_answers_not_all():
    """Connections waiting for a turn are answered one request each in turn: a client that
    sends one request while another has hundreds pipelined is answered after a few of
    theirs, not after the turn's whole share of them (it waited 0.1 s behind 25 such
    clients, and was refused 429 for its wait while they were served)."""
    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=1000, answers_per_turn=64)
        written: list[str] = []

        class Tagged(RecordingTransport):
            def __init__(self, tag):
                super().__init__()
                self.tag = tag

            def write(self, data):
                written.append(self.tag)

        flood, polite = Connection(server), Connection(server)
        flood.connection_made(Tagged("flood"))
        polite.connection_made(Tagged("polite"))
        server.turns.used = server.turns.per_turn  # this turn's share is spent: both wait for later ones
        flood.data_received(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n" * 300)
        polite.data_received(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        deadline = asyncio.get_running_loop().time() + 5
        while len(written) < 301:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0)
        return written

    written = asyncio.run(main())
    assert written.index("polite") <= 2, f"answered after {written.index('polite')} of the other's"


def test_a_closed_connection_is_freed_without_a_garbage_collection():
    # No reference cycle outlives a connection: under churn, closed connections must not
    # pile up until a full collection walks them all on the event loop.
    import gc
    import time

    from hybridgnn.serving.http.protocol import Connection

    async def go(server):
        gc.collect()
        gc.disable()
        try:
            for _ in range(20):
                reader, writer = await connect(server)
                writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_response(reader))[0] == 200
                writer.close()
                await writer.wait_closed()
            deadline = time.monotonic() + 5
            while server.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # poll interval; bounded by the deadline
            return sum(type(o) is Connection for o in gc.get_objects())
        finally:
            gc.enable()

    assert run(go) == 0


def test_a_chunked_body_of_tiny_chunks_is_held_as_its_bytes():
    """A body sent as thousands of two-byte chunks (llhttp calls on_body once per chunk)
    is held at about its own size, not as one bytes object per chunk (about twenty times
    its size: 16 MiB bodies so held would take some 400 MB per connection)."""
    import tracemalloc

    async def main():
        server = HttpServer(EchoApi(), max_body_bytes=1 << 20)
        conn, transport = Connection(server), RecordingTransport()
        conn.connection_made(transport)
        conn.data_received(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunks = b"2\r\nab\r\n" * 4096
        tracemalloc.start()
        try:
            for _ in range(64):  # 512 KiB of body in 256k chunks
                conn.data_received(chunks)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        conn.data_received(b"0\r\n\r\n")
        return held, b"".join(transport.out)

    held, out = asyncio.run(main())
    assert held < 3 * (512 << 10), f"{held} bytes held for a 512 KiB body"
    status, body = out.split(b"\r\n", 1)[0], out.split(b"\r\n\r\n", 1)[1]
    assert b"200" in status and json.loads(body)["body"] == "ab" * (256 << 10)
