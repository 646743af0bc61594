"""The access log's lines (`serve --access-log`): what a line holds, and that what a
client sends cannot split or forge one. Driven through a real connection in
tests/integration/test_access_log.py."""

from __future__ import annotations

import logging

import pytest

from hybridgnn.cli.main import build_parser
from hybridgnn.serving.core.access import ACCESS_LOG, printable
from hybridgnn.serving.http.access import log_http, peer_of
from hybridgnn.serving.http.message import Message


class FakeTransport:
    """What the log reads of a transport: the peer's address."""

    def __init__(self, peer=("10.1.2.3", 4567)):
        self.peer = peer

    def get_extra_info(self, name, default=None):
        return self.peer if name == "peername" else default


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOG.name)
    return lambda: [r.getMessage() for r in caplog.records if r.name == ACCESS_LOG.name]


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


def test_a_front_ends_lines_name_the_access_logger_too():
    """With --frontends N each front end writes its own lines; they carry the logger's
    name as the engine's do (they once carried only `frontend-<i>:`), so a filter on
    `hybridgnn.access` finds every line."""
    from hybridgnn.serving.frontend import log_format

    record = logging.LogRecord(ACCESS_LOG.name, logging.INFO, __file__, 1, 'peer "-" 400 218 - -', None, None)
    line = logging.Formatter(log_format(1)).format(record)
    assert " INFO frontend-1 hybridgnn.access: peer " in line
