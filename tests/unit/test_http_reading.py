"""How a connection's reads become queued requests (serving/http/reading.py), on a
stand-in for the connection's state: no socket, no transport, no answers. Bounded as
the reading promises: the requests parsed ahead of their answers, a head, a chunked
body's trailer section; and whole.py asked only while it keeps taking reads."""

from __future__ import annotations

import collections

import httptools

from hybridgnn.serving.http.reading import WHOLE_MISSES, WHOLE_REST, RequestReader
from hybridgnn.serving.http.whole import WholeRequests


class _Server:
    def __init__(self, *, max_header_bytes: int = 64, max_pipelined: int = 2, max_body_bytes: int = 100):
        self.max_header_bytes = max_header_bytes
        self.head_step = max(1, max_header_bytes // 4)  # as HttpServer
        self.max_pipelined = max_pipelined
        self.max_body_bytes = max_body_bytes
        self.whole = WholeRequests(max_header_bytes, max_body_bytes)


class _Reader(RequestReader):
    """The connection state RequestReader reads and writes (protocol.Connection's)."""

    def __init__(self, server: _Server):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.msg = None
        self.queue = collections.deque()
        self.started = None
        self.head_bytes = 0
        self.in_head = True
        self.began = False
        self.after_chunk_size = False
        self.continue_owed = False
        self.fatal = None
        self.upgraded = False
        self.whole_misses = 0
        self.whole_rest = 0
        self.unfed = b""
        self.refused: list[tuple[int, str]] = []
        self.pauses = 0

    def _refuse(self, status: int, message: str) -> None:
        self.refused.append((status, message))

    def _pause_reading(self) -> None:
        self.pauses += 1


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: a\r\n\r\n".encode()


def test_requests_past_max_pipelined_wait_unparsed_and_all_come_in_order():
    reader = _Reader(_Server(max_pipelined=2))
    data = b"".join(_get(f"/{i}") for i in range(5))
    reader._parse(data)
    assert [m.url for m in reader.queue] == [b"/0", b"/1"] and reader.pauses == 1
    assert reader.unfed and data.endswith(reader.unfed) and len(reader.unfed) < len(data)
    urls = [m.url for m in reader.queue]
    while reader.unfed:  # as the connection does once the waiting ones are answered
        reader.queue.clear()
        more, reader.unfed = reader.unfed, b""
        reader._parse(more)
        urls += [m.url for m in reader.queue]
    assert urls == [f"/{i}".encode() for i in range(5)] and not reader.refused


def test_a_head_that_never_ends_is_refused_431_once_it_outlasts_the_bound():
    reader = _Reader(_Server(max_header_bytes=64))
    reader._parse(b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: " + b"x" * 40)
    assert reader.refused == []  # not yet past the bound
    reader._parse(b"x" * 60)
    assert reader.refused == [(431, "request head larger than 64 bytes")]


def test_a_chunked_bodys_trailer_fields_are_dropped_and_bounded():
    reader = _Reader(_Server(max_header_bytes=64))
    reader._parse(b"POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"3\r\nabc\r\n0\r\nX-Late: 1\r\n\r\n")
    (msg,) = reader.queue
    assert msg.body_bytes() == b"abc" and "x-late" not in msg.headers and msg.method == "POST"
    endless = _Reader(_Server(max_header_bytes=64))
    endless._parse(b"POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Late: " + b"y" * 200)
    assert endless.refused == [(431, "request trailer section larger than 64 bytes")]


def test_what_llhttp_refuses_is_a_400_and_an_upgrade_ends_the_reading():
    reader = _Reader(_Server())
    reader._parse(b"NOT HTTP AT ALL\r\n\r\n")
    assert [status for status, _ in reader.refused] == [400]
    assert reader.refused[0][1].startswith("malformed HTTP request: ")
    upgrade = _Reader(_Server(max_header_bytes=256))
    upgrade._parse(b"GET /u HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    assert upgrade.upgraded and upgrade.pauses == 1 and not upgrade.queue[-1].keep_alive


def test_whole_py_is_asked_until_it_misses_WHOLE_MISSES_reads_in_a_row():
    reader = _Reader(_Server(max_header_bytes=1024))
    assert reader._whole(_get("/a")) is None  # a head seen the first time is llhttp's
    msg = reader._whole(_get("/a"))  # its second sighting is taken whole
    assert (msg.method, msg.url, msg.headers["host"]) == ("GET", b"/a", "a") and reader.head_bytes == 0
    for _ in range(WHOLE_MISSES - 1):
        assert reader._whole(b"not a request") is None
    assert reader.whole_rest == 0 and reader.whole_misses == WHOLE_MISSES - 1
    assert reader._whole(b"not a request") is None
    assert (reader.whole_rest, reader.whole_misses) == (WHOLE_REST, 0)
