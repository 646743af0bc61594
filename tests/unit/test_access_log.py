"""The access log (`serve --access-log`): one line per answer, written where the HTTP
connection writes it (driven here with a fake transport: no sockets), and only when asked
for; what a client sends cannot split or forge a line."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hybridgnn.cli.main import build_parser
from hybridgnn.serving.core.access import ACCESS_LOG, printable
from hybridgnn.serving.http.access import log_http, peer_of
from hybridgnn.serving.http.message import Message
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


def test_printable_cuts_long_text_and_escapes_control_characters():
    assert printable("a\tb\x7fc", 100) == "a\\x09b\\x7fc"
    assert printable("x" * 10, 4) == "xxxx..."
    assert printable("plain/path", 100) == "plain/path"


def test_peers_ipv6_and_unknown():
    assert peer_of(FakeTransport(("::1", 80, 0, 0))) == "[::1]:80"
    assert peer_of(FakeTransport(None)) == "-"

    class Gone(FakeTransport):
        def get_extra_info(self, name, default=None):
            raise RuntimeError("closed")

    assert peer_of(Gone()) == "-"


def test_an_http10_request_and_one_without_a_message(lines):
    msg = Message(0.0)
    msg.method, msg.url, msg.http10 = "GET", b"/x", True
    log_http(FakeTransport(), msg, 200, 10)
    log_http(FakeTransport(), None, 503, 99)
    one, two = lines()
    assert '"GET /x HTTP/1.0" 200 10 ' in one
    assert two == '10.1.2.3:4567 "-" 503 99 - -'


def test_the_flag_and_its_environment_variable(monkeypatch):
    serve = ["serve"]
    assert build_parser().parse_args(serve).access_log is False
    assert build_parser().parse_args([*serve, "--access-log"]).access_log is True
    monkeypatch.setenv("HYBRIDGNN_ACCESS_LOG", "1")
    assert build_parser().parse_args(serve).access_log is True
