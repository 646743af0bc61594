"""The access log through the HTTP connection (`serve --access-log`): one line per
answer, written where the connection writes it, and only when asked for. Driven with a
fake transport (no sockets); the real server's lines are checked in test_grpc.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hybridgnn.serving.core.access import ACCESS_LOG
from hybridgnn.serving.http.protocol import Connection
from hybridgnn.serving.http.reply import Reply
from hybridgnn.serving.http.server import HttpServer


class FakeTransport:
    def __init__(self, peer=("10.1.2.3", 4567)):
        self.peer = peer
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return self.peer if name == "peername" else default

    def write(self, data):
        self.out += data

    def can_write_eof(self):
        return True

    def write_eof(self):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def close(self):
        self.closed = True

    def abort(self):
        self.closed = True

    def is_closing(self):
        return self.closed


class Answers:
    """A Routes API: 200 {"ok": true} at /ok, 404 elsewhere."""

    draining = False

    def route(self, method, path):
        if path == "/ok":
            return (lambda request: Reply(200, b'{"ok": true}')), {}
        return Reply.error(404, f"no route {path}")

    def internal_error(self, where, exc=None):
        return Reply.error(500, "internal server error")


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOG.name)
    return lambda: [r.getMessage() for r in caplog.records if r.name == ACCESS_LOG.name]


def _connection(access_log: bool, peer=("10.1.2.3", 4567)) -> tuple[Connection, FakeTransport]:
    server = HttpServer(Answers(), max_body_bytes=1 << 20, access_log=access_log)
    conn, transport = Connection(server), FakeTransport(peer)
    conn.connection_made(transport)
    return conn, transport


def _drive(conn: Connection, data: bytes) -> None:
    async def feed():  # the connection may arm timers on the running loop
        conn.data_received(data)

    asyncio.run(feed())


def test_each_answer_is_one_line_with_peer_request_status_bytes_time_and_request_id(lines):
    conn, transport = _connection(True)
    _drive(conn, b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Request-Id: r-17\r\n\r\n"
                 b"POST /nope?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    got = lines()
    assert len(got) == 2, got
    first, second = (line.split(" ") for line in got)
    assert first[:4] == ["10.1.2.3:4567", '"GET', "/ok", 'HTTP/1.1"'] and first[4] == "200"
    assert first[6].endswith("ms") and float(first[6][:-2]) >= 0 and first[7] == "r-17"
    assert second[:6] == ["10.1.2.3:4567", '"POST', "/nope?q=1", 'HTTP/1.1"', "404", second[5]]
    assert second[7] == "-"  # no X-Request-Id
    # the byte counts are what was written, in order
    assert int(first[5]) + int(second[5]) == len(transport.out)


def test_a_request_the_parser_refuses_is_logged_without_a_request_line(lines):
    conn, transport = _connection(True)
    _drive(conn, b"GARBAGE\r\n\r\n")
    [line] = lines()
    assert line.startswith('10.1.2.3:4567 "-" 400 ') and line.endswith(" - -")
    assert int(line.split(" ")[3]) == len(transport.out)


def test_nothing_is_logged_without_the_flag(lines):
    conn, _ = _connection(False)
    _drive(conn, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n")
    assert lines() == []


def test_a_client_cannot_split_or_forge_a_line(lines):
    conn, _ = _connection(True)
    # a forged tail in the request id (llhttp refuses quotes and control bytes in a target)
    _drive(conn, b'GET /ok\\x HTTP/1.1\r\nHost: x\r\nX-Request-Id: a" 200 9 1ms\tb\r\n\r\n')
    [line] = lines()
    assert line.count('"') == 2 and "\n" not in line
    assert '"GET /ok\\x5cx HTTP/1.1" 404' in line and line.endswith(" a\\x22 200 9 1ms\\x09b")


def test_a_tracing_clients_requests_each_log_their_own_request_id_when_their_head_is_kept(lines):
    """A head kept by its cut (whole.py: a tracing client's heads differ only in their
    X-Request-Id and traceparent values) is answered with the request's own values: each
    line names its request's id, never the kept head's or the one before it, and a plain
    request (no id, or an empty one) on the same connection logs none."""
    conn, transport = _connection(True)
    traced = [b"r-%d" % i for i in range(4)] + [b"\t a\tb \t", b"r-4"]
    reads = []
    for i, rid in enumerate(traced):
        reads.append(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + rid + b"\r\ntraceparent: 00-%032x-%016x-01\r\n\r\n"
                     % (i, i))
        reads.append(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Request-Id:"
                     b"\r\ntraceparent: 00-%032x-%016x-01\r\n\r\n" % (i, i))

    async def feed():  # one whole request per read, as a client that waits for each answer sends them
        for data in reads:
            conn.data_received(data)

    asyncio.run(feed())
    assert conn.server.whole._kept_cut  # the traced heads were parsed here from their second on
    ids = [line.split(" ")[-1] for line in lines()]
    assert ids == [x for rid in traced for x in (rid.strip(b" \t").decode().replace("\t", "\\x09"), "-")]
    assert transport.out.count(b"HTTP/1.1 200 OK") == len(reads)
