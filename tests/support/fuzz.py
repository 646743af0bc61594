"""Fuzzing the HTTP front end: what llhttp makes of a byte stream, raw exchanges over a
socket, a keep-alive client, the checks every answer must pass, and the hypothesis
generators of requests (KServe JSON and binary bodies, graph updates, mutated raw HTTP).

Shared by tests/integration/test_fuzz.py, tests/integration/test_http_corpus.py and
bench/fuzz.py. The server under test parses HTTP with httptools (llhttp), so the verdict
on a byte stream (how many requests it holds, whether it is rejected) is computed here with
httptools itself plus the server's own stricter rules (docs/architecture.md, README "HTTP
API", serving/http/protocol.py): an HTTP version llhttp takes but the server does not
speak (0.9, 2.0) is a 505, an HTTP/1.1 request without exactly one Host header a 400, a
declared body over max_body_bytes a 413, a transfer coding other than chunked alone a 400,
an Expect other than 100-continue a 417, a request head over 64 KiB or of more than 100
header fields a 431; each closes the connection. Nothing here hard-codes a verdict.

Graph-update cases never change what an existing node answers: every update that can
apply only adds new nodes, joined to each other (ids -1 .. -a) and to nothing else; every
other id they name is one no graph here has (>= BAD_ID) or a negative one the server
refuses, so a good request answers the same before and after any number of cases.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from dataclasses import dataclass, field

import httptools
from hypothesis import strategies as st

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100  # http/message.MAX_HEADER_FIELDS
MAX_BODY_BYTES = 16 * 1024 * 1024  # ServerConfig.max_body_bytes' default
HEADER_LENGTH = "Inference-Header-Content-Length"
BAD_ID = 10**7  # no node id the tests' graphs reach, even after every update a fuzz run adds
# Statuses an HTTP-level error may carry: any client error, or "not implemented" (a transfer
# coding) and "version not supported". Never 500 (a bug) nor 502-504.
PROTOCOL_ERRORS = frozenset(range(400, 500)) | {501, 505}


# --- what llhttp (and the server's own rules) make of a byte stream --------------------------
@dataclass(frozen=True)
class Verdict:
    """How a server on llhttp must treat one connection's bytes.

    requests: complete requests it must answer (in order). rejected: after those, exactly one
    more answer, an HTTP-level error, then the connection closes; status: that error's code
    where the server's own rule fixes it (505, 400 Host rule, 413, 417, 431), else None (any of
    PROTOCOL_ERRORS). close: the server must close the connection by itself after its answers
    (rejected, a request without keep-alive, an upgrade). pending: the bytes end inside a
    request (a client that half-closes then gets no answer to it, or a 400)."""

    requests: int
    rejected: bool
    close: bool
    pending: bool
    status: int | None
    reason: str
    urls: tuple[bytes, ...] = ()

    @property
    def answers(self) -> int:
        return self.requests + (1 if self.rejected else 0)

    def describe(self) -> str:
        what = f"{self.requests} request(s)"
        if self.rejected:
            what += f", then rejected ({self.status or 'protocol error'}: {self.reason})"
        elif self.close:
            what += f", then close ({self.reason})"
        if self.pending:
            what += ", then an incomplete request"
        return what


class _Rule(Exception):
    """One of the server's own rules refused the request."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class _Tracker:
    """httptools callbacks: counts complete requests and applies the server's own rules."""

    def __init__(self, max_head_bytes: int, max_body_bytes: int):
        self.parser: httptools.HttpRequestParser | None = None
        self.max_head = max_head_bytes
        self.max_body = max_body_bytes
        self.complete = 0
        self.in_message = False
        self.in_head = False
        self.head_bytes = 0
        self.body_bytes = 0
        self.hosts = 0
        self.content_length: bytes | None = None
        self.expect: list[bytes] = []
        self.codings: list[bytes] = []
        self.fields = 0
        self.keep_alive = True  # of the last request whose head completed
        self.url = b""
        self.urls: list[bytes] = []

    def on_message_begin(self):
        self.in_message = self.in_head = True
        self.head_bytes = self.body_bytes = self.hosts = 0
        self.content_length = None
        self.expect: list[bytes] = []
        self.codings = []
        self.fields = 0
        self.url = b""

    def on_url(self, url: bytes):
        self.url += url

    def on_header(self, name: bytes, value: bytes):
        self.fields += 1
        if self.fields > MAX_HEADER_FIELDS:
            raise _Rule(431, f"more than {MAX_HEADER_FIELDS} header fields")
        lname = name.lower()
        if lname == b"transfer-encoding":
            self.codings.append(value.strip(b" \t"))
        elif lname == b"host":
            self.hosts += 1
        elif lname == b"content-length":
            self.content_length = value
        elif lname == b"expect":
            self.expect.append(value.strip(b" \t"))

    def on_headers_complete(self):
        self.in_head = False
        p = self.parser
        self.keep_alive = p.should_keep_alive()
        version = p.get_http_version()
        if version not in ("1.0", "1.1"):
            raise _Rule(505, f"HTTP/{version} (llhttp takes it; the server speaks 1.0 and 1.1)")
        if version == "1.1" and self.hosts != 1:
            raise _Rule(400, f"HTTP/1.1 request with {self.hosts} Host headers")
        if self.content_length is not None and int(self.content_length.strip(b" \t")) > self.max_body:
            raise _Rule(413, "declared body over max_body_bytes")
        if self.codings and b", ".join(self.codings).lower() != b"chunked":
            raise _Rule(400, f"Transfer-Encoding: {b', '.join(self.codings)[:40]!r} (only chunked)")
        if self.expect and b", ".join(self.expect).lower() != b"100-continue":
            raise _Rule(417, f"Expect: {b', '.join(self.expect)[:40]!r}")

    def on_body(self, body: bytes):
        self.body_bytes += len(body)
        if self.body_bytes > self.max_body:
            raise _Rule(413, "body over max_body_bytes")

    def on_message_complete(self):
        self.in_message = False
        self.complete += 1
        self.urls.append(self.url)


def llhttp_verdict(segments, *, max_head_bytes: int = MAX_HEAD_BYTES,
                   max_body_bytes: int = MAX_BODY_BYTES) -> Verdict:
    """The verdict on a connection that carries `segments` (bytes, or a list of them), from
    httptools.HttpRequestParser fed one byte at a time (so the head size is exact)."""
    data = segments if isinstance(segments, (bytes, bytearray)) else b"".join(segments)
    t = _Tracker(max_head_bytes, max_body_bytes)
    p = t.parser = httptools.HttpRequestParser(t)
    view = memoryview(bytes(data))

    def verdict(rejected=False, close=False, status=None, reason="", pending=None) -> Verdict:
        return Verdict(t.complete, rejected, close, t.in_message if pending is None else pending, status, reason,
                       tuple(t.urls))

    i, n = 0, len(view)
    while i < n:
        # one byte at a time through request heads (exact head sizes), bulk through bodies
        step = 1
        if t.in_message and not t.in_head and t.content_length is not None:
            # bulk through a Content-Length body, up to its end (the next head counts byte by byte);
            # chunked bodies go byte by byte too (the chunks fed here are small)
            left = int(t.content_length.strip(b" \t")) - t.body_bytes
            step = max(1, min(n - i, left, 65536))
        try:
            p.feed_data(view[i:i + step])
        except httptools.HttpParserUpgrade:
            return verdict(close=True, reason="upgrade (the bytes after it are not HTTP)", pending=False)
        except httptools.HttpParserCallbackError as exc:
            rule = exc.__context__ if isinstance(exc.__context__, _Rule) else exc.__cause__
            if isinstance(rule, _Rule):
                return verdict(rejected=True, close=True, status=rule.status, reason=str(rule), pending=False)
            raise
        except httptools.HttpParserError as exc:
            if t.complete and not t.in_message and not t.keep_alive:
                # llhttp refuses data after a request without keep-alive: the server answers
                # that request and closes; the rest is never read as a request.
                return verdict(close=True, reason="request without keep-alive, data after it ignored", pending=False)
            return verdict(rejected=True, close=True, reason=f"llhttp: {exc}", pending=False)
        if t.in_head and t.in_message:
            t.head_bytes += step
            if t.head_bytes > max_head_bytes:
                return verdict(rejected=True, close=True, status=431, reason="request head over 64 KiB",
                               pending=False)
        i += step
    if t.complete and not t.in_message and not t.keep_alive:
        return verdict(close=True, reason="request without keep-alive")
    return verdict()


# --- answers -------------------------------------------------------------------------------
@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]  # names lower-case, in order
    body: bytes
    elapsed_s: float  # since the request (or the exchange) started

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def json(self):
        return json.loads(self.body)


class ResponseReader:
    """Feeds bytes to an httptools response parser and collects the responses."""

    def __init__(self, started: float):
        self.started = started
        self.responses: list[Response] = []
        self.error: str | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self.in_message = False

    def on_message_begin(self):
        self.in_message = True
        self._headers, self._body = [], []

    def on_header(self, name: bytes, value: bytes):
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes):
        self._body.append(body)

    def on_message_complete(self):
        self.in_message = False
        self.responses.append(Response(self._parser.get_status_code(), self._headers, b"".join(self._body),
                                       time.monotonic() - self.started))

    def feed(self, data: bytes) -> None:
        if self.error is None:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self.error = f"unparsable response bytes: {exc}"


@dataclass
class Exchange:
    """What came back on one raw connection."""

    responses: list[Response]
    closed: bool  # the server closed (FIN or reset) before the deadline
    reset: bool
    error: str | None  # the server's bytes did not parse as HTTP responses
    sent_all: bool
    elapsed_s: float

    @property
    def final(self) -> list[Response]:
        """The final responses (interim 1xx left out)."""
        return [r for r in self.responses if r.status >= 200]


def exchange(host: str, port: int, segments, *, half_close: bool, deadline_s: float = 5.0,
             pause_s: float = 0.05) -> Exchange:
    """Send `segments` on a new connection (pausing pause_s between segments, so each arrives
    in a read of its own), optionally half-close, then read until the server closes or the
    deadline passes."""
    if isinstance(segments, (bytes, bytearray)):
        segments = [segments]
    started = time.monotonic()
    end = started + deadline_s
    reader = ResponseReader(started)
    closed = reset = False
    sent_all = True
    with socket.create_connection((host, port), timeout=deadline_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for k, seg in enumerate(segments):
                if k:
                    time.sleep(pause_s)  # part of the input: the next segment in a later packet
                sock.sendall(seg)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed early (after an error answer): read what it sent
            sent_all = False
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except (TimeoutError, socket.timeout):
                break
            except ConnectionResetError:
                closed = reset = True
                break
            if not data:
                closed = True
                break
            reader.feed(data)
    return Exchange(reader.responses, closed, reset, reader.error, sent_all, time.monotonic() - started)


def answer_problems(r: Response, *, allowed_5xx=frozenset()) -> list[str]:
    """What is wrong with one answer: a 5xx (other than those allowed), or an error whose body
    is not JSON {"error": "..."}."""
    out = []
    if r.status >= 500 and r.status not in allowed_5xx:
        out.append(f"{r.status} answer: {r.body[:200]!r}")
    if r.status >= 400:
        ctype = (r.header("content-type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            out.append(f"{r.status} error with Content-Type {ctype!r}")
        try:
            obj = json.loads(r.body)
        except ValueError:
            out.append(f"{r.status} error body is not JSON: {r.body[:200]!r}")
        else:
            if not isinstance(obj, dict) or not isinstance(obj.get("error"), str):
                out.append(f"{r.status} error body lacks an 'error' string: {r.body[:200]!r}")
    return out


def exchange_problems(v: Verdict, ex: Exchange, *, require_close: bool) -> list[str]:
    """Check a raw exchange against the llhttp verdict: as many answers as llhttp saw
    requests (and one error after them when it rejected the bytes), every answer well formed,
    the connection closed when the verdict says so (require_close: the client did not
    half-close, so the server had to close by itself)."""
    out = []
    if ex.error:
        out.append(ex.error)
    final = ex.final
    n, want = len(final), v.answers
    # A client that half-closes inside a request may get a 400 for the truncated request.
    extra_400 = v.pending and not v.rejected and n == want + 1 and final[-1].status == 400
    if n != want and not extra_400:
        out.append(f"{n} answer(s) {[r.status for r in final]}; llhttp: {v.describe()}")
    elif v.rejected:
        last = final[-1]
        if v.status is not None and last.status != v.status:
            out.append(f"rejected ({v.reason}) with {last.status}, expected {v.status}")
        elif last.status not in PROTOCOL_ERRORS:
            out.append(f"rejected ({v.reason}) but answered {last.status}")
    for r in ex.responses:
        out += answer_problems(r, allowed_5xx={501, 505})
    if require_close and v.close and not ex.closed:
        out.append(f"connection left open after {v.describe()}")
    return out


def problem_kind(problem: str) -> str:
    """A short category for one problem string of answer_problems / exchange_problems / run_case."""
    if re.match(r"5\d\d answer", problem):
        return "5xx"
    if " error with Content-Type" in problem or " error body " in problem:
        return "non_json_error"
    if problem.startswith(("answer after", "no answer within", "no close within")):
        return "slow"
    if "llhttp:" in problem and "answer(s)" in problem:
        return "desync"
    if problem.startswith("rejected "):
        return "wrong_error_status"
    if problem.startswith("connection left open"):
        return "left_open"
    if problem.startswith("unparsable response"):
        return "bad_response_bytes"
    return "no_answer" if "closed the connection" in problem or "Error" in problem else "other"


# --- a keep-alive client -------------------------------------------------------------------
class NoAnswer(Exception):
    """The server closed the connection, or sent nothing within the timeout."""


class KeepAliveClient:
    """HTTP/1.1 over one kept-alive socket (a new one after the server closes it); each
    request is sent exactly as given (lying headers included) and one answer is read."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.sock: socket.socket | None = None
        self.reader: ResponseReader | None = None
        self.connections = 0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _connect(self) -> None:
        self.close()
        self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = None
        self.connections += 1

    def request(self, method: str, path: str, body: bytes = b"", headers=()) -> Response:
        head = [f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in headers]
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        return self.send(b"".join(head) + body)

    def send(self, data: bytes) -> Response:
        """Send one complete request's bytes and return its (final) answer."""
        for attempt in (0, 1):
            fresh = self.sock is None
            if fresh:
                self._connect()
            started = time.monotonic()
            self.reader = ResponseReader(started)
            try:
                self.sock.sendall(data)
                return self._read_one(started)
            except (NoAnswer, OSError) as exc:
                got_bytes = self.reader.in_message or self.reader.responses
                self.close()
                if fresh or got_bytes or attempt:  # not a stale kept-alive socket: a real failure
                    if isinstance(exc, NoAnswer):
                        raise
                    raise NoAnswer(f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def _read_one(self, started: float) -> Response:
        reader, end = self.reader, started + self.timeout_s
        while True:
            final = [r for r in reader.responses if r.status >= 200]
            if final:
                r = final[0]
                if (r.header("connection") or "").lower() == "close":
                    self.close()
                return r
            if reader.error:
                self.close()
                raise NoAnswer(reader.error)
            left = end - time.monotonic()
            if left <= 0:
                raise NoAnswer(f"no answer within {self.timeout_s} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                raise NoAnswer(f"no answer within {self.timeout_s} s") from None
            if not data:
                raise NoAnswer("the server closed the connection without an answer")
            reader.feed(data)


# --- the server under test, and one case -------------------------------------------------------
@dataclass(frozen=True)
class Target:
    host: str
    port: int
    model: str
    num_nodes: int
    feature_dim: int
    token: str | None = None
    precomputed: bool = False  # the model has precomputed embeddings (mode=precomputed works)

    @property
    def infer_path(self) -> str:
        return f"/v2/models/{self.model}/infer"

    @property
    def graph_path(self) -> str:
        return f"/v2/models/{self.model}/graph"

    @classmethod
    def discover(cls, host: str, port: int, token: str | None = None, timeout_s: float = 10.0) -> "Target":
        """Ask a running server for its model's name, size and modes."""
        c = KeepAliveClient(host, port, timeout_s)
        try:
            name = c.request("GET", "/v2/models").json()["models"][0]["name"]
            params = c.request("GET", f"/v2/models/{name}").json()["parameters"]
        finally:
            c.close()
        return cls(host, port, name, int(params["num_nodes"]), int(params["feature_dim"]), token,
                   "precomputed" in params.get("modes", []))


@dataclass(frozen=True)
class Case:
    """One fuzz case: a request for the keep-alive client, or raw bytes (kind "raw") sent on a
    connection of their own."""

    kind: str
    method: str = "POST"
    path: str = ""
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    segments: tuple[bytes, ...] = ()
    note: str = ""

    def __repr__(self) -> str:  # what hypothesis prints for a failing case
        if self.kind == "raw":
            return f"Case(raw, {self.note!r}, {b''.join(self.segments)[:600]!r})"
        return (f"Case({self.kind}, {self.method} {self.path}, headers={list(self.headers)!r}, "
                f"body={self.body[:600]!r}{'...' if len(self.body) > 600 else ''}, {self.note!r})")


@dataclass
class Outcome:
    statuses: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    slowest_s: float = 0.0


def run_case(client: KeepAliveClient, target: Target, case: Case, *, timeout_s: float = 5.0) -> Outcome:
    """Send one case and check its answer(s): no 5xx (an HTTP-level 501/505 aside for raw
    bytes), every error a JSON {"error": ...}, each answer within timeout_s; for raw bytes,
    as many answers as llhttp saw requests."""
    out = Outcome()
    if case.kind == "raw":
        v = llhttp_verdict(case.segments)
        ex = exchange(target.host, target.port, case.segments, half_close=True, deadline_s=timeout_s, pause_s=0.0)
        out.statuses = [r.status for r in ex.final]
        out.slowest_s = max([r.elapsed_s for r in ex.responses], default=0.0)
        if not ex.closed:
            out.problems.append(f"no close within {timeout_s} s after the client half-closed ({v.describe()})")
            out.slowest_s = max(out.slowest_s, ex.elapsed_s)
        out.problems += exchange_problems(v, ex, require_close=False)
        return out
    try:
        r = client.request(case.method, case.path, case.body, case.headers)
    except NoAnswer as exc:
        out.problems.append(str(exc))
        out.slowest_s = timeout_s
        return out
    out.statuses.append(r.status)
    out.slowest_s = r.elapsed_s
    if r.elapsed_s > timeout_s:
        out.problems.append(f"answer after {r.elapsed_s:.2f} s")
    out.problems += answer_problems(r)
    return out


def good_case(target: Target) -> Case:
    """An inference that must answer 200, and the same before and after fuzzing."""
    ids = [0, 1, 2, 17, target.num_nodes - 1]
    body = {"id": "good", "inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}]}
    if target.precomputed:
        body["parameters"] = {"mode": "precomputed"}
    return Case("json", "POST", target.infer_path, json.dumps(body).encode(), note="good")


# --- generators ----------------------------------------------------------------------------
def _json_bytes(obj, ensure_ascii: bool = True) -> bytes:
    return json.dumps(obj, ensure_ascii=ensure_ascii, allow_nan=True).encode("utf-8", "surrogatepass")


_WEIRD_SCALARS = [None, True, False, 0, -1, 1.5, float("nan"), float("inf"), "", "1", "node_ids", [], {}, [[]],
                  2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, "\u0000", "\ud800",
                  "ñöđé_ids", "🙂" * 3]
_DATATYPES = ["INT64", "INT32", "UINT64", "FP32", "FP64", "FP16", "BYTES", "BOOL", "int64", "INT64 ", "", None, 64]
_BAD_MODES = ["full", "pe", "srpe", "telepathy", "", "SAMPLED", None, 1, True, ["sampled"], {"mode": "sampled"},
              "sampled\u0000", "précomputed"]
_BAD_SHAPES = [[], [0], [-1], [[1]], ["1"], [1.0], [True], [2**62], [2**31, 2**31], [2**63], [10**30], [1, 1, 1],
               None, 1, "x", {}]
_MUTATIONS_PER_CASE = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3]  # about a third of the cases stay valid


def _weird():
    return st.sampled_from(_WEIRD_SCALARS)


def _bad_infer_id(t: Target):
    return st.one_of(st.sampled_from([-1, BAD_ID, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                                      -(2**63), -(2**63) - 1, 10**40, -(10**40)]),
                     st.floats(allow_nan=True, allow_infinity=True), _weird())


def _bad_ids(t: Target):
    """Node ids no graph here has (or that the server must refuse): never an existing node."""
    return st.one_of(st.integers(BAD_ID, 2**63 - 1),
                     st.sampled_from([BAD_ID, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                                      -(2**63), -(2**63) - 1, -BAD_ID, 10**40]))


def _nested(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


def _pick_input(draw, obj) -> dict | None:
    inputs = obj.get("inputs") if isinstance(obj, dict) else None
    dicts = [i for i in inputs if isinstance(i, dict)] if isinstance(inputs, list) else []
    return draw(st.sampled_from(dicts)) if dicts else None


def _flat_list(inp: dict) -> list | None:
    """The input's data as a flat list one can edit in place (None if it is not a list)."""
    data = inp.get("data")
    if not isinstance(data, list):
        return None
    if data and all(isinstance(row, list) for row in data):
        flat = [x for row in data for x in row]
        inp["data"] = flat
        return flat
    return data


# --- mutations of a (valid) KServe request object: each edits obj in place or returns a new one
def _mut_value(draw, obj, t, bad):
    inp = _pick_input(draw, obj)
    flat = _flat_list(inp) if inp else None
    if flat:
        flat[draw(st.integers(0, len(flat) - 1))] = draw(bad)
    return obj


def _mut_name(draw, obj, t):
    inp = _pick_input(draw, obj)
    if inp is not None:
        inp["name"] = draw(st.sampled_from(["features", "edge_index", "NODE_IDS", "node_ids ", "nœuds", "",
                                            "node_ids\u0000", "add_edges", 7, None, ["node_ids"]]))
    return obj


def _mut_shape(draw, obj, t):
    inp = _pick_input(draw, obj)
    if inp is not None:
        shape = inp.get("shape")
        near = [[*shape[:-1], shape[-1] + 1], [*shape[:-1], max(shape[-1] - 1, 0)], list(reversed(shape)),
                [*shape, 1], [-x for x in shape]] if isinstance(shape, list) and shape and \
            all(isinstance(x, int) for x in shape) else []
        inp["shape"] = draw(st.sampled_from(near + _BAD_SHAPES))
    return obj


def _mut_datatype(draw, obj, t):
    inp = _pick_input(draw, obj)
    if inp is not None:
        inp["datatype"] = draw(st.sampled_from(_DATATYPES))
    return obj


def _mut_data(draw, obj, t):
    inp = _pick_input(draw, obj)
    if inp is not None:
        data = inp.get("data")
        inp["data"] = draw(st.sampled_from([_nested(data, 2), _nested(data, 40), _nested(data, 70), {"0": data},
                                            str(data), [data, data], [], [[]], [None], ["1"], [True], [1.5]]
                                           + _WEIRD_SCALARS))
    return obj


def _mut_drop(draw, obj, t):
    if draw(st.booleans()):
        inp = _pick_input(draw, obj)
        if inp is not None:
            inp.pop(draw(st.sampled_from(["name", "shape", "datatype", "data"])), None)
    elif isinstance(obj, dict):
        obj.pop(draw(st.sampled_from(["inputs", "parameters", "outputs", "id"])), None)
    return obj


def _mut_parameters(draw, obj, t):
    params = draw(st.fixed_dictionaries({}, optional={
        "mode": st.sampled_from(_BAD_MODES + ["sampled", "precomputed"]),
        "gamma": st.one_of(st.floats(-2, 2), st.floats(), _weird()),
        "policy": st.sampled_from(["ratio", "random", "degree", "x", None, 1]),
        "binary_data_output": st.one_of(st.booleans(), _weird()),
        "priority": _weird(), "timeout": _weird()}))
    obj["parameters"] = draw(st.one_of(st.just(params), st.just(params), st.just(params), _weird()))
    return obj


def _mut_outputs(draw, obj, t):
    outs = st.fixed_dictionaries({"name": st.sampled_from(["embeddings", "predictions", "logits", "", None, 1])},
                                 optional={"parameters": st.one_of(
                                     st.fixed_dictionaries({"binary_data": st.one_of(st.booleans(), _weird())}),
                                     _weird())})
    obj["outputs"] = draw(st.one_of(st.lists(st.one_of(outs, _weird()), max_size=4), _weird()))
    return obj


def _mut_request_id(draw, obj, t):
    obj["id"] = draw(st.one_of(st.text(max_size=40), _weird(), st.just({"nested": [1, 2]}), st.just("x" * 100_000)))
    return obj


def _mut_inputs(draw, obj, t):
    inputs = obj.get("inputs")
    if isinstance(inputs, list) and inputs and draw(st.booleans()):  # an input twice, or junk
        first = inputs[0]
        inputs.append(dict(first) if isinstance(first, dict) and draw(st.booleans()) else draw(_weird()))
    else:
        obj["inputs"] = draw(st.sampled_from([[], {}, "node_ids", None, [[]], [None], 1]))
    return obj


def _mut_binary_size(draw, obj, t):
    inp = _pick_input(draw, obj)
    if inp is not None:
        inp["parameters"] = draw(st.one_of(st.builds(lambda v: {"binary_data_size": v},
                                                     st.one_of(st.integers(-8, 64), _weird())), _weird()))
    return obj


def _mut_top(draw, obj, t):
    return draw(st.sampled_from([[obj], "inputs", 1, None, True, [], 1.5]))


def _infer_mutations(t: Target):
    return [lambda d, o, t: _mut_value(d, o, t, _bad_infer_id(t))] * 3 + [
        _mut_name, _mut_shape, _mut_shape, _mut_datatype, _mut_data, _mut_drop, _mut_parameters, _mut_parameters,
        _mut_outputs, _mut_request_id, _mut_inputs, _mut_binary_size, _mut_top]


@st.composite
def _valid_infer(draw, t: Target) -> dict:
    """A request the server answers 200: existing node ids, or (one in five) new query nodes."""
    if draw(st.integers(0, 4)) == 4:
        q, F = draw(st.integers(1, 3)), t.feature_dim
        feats = [[draw(st.floats(-3, 3, width=32)) for _ in range(F)] for _ in range(q)]
        edges = []
        for _ in range(draw(st.integers(0, 6))):
            new = t.num_nodes + draw(st.integers(0, q - 1))
            other = draw(st.one_of(st.integers(0, t.num_nodes - 1), st.integers(t.num_nodes, t.num_nodes + q - 1)))
            edges.append((new, other) if draw(st.booleans()) else (other, new))
        inputs = [{"name": "features", "shape": [q, F], "datatype": "FP32", "data": feats},
                  {"name": "edge_index", "shape": [2, len(edges)], "datatype": "INT64",
                   "data": [[e[0] for e in edges], [e[1] for e in edges]]}]
        params = draw(st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["full", "pe", "srpe", "sampled"]),
                                                           "gamma": st.floats(0, 1),
                                                           "policy": st.sampled_from(["ratio", "random", "degree"])}))
    else:
        ids = draw(st.lists(st.integers(0, t.num_nodes - 1), min_size=1, max_size=12))
        n = len(ids)
        shape = draw(st.sampled_from([[n], [n], [1, n], [n, 1]]))
        data = ids if draw(st.booleans()) or len(shape) == 1 else ([ids] if shape[0] == 1 else [[i] for i in ids])
        inputs = [{"name": "node_ids", "shape": shape, "datatype": draw(st.sampled_from(["INT64", "INT64", "INT32"])),
                   "data": data}]
        modes = ["sampled", "precomputed"] if t.precomputed else ["sampled"]
        params = draw(st.fixed_dictionaries({}, optional={"mode": st.sampled_from(modes)}))
    obj: dict = {"inputs": inputs}
    if draw(st.booleans()):
        params["binary_data_output"] = draw(st.booleans())
    if params:
        obj["parameters"] = params
    if draw(st.booleans()):
        obj["id"] = draw(st.text(max_size=20))
    if draw(st.integers(0, 3)) == 3:
        names = draw(st.lists(st.sampled_from(["logits", "embeddings", "predictions"]), min_size=1, max_size=3,
                                      unique=True))
        obj["outputs"] = [{"name": n, "parameters": {"binary_data": draw(st.booleans())}} if draw(st.booleans())
                          else {"name": n} for n in names]
    return obj


_TEXT_MUTATIONS = ["none"] * 30 + ["truncate", "insert", "bad_utf8", "deep_array", "deep_object", "huge_number",
                                   "huge_string", "nul", "bom", "duplicate_keys", "trailing"]


@st.composite
def _mutated_json(draw, obj) -> bytes:
    """obj as JSON text, now and then broken as text: truncated, stray bytes, invalid UTF-8,
    deep nesting, numbers of thousands of digits, a megabyte string, a BOM."""
    text = _json_bytes(obj, ensure_ascii=draw(st.booleans()))
    how = draw(st.sampled_from(_TEXT_MUTATIONS))
    if how == "none":
        return text
    if how == "truncate":
        return text[:draw(st.integers(0, max(len(text) - 1, 0)))]
    pos = draw(st.integers(0, len(text)))
    if how == "insert":
        return text[:pos] + draw(st.binary(min_size=1, max_size=8)) + text[pos:]
    if how == "bad_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]))
        return text[:pos] + bad + text[pos:]
    if how in ("deep_array", "deep_object"):
        depth = draw(st.sampled_from([64, 512, 1000, 1500, 5000, 20000, 100000]))
        deep = b"[" * depth + b"1" + b"]" * depth if how == "deep_array" else b'{"a":' * depth + b"1" + b"}" * depth
        return draw(st.sampled_from([
            b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":' + deep + b"}]}",
            b'{"inputs":' + deep + b"}",
            b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":[1]}],"parameters":' + deep + b"}",
            deep]))
    if how == "huge_number":
        digits = draw(st.sampled_from([20, 400, 4300, 4301, 5000, 100000]))
        number = b"9" * digits
        number = draw(st.sampled_from([number, b"-" + number, b"1e" + number, b"0." + number,
                                       b"1" + b"0" * digits + b".5"]))
        return b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":[' + number + b"]}]}"
    if how == "huge_string":
        return b'{"id":"' + b"x" * draw(st.sampled_from([1000, 1 << 20])) + b'",' + text[1:]
    if how == "nul":
        return text[:pos] + b"\x00" + text[pos:]
    if how == "bom":
        return b"\xef\xbb\xbf" + text
    if how == "duplicate_keys":
        return b'{"inputs":[],' + text[1:] if text.startswith(b"{") else text
    return text + draw(st.sampled_from([b" ", b"\n", b"x", b"{}", b"\x00", b"]"]))


def _mutate(draw, obj, mutations, t: Target):
    for _ in range(draw(st.sampled_from(_MUTATIONS_PER_CASE))):
        obj = draw(st.sampled_from(mutations))(draw, obj, t)
        if not isinstance(obj, dict):
            break
    return obj


@st.composite
def json_infer_cases(draw, t: Target) -> Case:
    """POST .../infer with a KServe JSON body: a valid request, or one wrong in ids, names,
    shapes, datatypes, data, missing fields, parameters (modes), outputs, nesting, size or
    encoding."""
    obj = _mutate(draw, draw(_valid_infer(t)), _infer_mutations(t), t)
    body = draw(_mutated_json(obj))
    headers = draw(st.sampled_from([(), ((b"Content-Type", b"application/json"),),
                                    ((b"Content-Type", b"text/plain; charset=utf-8"),),
                                    ((HEADER_LENGTH.encode(), b"0"),)] + [()] * 6))
    path = draw(st.sampled_from([t.infer_path] * 20 + [f"/v2/models/{t.model}/versions/1/infer",
                                                       "/v2/models/other/infer", f"/v2/models/{t.model}/infer?x=1",
                                                       f"/v2/models/{t.model}/infer/", "/v2/models//infer",
                                                       f"/v2/models/{t.model}%2Finfer", "/v2/models/%ff/infer"]))
    return Case("json", "POST", path, body, headers)


_LIE_STRINGS = ["", " ", "abc", "0x10", "1e3", "-0", "+5", " 5 ", "5, 5", "\u0665", "99999999999999999999999999",
                str(2**63), str(-(2**63)), "1.0", "NaN", "١٢", "0" * 50 + "7"]


@st.composite
def binary_infer_cases(draw, t: Target) -> Case:
    """POST .../infer with the binary tensor extension: valid, or with a lying
    Inference-Header-Content-Length, binary_data_size, tail length, datatype or shape."""
    ids = draw(st.lists(st.integers(0, t.num_nodes - 1), min_size=1, max_size=16))
    lies = set(draw(st.lists(st.sampled_from(["header_length", "header_length", "header_length", "size", "tail",
                                              "datatype", "shape", "ids", "twice", "header_twice", "no_header"]),
                             max_size=2)) if draw(st.integers(0, 2)) else [])
    if "ids" in lies:
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, t.num_nodes + BAD_ID, -(2**63),
                                                                          2**63 - 1]))
    dtype = draw(st.sampled_from(["INT64", "INT64", "INT32"]))
    if "datatype" in lies:
        dtype = draw(st.sampled_from(["UINT64", "FP32", "BYTES", "FP64", "int64"]))
    fmt = "<i" if dtype == "INT32" else "<f" if dtype == "FP32" else "<q"
    raw = b"".join(struct.pack("<f", float(v % 1000)) if fmt == "<f"
                   else struct.pack(fmt, (v + 2**31) % 2**32 - 2**31 if fmt == "<i" else v) for v in ids)
    if "tail" in lies:
        raw = draw(st.sampled_from([raw[:-1], raw[:-4], raw + b"\x01", raw + raw, b""]))
    size = len(raw)
    if "size" in lies:
        size = draw(st.one_of(st.integers(-8, len(raw) + 16), _weird()))
    shape = [len(ids)] if "shape" not in lies else draw(st.sampled_from([[len(ids) + 1], [2**62], [-1], [len(ids), 2]]))
    inp = {"name": "node_ids", "shape": shape, "datatype": dtype, "parameters": {"binary_data_size": size}}
    header = {"inputs": [inp, dict(inp)] if "twice" in lies else [inp]}
    if draw(st.booleans()):
        header["parameters"] = {"binary_data_output": draw(st.booleans())}
    if "twice" in lies:
        raw += raw
    hbytes = _json_bytes(header)
    body = hbytes + raw
    hl = str(len(hbytes))
    if "header_length" in lies:
        hl = draw(st.one_of(st.integers(-10, len(body) + 10).map(str), st.sampled_from(_LIE_STRINGS)))
    name = draw(st.sampled_from([HEADER_LENGTH.encode()] * 3 + [HEADER_LENGTH.lower().encode()]))
    headers: tuple = ((name, hl.encode()),)
    if "header_twice" in lies:
        headers += ((name, str(len(hbytes) + draw(st.integers(-3, 3))).encode()),)
    if "no_header" in lies:
        headers = ()
    return Case("binary", "POST", t.infer_path, body, headers)


# --- graph updates ------------------------------------------------------------------------------
def _mut_update_bad_id(draw, obj, t):
    return _mut_value(draw, obj, t, _bad_ids(t))


def _mut_update_add(draw, obj, t):
    """Add an input that refers only to ids no graph has (or to negative ones the server refuses)."""
    bad = _bad_ids(t)
    name = draw(st.sampled_from(["remove_edges", "remove_nodes", "update_ids", "add_edges"]))
    if name in ("remove_edges", "add_edges"):
        m = draw(st.integers(1, 3))
        inp = {"name": name, "datatype": "INT64", "shape": [m, 2], "data": [[draw(bad), draw(bad)] for _ in range(m)]}
    else:
        ids = draw(st.lists(bad, min_size=1, max_size=3))
        inp = {"name": name, "datatype": draw(st.sampled_from(["INT64", "INT32"])), "shape": [len(ids)], "data": ids}
    if isinstance(obj.get("inputs"), list):
        obj["inputs"].append(inp)
    return obj


def _mut_update_features(draw, obj, t):
    inp = _pick_input(draw, obj)
    flat = _flat_list(inp) if inp else None
    if flat and inp.get("datatype") == "FP32":
        flat[draw(st.integers(0, len(flat) - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                          1e39, "1.0", None, True]))
    elif inp is not None and isinstance(inp.get("shape"), list) and len(inp["shape"]) == 2:
        inp["shape"] = [inp["shape"][0], inp["shape"][1] + draw(st.sampled_from([-1, 1]))]  # the wrong width
    return obj


def _mut_update_duplicate(draw, obj, t):
    """An edge listed twice (or an input twice)."""
    inputs = obj.get("inputs")
    for inp in inputs if isinstance(inputs, list) else []:
        if isinstance(inp, dict) and inp.get("name") == "add_edges" and isinstance(inp.get("data"), list) \
                and inp["data"]:
            inp["data"].append(inp["data"][0])
            inp["shape"] = [len(inp["data"]), 2]
            return obj
    return _mut_inputs(draw, obj, t)


def _update_mutations(t: Target):
    return [_mut_update_bad_id, _mut_update_bad_id, _mut_update_add, _mut_update_add, _mut_update_features,
            _mut_update_duplicate, _mut_name, _mut_shape, _mut_datatype, _mut_data, _mut_drop, _mut_inputs,
            _mut_binary_size, _mut_top]


@st.composite
def _valid_update(draw, t: Target) -> dict:
    """1-3 new nodes, edges among them only, maybe new features for some of them."""
    a, F = draw(st.integers(1, 3)), t.feature_dim
    row = st.lists(st.floats(-100, 100, width=32), min_size=F, max_size=F)
    inputs = [{"name": "add_node_features", "datatype": "FP32", "shape": [a, F], "data": draw(st.lists(
        row, min_size=a, max_size=a))}]
    pairs = sorted(draw(st.sets(st.tuples(st.integers(-a, -1), st.integers(-a, -1)), max_size=4)))
    if pairs:
        inputs.append({"name": "add_edges", "datatype": draw(st.sampled_from(["INT64", "INT32"])),
                       "shape": [len(pairs), 2], "data": [list(p) for p in pairs]})
    if draw(st.integers(0, 3)) == 3:
        ids = sorted(draw(st.sets(st.integers(-a, -1), min_size=1)))
        inputs += [{"name": "update_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids},
                   {"name": "update_features", "datatype": "FP32", "shape": [len(ids), F],
                    "data": draw(st.lists(row, min_size=len(ids), max_size=len(ids)))}]
    return {"inputs": draw(st.permutations(inputs))}


@st.composite
def graph_update_cases(draw, t: Target) -> Case:
    """POST .../graph: updates that apply add only new nodes joined among themselves; the rest
    are refused (ids no graph has, edges twice, shapes, types, widths, NaN, auth, lying
    header lengths)."""
    obj = _mutate(draw, draw(_valid_update(t)), _update_mutations(t), t)
    body = draw(_mutated_json(obj))
    auth_value = f"Bearer {t.token}".encode() if t.token else b"Bearer none"
    headers: tuple = ((b"Authorization", auth_value),)
    if draw(st.integers(0, 7)) == 7:
        headers = draw(st.sampled_from([
            (), ((b"Authorization", b"Bearer"),), ((b"Authorization", b"Bearer wrong"),),
            ((b"Authorization", auth_value.lower()),), ((b"Authorization", auth_value + b" "),),
            ((b"Authorization", b"Basic " + auth_value),), ((b"Authorization", "Bearer tökén".encode()),),
            ((b"Authorization", auth_value), (b"Authorization", b"Bearer wrong"))]))
    if draw(st.integers(0, 9)) == 9:  # the binary extension's header length, lying
        headers += ((HEADER_LENGTH.encode(), draw(st.sampled_from(_LIE_STRINGS + [str(len(body) + 1)])).encode()),)
    return Case("graph", "POST", t.graph_path, body, headers)


def _raw_bases(t: Target) -> list[bytes]:
    host = b"Host: fuzz\r\n"  # not the port: the same bytes every run (derandomize)
    infer = _json_bytes({"inputs": [{"name": "node_ids", "shape": [2], "datatype": "INT64", "data": [1, 2]}]})
    header = _json_bytes({"inputs": [{"name": "node_ids", "shape": [2], "datatype": "INT64",
                                      "parameters": {"binary_data_size": 16}}]})
    binary = header + struct.pack("<qq", 3, 4)
    path = t.infer_path.encode()
    get = b"GET /v2/health/live HTTP/1.1\r\n" + host + b"\r\n"
    return [
        get,
        b"GET /v2/models/" + t.model.encode() + b" HTTP/1.1\r\n" + host + b"Accept: */*\r\n\r\n",
        b"POST " + path + b" HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(infer) + infer,
        b"POST " + path + b" HTTP/1.1\r\n" + host + b"Content-Length: %d\r\n%s: %d\r\n\r\n"
        % (len(binary), HEADER_LENGTH.encode(), len(header)) + binary,
        b"POST " + path + b" HTTP/1.1\r\n" + host + b"Transfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 10 + infer[:10] + b"\r\n" + b"%x;ext=1\r\n" % (len(infer) - 10) + infer[10:] + b"\r\n0\r\n\r\n",
        b"POST " + path + b" HTTP/1.1\r\n" + host + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n"
        % len(infer) + infer,
        get + get,
        b"GET /v2/health/ready HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + get,
    ]


_INSERTS = [b"\r", b"\n", b"\r\n", b"\x00", b" ", b"\t", b":", b"\r\n\r\n", b"\r\n ", b"\x7f", b"\xff", b"0", b"ff",
            b"-", b"+", b",", b";", b"Content-Length: 5\r\n", b"Content-Length: 99999999999\r\n",
            b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: identity\r\n", b"Host: x\r\n",
            b"Connection: close\r\n", b"Expect: 100-continue\r\n", b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
            b"HTTP/1.0", b"HTTP/2.0", b"%00", b"/../", b"?", b"#"]


@st.composite
def raw_http_cases(draw, t: Target) -> Case:
    """Mutations of valid requests' bytes (flip, insert, delete, duplicate, truncate, CRLF→LF,
    splice), sent on a connection of their own that the client then half-closes."""
    bases = _raw_bases(t)
    data = bytearray(draw(st.sampled_from(bases)))
    ops = draw(st.lists(st.sampled_from(["flip", "insert", "insert", "delete", "dup", "truncate", "lf", "cr",
                                         "splice", "case"]), min_size=1, max_size=4))
    for op in ops:
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(pos, len(data) - 1)] = draw(st.one_of(st.integers(0, 255), st.sampled_from(b"\r\n\x00 \t:;,")))
        elif op == "insert":
            data[pos:pos] = draw(st.one_of(st.sampled_from(_INSERTS), st.binary(min_size=1, max_size=4)))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "dup":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "lf":
            data = bytearray(bytes(data).replace(b"\r\n", b"\n", draw(st.integers(1, 3))))
        elif op == "cr":
            data = bytearray(bytes(data).replace(b"\r\n", b"\r", 1))
        elif op == "splice":
            data[pos:pos] = draw(st.sampled_from(bases))
        elif op == "case":
            data = bytearray(bytes(data[:pos]) + bytes(data[pos:pos + 20]).swapcase() + bytes(data[pos + 20:]))
    cut = draw(st.integers(0, len(data))) if draw(st.integers(0, 4)) == 4 else len(data)
    segments = tuple(s for s in (bytes(data[:cut]), bytes(data[cut:])) if s)
    return Case("raw", segments=segments, note="+".join(ops))


KINDS = {"json": json_infer_cases, "binary": binary_infer_cases, "graph": graph_update_cases, "raw": raw_http_cases}

