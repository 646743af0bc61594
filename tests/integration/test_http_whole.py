"""A connection that reads one whole plain request at a time parses it without llhttp's
callbacks (serving/http/whole.py): whatever a client sends, in whatever pieces, the
connection answers exactly as it does when llhttp parses everything. No sockets (a
transport that records), but the HTTP connection itself, so it lives beside the protocol
tests."""

from __future__ import annotations

import asyncio
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.serving.http.protocol import Connection
from hybridgnn.serving.http.reply import Reply
from hybridgnn.serving.http.server import HttpServer
from hybridgnn.serving.http.whole import whole_request


class _Transport:
    def __init__(self):
        self.out: list[bytes] = []
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.out.append(b"<FIN>")

    def close(self) -> None:
        self.closed = True


class _EchoApi:
    """Answers every request with what the endpoint read of it."""

    draining = False

    def route(self, method: str, path: str):
        if path.startswith("/nope"):
            return Reply.error(404, f"no route for {path}")
        return (lambda request: Reply.json({"method": method, "path": path, "params": request.params,
                                            "headers": request.headers, "body": request.body.decode("latin-1")})), {}

    def internal_error(self, where: str, exc=None) -> Reply:
        return Reply.error(500, f"internal error in {where}")


class _SeenAll(set):
    def __contains__(self, head) -> bool:
        return True


_DATE = re.compile(rb"\r\nDate: [^\r]*")


def serve(reads: list[bytes], whole: bool, max_pipelined: int = 8) -> tuple[bytes, bool, bool]:
    """(everything written, with Date lines blanked; closed; lingering) after `reads`."""
    async def main():
        server = HttpServer(_EchoApi(), max_body_bytes=64, max_header_bytes=512, answers_per_turn=1 << 20,
                            max_pipelined=max_pipelined)
        if whole:
            server.whole._seen = _SeenAll()  # every head is parsed here from its first time
        else:
            server.whole.parse = lambda data: None
        conn, transport = Connection(server), _Transport()
        conn.connection_made(transport)
        for data in reads:
            conn.data_received(data)
        return _DATE.sub(b"\r\nDate: -", b"".join(transport.out)), transport.closed, bool(conn.lingering)

    return asyncio.run(main())


def request(method="POST", target="/infer", version="HTTP/1.1", fields=("Host: a",), body=b"", length="right"):
    lines = [f"{method} {target} {version}", *fields]
    if length == "right" and (body or method == "POST"):
        lines.append(f"Content-Length: {len(body)}")
    elif length not in ("right", "none"):
        lines.append(f"Content-Length: {length}")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body


def test_plain_requests_one_per_read_are_answered_as_llhttp_parses_them():
    reads = [request(body=b'{"a": 1}'), request(fields=("Host: a", "X-Id: 7", "Connection: keep-alive")),
             request("GET", "/x?y=1", body=b""), request(target="/nope"), request(body=b"abc")]
    assert serve(reads, True) == serve(reads, False)
    out = serve(reads, True)[0]
    assert out.count(b"HTTP/1.1 200 OK") == 4 and out.count(b"404 Not Found") == 1
    assert json.loads(out.split(b"\r\n\r\n")[1].split(b"HTTP/1.1")[0])["headers"] == {
        "host": "a", "content-length": "8"}


_FIELDS = st.lists(st.sampled_from(["Host: a", "Host: b", "X-Id: 1", "Content-Type: application/json",
                                    "Connection: close", "Connection: keep-alive", "Transfer-Encoding: chunked",
                                    "Expect: 100-continue", "Upgrade: h2c", "X: \x01", "X: caf\xe9",
                                    "Content-Length: 2", "X-Long: " + "v" * 600]), max_size=4)


@st.composite
def requests(draw) -> bytes:
    body = draw(st.binary(max_size=80))
    return request(method=draw(st.sampled_from(["POST"] * 6 + ["GET", "HEAD", "PUT"])),
                   target=draw(st.sampled_from(["/infer", "/infer", "/x?y=1", "/nope", "/a%20b", "*"])),
                   version=draw(st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0"])),
                   fields=["Host: a", *draw(_FIELDS)] if draw(st.integers(0, 9)) else draw(_FIELDS),
                   body=body, length=draw(st.sampled_from(["right"] * 6 + ["none", "0", "100", "x"])))


def reads_of(stream: list[bytes], each: bool, cuts: list[int]) -> list[bytes]:
    """The reads a client's stream arrives in: one request per read, or the whole stream
    cut at `cuts`."""
    if each:
        return stream
    data = b"".join(stream)
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if data[a:b]]


@settings(max_examples=400, deadline=None)
@given(stream=st.lists(requests(), min_size=1, max_size=5), each=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=4), pipelined=st.sampled_from([1, 8]))
def test_any_stream_in_any_pieces_is_answered_as_when_llhttp_parses_it_all(stream, each, cuts, pipelined):
    """Property: requests good and bad, one per read (as a client that waits for each answer
    sends them) or cut anywhere (partial, pipelined), get the same bytes, the same close and
    the same lingering as with llhttp alone."""
    reads = reads_of(stream, each, cuts)
    assert serve(reads, True, pipelined) == serve(reads, False, pipelined)


def test_a_client_whose_heads_never_repeat_is_left_to_llhttp_between_tries():
    """After WHOLE_MISSES reads in a row that whole.py could not take, a connection feeds
    the next WHOLE_REST to llhttp without asking it; every request is still answered."""
    from hybridgnn.serving.http import reading

    async def main():
        server = HttpServer(_EchoApi(), max_body_bytes=64, answers_per_turn=1 << 20)
        asked = []
        parse = server.whole.parse
        server.whole.parse = lambda data: asked.append(1) or parse(data)
        conn, transport = Connection(server), _Transport()
        conn.connection_made(transport)
        reads = reading.WHOLE_MISSES + reading.WHOLE_REST + 1
        for i in range(reads):
            conn.data_received(request(fields=("Host: a", f"X-Seq: {i}"), body=b"{}"))
        return len(asked), b"".join(transport.out).count(b"HTTP/1.1 200 OK"), reads

    asked, answered, reads = asyncio.run(main())
    assert answered == reads and asked == reading.WHOLE_MISSES + 1


def test_a_head_split_over_reads_then_whole_requests_then_blank_lines_are_bounded_as_by_llhttp():
    """A head that ended in a read counts no more against the next one's bound (as when
    llhttp begins the next message), however the requests before it were parsed."""
    reads = [b"GET /x HTTP/1.1\r\nHo", b"st: a\r\n\r\n", b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"] + [b"\r\n"] * 252
    assert serve(reads, True) == serve(reads, False)


def test_a_tracing_clients_request_id_near_the_head_bound_is_answered_as_llhttp_answers_it():
    """A head kept by its cut (a short request id) stands for a head whose id takes it to
    the bound only as far as whole.py's own measure allows: ids a byte apart, from well
    within the bound to past it, are each answered as llhttp answers them (200 up to the
    Connection's bound, then 431), whether or not the whole lane takes them."""
    def traced(rid: str) -> bytes:
        return request(fields=("Host: a", f"X-Request-Id: {rid}", "traceparent: 00-1-2-01"), body=b"{}")

    statuses, taken = [], []
    for length in range(400, 480):
        reads = [traced("r0"), traced("r" * length), traced("r1")]  # the first keeps the head's cut
        out = serve(reads, True)
        assert out == serve(reads, False), length
        statuses.append(re.findall(rb"HTTP/1\.1 (\d{3})", out[0])[1])
        taken.append(whole_request(traced("r" * length), 512, 64) is not None)
    # the range holds ids the whole lane takes, ids it leaves to llhttp that fit, and ids past the bound
    assert True in taken and False in taken and statuses.count(b"431") and \
        b"200" in statuses[taken.index(False):]


_TRACE_NAMES = st.tuples(st.sampled_from(["X-Request-Id", "x-request-id", "X-REQUEST-ID", "traceparent", "TraceParent",
                                          "X-Request-Ids"]), st.sampled_from([": ", ":", ":\t", " : "]))
_TRACE_VALUES = st.one_of(*[st.text(alphabet="ab1 \t-", max_size=8)] * 4,
                          st.sampled_from(["", "caf\xe9", "\x01", "a\r", "v" * 300, "v" * 420]))


@st.composite
def tracing_requests(draw) -> list[bytes]:
    """Requests of one tracing client: one head but for its per-request values (most of
    them), now and then another request."""
    shape = draw(st.lists(st.one_of(_TRACE_NAMES, _TRACE_NAMES, st.sampled_from(
        ["Host: b", "X-Id: 1", "Connection: close", "Connection: keep-alive", "Content-Length: 2"])), max_size=4))
    method = draw(st.sampled_from(["POST", "POST", "GET", "HEAD"]))
    length = draw(st.sampled_from(["right"] * 6 + ["none", "100"]))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        fields = [f if isinstance(f, str) else f"{f[0]}{f[1]}{draw(_TRACE_VALUES)}" for f in shape]
        if draw(st.integers(0, 5)) == 0:
            fields = ["X-Id: 2", *fields]  # another head
        out.append(request(method=method, fields=["Host: a", *fields], body=draw(st.binary(max_size=40)),
                           length=length))
    return out


@settings(max_examples=400, deadline=None)
@given(stream=tracing_requests(), each=st.booleans(),
       cuts=st.lists(st.integers(0, 600), max_size=3), pipelined=st.sampled_from([1, 8]))
def test_a_tracing_clients_stream_in_any_pieces_is_answered_as_when_llhttp_parses_it_all(stream, each, cuts,
                                                                                          pipelined):
    """Property: a tracing client's requests (X-Request-Id and traceparent in any case, any
    order, twice, empty, with blanks, obs-text or control bytes, long enough to pass the
    head's bound) beside plain ones, one per read or cut anywhere, get the same bytes, closes
    and lingering as with llhttp alone: a head kept by its cut answers with each request's
    own values, and never stands for a head the Connection would refuse."""
    reads = reads_of(stream, each, cuts)
    assert serve(reads, True, pipelined) == serve(reads, False, pipelined)
