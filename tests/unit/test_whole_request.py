"""A whole plain request parsed without llhttp's callbacks (serving/http/whole.py): what it
answers, what it leaves to llhttp, that llhttp parses what it answers the same way, and
its kept heads."""

from __future__ import annotations

import httptools
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridgnn.serving.http import whole
from hybridgnn.serving.http.whole import WHOLE_MAX_BYTES, WholeRequests, whole_request

BODY = b'{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [7]}]}'


def request(head: str = "POST /v2/models/m/infer HTTP/1.1", fields: list[str] | None = None,
            body: bytes = BODY, length: int | None = None) -> bytes:
    fields = ["Host: 127.0.0.1", "Content-Type: application/json"] if fields is None else fields
    if length is not None or body:
        fields = [*fields, f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join([head, *fields]) + "\r\n\r\n").encode() + body


def parse(data: bytes, max_header_bytes: int = 65536, max_body_bytes: int = 1 << 20):
    return whole_request(data, max_header_bytes, max_body_bytes)


def test_a_plain_request_is_parsed_whole():
    method, target, headers, body = parse(request(fields=["HOST:  127.0.0.1 ", "X-Trace:\ta b\t",
                                                          "Connection: Keep-Alive"]))
    assert (method, target, body) == ("POST", b"/v2/models/m/infer", BODY)
    assert headers == {"host": "127.0.0.1", "x-trace": "a b", "connection": "Keep-Alive",
                       "content-length": str(len(BODY))}
    assert parse(request("GET /health/ready?x=1 HTTP/1.1", body=b"")) == ("GET", b"/health/ready?x=1",
                                                                           {"host": "127.0.0.1",
                                                                            "content-type": "application/json"}, b"")


@pytest.mark.parametrize("data", [
    request()[:-1],  # the body is not all here
    request() + b"P",  # a second request begins
    request() + request(),  # two whole requests (pipelined): llhttp answers both
    request(fields=["Host: a", "Host: b"]),  # a field twice: the Connection joins or refuses them
    request(fields=["Content-Type: application/json"]),  # no Host
    request(fields=["Host: a", "Transfer-Encoding: chunked"]),
    request(fields=["Host: a", "Expect: 100-continue"]),
    request(fields=["Host: a", "Upgrade: websocket", "Connection: Upgrade"]),
    request(fields=["Host: a", "Connection: close"]),
    request(fields=["Host: a", "Proxy-Connection: close"]),
    request(fields=["Host: a", "Content-Length: 3"], body=b""),  # then a second Content-Length
    request(body=b"", length=5),  # a body still to come
    request(fields=["Host: a", "Content-Length: +5"], body=b"", length=None) + b"abcde",
    request("POST /v2/models/m/infer HTTP/1.0"),
    request("HEAD / HTTP/1.1", body=b""),
    request("PUT / HTTP/1.1"),
    request("POST http://host/v2 HTTP/1.1"),  # absolute form
    request("POST /a b HTTP/1.1"),
    request("POST /a\"b HTTP/1.1"),
    request("POST  / HTTP/1.1"),
    request(fields=["Host: a", "X: \x01"]),
    request(fields=["Host: a", "X: caf\xe9"]),  # obs-text: llhttp's to judge
    request(fields=["Host: a", " X: b"]),
    request(fields=["Host: a", "X : b"]),
    request(fields=["Host: a", "X"]),
    request(fields=["Host: a"] + [f"X-{i}: {i}" for i in range(whole.MAX_FIELDS)]),
    request(fields=["Host: a", "X: " + "b" * WHOLE_MAX_BYTES]),
    b"POST / HTTP/1.1\nHost: a\n\n",
    b"",
])
def test_anything_else_is_left_to_llhttp(data):
    assert parse(data) is None


def test_limits_leave_requests_near_them_to_the_connection():
    data = request()
    assert parse(data, max_body_bytes=len(BODY)) is not None
    assert parse(data, max_body_bytes=len(BODY) - 1) is None  # the Connection answers 413
    head = data.index(b"\r\n\r\n") + 4
    assert parse(data, max_header_bytes=head + 3) is not None
    assert parse(data, max_header_bytes=head + 2) is None  # near the bound: the Connection measures it


class _Recorder:
    """What llhttp parses, as the Connection reads it (names lower-case, values stripped)."""

    def __init__(self):
        self.messages: list[dict] = []
        self.current: dict | None = None

    def on_message_begin(self):
        self.current = {"url": b"", "headers": [], "body": b""}

    def on_url(self, url):
        self.current["url"] += url

    def on_header(self, name, value):
        self.current["headers"].append((name.decode("latin-1").lower(), value.decode("latin-1").strip(" \t")))

    def on_body(self, body):
        self.current["body"] += body

    def on_message_complete(self):
        self.messages.append(self.current)


def llhttp(data: bytes) -> tuple[list[dict], httptools.HttpRequestParser | None]:
    recorder = _Recorder()
    parser = httptools.HttpRequestParser(recorder)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        return recorder.messages, None
    return recorder.messages, parser


_SAFE_NAMES = st.sampled_from(["Content-Type", "X-Id", "Accept", "User-Agent", "X_y", "A!#$%&'*+.^`|~"])
_NAMES = st.one_of(_SAFE_NAMES, _SAFE_NAMES, _SAFE_NAMES, _SAFE_NAMES,
                   st.sampled_from(["Host", "host", "Content-Length", "Connection", "Transfer-Encoding", "Expect",
                                    "Upgrade", "Proxy-Connection", "X-Id"]))
_PLAIN = st.text(alphabet=" \t!#,-./0123456789:;=?ABCabc", max_size=12)
_ODD = st.text(alphabet=" \t\"keep-alivecloseidentity\x7f\x00\r\n\xe9", max_size=12)
_VALUES = st.one_of(_PLAIN, _PLAIN, _PLAIN, _PLAIN, _PLAIN, _ODD, st.sampled_from(["keep-alive", "Keep-Alive", "close", "chunked"]))


def mostly(usual, *others):
    """usual nine times in ten, else one of others."""
    return st.sampled_from([usual] * (9 * len(others)) + list(others))


@settings(max_examples=800, deadline=None)
@given(method=mostly("POST", "GET", "HEAD", "OPTIONS", "POS"),
       target=st.one_of(*[st.text(alphabet="/abc?=&%20-._~!$'()*+,;:@", max_size=10).map(lambda t: "/" + t)] * 9,
                        st.text(alphabet="/abc?=&%20-._~\"<>\\ ", max_size=10)),
       version=mostly("HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "http/1.1"),
       host=mostly(["Host: a"], ["host:127.0.0.1:80 "], []),
       fields=st.lists(st.tuples(_NAMES, _VALUES), max_size=4, unique_by=lambda f: f[0].lower()) | st.lists(
           st.tuples(_NAMES, _VALUES), max_size=3),
       length=mostly("right", "none", "short", "long", "text"),
       body=st.binary(max_size=20), sep=mostly(": ", ":", ":\t", " : "),
       tail=mostly(b"", b"GET / HTTP/1.1\r\n", b"\r\n"))
def test_what_it_parses_llhttp_parses_the_same_way(method, target, version, host, fields, length, body, sep, tail):
    """Property: whenever whole_request answers, llhttp parses exactly one request from the
    same bytes, with that method, target, header fields and body, keeping the connection
    alive: the Connection would have queued the very same request."""
    lines = [f"{method} {target} {version}", *host, *(f"{name}{sep}{value}" for name, value in fields)]
    lines += {"right": [f"Content-Length: {len(body)}"], "none": [], "short": [f"Content-Length: {max(0, len(body) - 1)}"],
              "long": [f"Content-Length: {len(body) + 1}"], "text": ["Content-Length: x"]}[length]
    data = "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body + tail
    found = parse(data)
    if found is None:
        return
    event("parsed whole")  # about one case in ten (--hypothesis-show-statistics)
    messages, parser = llhttp(data)
    assert parser is not None and len(messages) == 1, data
    method_, target_, headers, body_ = found
    message = messages[0]
    assert (method_, target_, body_) == (parser.get_method().decode(), message["url"], message["body"]), data
    assert headers == dict(message["headers"]) and len(message["headers"]) == len(headers), data
    assert parser.get_http_version() == "1.1" and parser.should_keep_alive(), data


def test_a_head_is_parsed_here_from_its_second_time_then_kept_and_all_stays_bounded(monkeypatch):
    requests = WholeRequests(65536, 1 << 20)
    expected = parse(request())
    calls = []
    real = whole.plain_head
    monkeypatch.setattr(whole, "plain_head", lambda *a: calls.append(1) or real(*a))
    assert requests.parse(request()) is None and not calls  # seen once: llhttp's
    first = requests.parse(request())
    again = requests.parse(request())
    assert first == again == expected and len(calls) == 1
    assert again[2] is first[2]  # one dict of fields per kept head: endpoints only read them
    other = request(body=BODY.replace(b"7", b"8"))  # same head, same length
    assert requests.parse(other)[3] == BODY.replace(b"7", b"8") and len(calls) == 1
    assert requests.parse(request() + b"x") is None  # a kept head, a body longer than its length
    assert requests.parse(request()[:-1]) is None
    closing = request(fields=["Host: a", "Connection: close"])
    assert [requests.parse(closing) for _ in range(4)] == [None] * 4 and len(calls) == 2  # kept as llhttp's
    monkeypatch.setattr(whole, "HEADS_KEPT", 4)
    monkeypatch.setattr(whole, "HEADS_SEEN", 8)
    for i in range(40):
        fresh = request(fields=[f"Host: {i}"])
        assert requests.parse(fresh) is None and requests.parse(fresh) is not None
        assert len(requests._kept) <= 4 and len(requests._seen) <= 8
    for i in range(40):  # heads that never repeat: each is llhttp's, and nothing grows
        assert requests.parse(request(fields=[f"Host: {i}", f"X-Request-Id: {i}"])) is None
        assert len(requests._seen) <= 8
    tight = WholeRequests(65536, len(BODY) - 1)  # the limits are the server's own
    assert [tight.parse(request()) for _ in range(3)] == [None] * 3
    long_head = request(fields=["Host: a", "X: " + "v" * whole.HEAD_KEPT_BYTES])
    assert parse(long_head) is not None
    assert [requests.parse(long_head) for _ in range(3)] == [None] * 3  # a long head is always llhttp's


_PER_REQUEST_NAMES = st.sampled_from(["X-Request-Id", "x-request-id", "X-REQUEST-ID", "traceparent", "Traceparent"])


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.tuples(st.one_of(_NAMES, _PER_REQUEST_NAMES), _VALUES), max_size=4),
       per_request=st.lists(st.tuples(_PER_REQUEST_NAMES, st.lists(_VALUES, min_size=3, max_size=3)),
                            min_size=1, max_size=2),
       sep=mostly(": ", ":", ":\t"), limit=mostly(65536, 120, 160))
def test_a_kept_head_with_other_per_request_values_parses_as_that_head_does(fields, per_request, sep, limit):
    """Property: WholeRequests.parse(data) is None or whole_request(data), over heads that
    differ only in the values of their per-request fields (a tracing client's ids): a kept
    head's fields never stand for another head's, whatever those values hold."""
    requests = WholeRequests(limit, 1 << 20)
    answered = 0
    for turn in range(3):
        lines = ["POST /v2/models/m/infer HTTP/1.1", "Host: a", *(f"{n}{sep}{v}" for n, v in fields),
                 *(f"{name}{sep}{values[turn]}" for name, values in per_request)]
        data = ("\r\n".join([*lines, f"Content-Length: {len(BODY)}"]) + "\r\n\r\n").encode("latin-1") + BODY
        for _ in range(2):  # the first of a head's key is llhttp's
            found = requests.parse(data)
            if found is not None:
                answered += 1
                assert found == whole_request(data, limit, 1 << 20), data
    event(f"answered {answered}")


def test_a_tracing_clients_heads_are_kept_by_their_form():
    """A client whose every head differs only in its request id (and Content-Length stays)
    is parsed here from its second request, each with its own id."""
    requests = WholeRequests(65536, 1 << 20)
    heads = [request(fields=["Host: a", f"X-Request-Id: r{i:04d}", f"traceparent: 00-{i:032x}-{i:016x}-01"])
             for i in range(5)]
    assert requests.parse(heads[0]) is None  # seen once: llhttp's
    for i, data in enumerate(heads[1:], 1):
        found = requests.parse(data)
        assert found == whole_request(data, 65536, 1 << 20)
        assert found[2]["x-request-id"] == f"r{i:04d}" and found[2]["traceparent"].endswith(f"{i:016x}-01")
    assert len(requests._kept_cut) == 1 and not requests._kept
    # an empty value, and one _HEAD would not take, read as the head says (or are llhttp's)
    assert requests.parse(request(fields=["Host: a", "X-Request-Id:", "traceparent: x"]))[2]["x-request-id"] == ""
    assert requests.parse(request(fields=["Host: a", "X-Request-Id: caf\xe9", "traceparent: x"])) is None
    two = request(fields=["Host: a", "X-Request-Id: 1", "X-Request-Id: 2", "traceparent: x"])
    assert [requests.parse(two) for _ in range(3)] == [None] * 3  # a field twice: the Connection's


def test_heads_kept_by_their_form_are_bounded(monkeypatch):
    monkeypatch.setattr(whole, "HEADS_KEPT", 4)
    monkeypatch.setattr(whole, "HEADS_SEEN", 8)
    requests = WholeRequests(65536, 1 << 20)
    for i in range(40):  # forty forms, each twice (with other ids)
        assert requests.parse(request(fields=[f"Host: {i}", "X-Request-Id: a"])) is None
        assert requests.parse(request(fields=[f"Host: {i}", "X-Request-Id: b"]))[2]["x-request-id"] == "b"
        assert len(requests._kept_cut) <= 4 and len(requests._seen) <= 8 and not requests._kept
