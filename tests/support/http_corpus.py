"""Raw-socket request-smuggling and abuse payloads for the HTTP front end.

Each payload is the bytes one connection carries (one or more segments, sent with a pause
between them so each reaches the server in a read of its own). No verdict is written here:
tests/integration/test_http_corpus.py computes each one with httptools (llhttp) plus the
server's own rules (tests.support.fuzz.llhttp_verdict). `python -m tests.support.http_corpus`
prints the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = b"Host: corpus\r\n"
LIVE = b"GET /v2/health/live HTTP/1.1\r\n"
INFER_PATH = b"/v2/models/hybridgnn/infer"
INFER = b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":[1]}]}'
SMUGGLED = b"GET /smuggled HTTP/1.1\r\n" + HOST + b"\r\n"


@dataclass(frozen=True)
class Payload:
    name: str
    segments: tuple[bytes, ...]
    # None: the client half-closes only where the verdict leaves the connection open (so the
    # server must close by itself after an error); True: always (a 413 before the body).
    half_close: bool | None = None

    @property
    def data(self) -> bytes:
        return b"".join(self.segments)


def _p(name: str, *segments: bytes, half_close: bool | None = None) -> Payload:
    return Payload(name, tuple(segments), half_close)


def get(*headers: bytes, line: bytes = LIVE) -> bytes:
    return line + b"".join(headers) + b"\r\n"


def post(*headers: bytes, body: bytes = INFER, line: bytes = b"POST " + INFER_PATH + b" HTTP/1.1\r\n") -> bytes:
    return line + b"".join(headers) + b"\r\n" + body


def cl(n: int | bytes) -> bytes:
    return b"Content-Length: " + (n if isinstance(n, bytes) else str(n).encode()) + b"\r\n"


def chunked(body: bytes = INFER) -> bytes:
    return b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


TE = b"Transfer-Encoding: chunked\r\n"

CORPUS: list[Payload] = [
    # --- controls: well-formed requests ---------------------------------------------------
    _p("ok-get", get(HOST)),
    _p("ok-pipelined-3", get(HOST) * 3),
    _p("ok-post-content-length", post(HOST, cl(len(INFER)))),
    _p("ok-post-chunked", post(HOST, TE, body=chunked())),
    _p("ok-leading-crlf", b"\r\n" + get(HOST)),
    _p("ok-http10-no-host", get(line=b"GET /v2/health/live HTTP/1.0\r\n")),
    _p("ok-http10-keepalive-pipelined", get(b"Connection: keep-alive\r\n", line=b"GET /v2/health/live HTTP/1.0\r\n")
       + get(HOST)),
    _p("ok-host-empty", get(b"Host:\r\n")),
    _p("ok-absolute-form", get(HOST, line=b"GET http://corpus/v2/health/live HTTP/1.1\r\n")),
    _p("ok-asterisk-options", get(HOST, line=b"OPTIONS * HTTP/1.1\r\n")),
    _p("ok-te-uppercase-chunked", post(HOST, b"Transfer-Encoding: CHUNKED\r\n", body=chunked())),
    _p("ok-te-gzip-chunked", post(HOST, b"Transfer-Encoding: gzip, chunked\r\n", body=chunked())),
    _p("ok-get-with-body-pipelined", get(HOST, cl(5)) + b"hello" + get(HOST)),
    _p("ok-empty-connection", b"", half_close=True),
    # --- bare LF / bare CR ---------------------------------------------------------------------
    _p("bare-lf-request-line", b"GET /v2/health/live HTTP/1.1\n" + HOST + b"\r\n"),
    _p("bare-lf-header-line", LIVE + b"Host: corpus\nX-A: b\r\n\r\n"),
    _p("bare-lf-everywhere", b"GET /v2/health/live HTTP/1.1\nHost: corpus\n\n"),
    _p("bare-lf-end-of-head", LIVE + HOST + b"\n"),
    _p("bare-cr-request-line", b"GET /v2/health/live HTTP/1.1\r" + HOST + b"\r\n"),
    _p("bare-cr-in-header-value", get(HOST, b"X-A: a\rb\r\n")),
    _p("bare-cr-header-line-end", LIVE + b"Host: corpus\rX-A: b\r\n\r\n"),
    _p("lf-cr-swapped", b"GET /v2/health/live HTTP/1.1\n\rHost: corpus\n\r\n\r"),
    _p("bare-cr-smuggles-header", get(HOST, b"X-A: a\r" + cl(len(SMUGGLED))) + SMUGGLED),
    # --- Content-Length and Transfer-Encoding together ----------------------------------------
    _p("cl-te", post(HOST, cl(4), TE, body=b"0\r\n\r\n") + SMUGGLED),
    _p("te-cl", post(HOST, TE, cl(4), body=b"0\r\n\r\n") + SMUGGLED),
    _p("cl-te-classic-smuggle", post(HOST, cl(6), TE, body=b"0\r\n\r\nG") + get(HOST)),
    _p("te-cl-classic-smuggle", post(HOST, cl(3), TE, body=b"8\r\nSMUGGLED\r\n0\r\n\r\n")),
    _p("cl-zero-te", post(HOST, cl(0), TE, body=chunked())),
    # --- duplicate and malformed Content-Length --------------------------------------------------
    _p("cl-duplicate-different", post(HOST, cl(len(INFER)), cl(len(INFER) + len(SMUGGLED))) + SMUGGLED),
    _p("cl-duplicate-same", post(HOST, cl(len(INFER)), cl(len(INFER)))),
    _p("cl-comma-list", post(HOST, cl(b"%d, %d" % (len(INFER), len(INFER))))),
    _p("cl-plus-sign", post(HOST, cl(b"+%d" % len(INFER)))),
    _p("cl-minus-one", post(HOST, cl(b"-1"))),
    _p("cl-inner-space", post(HOST, cl(b"7 5"))),
    _p("cl-leading-trailing-space", post(HOST, cl(b" %d " % len(INFER)))),
    _p("cl-hex", post(HOST, cl(b"0x%x" % len(INFER)))),
    _p("cl-leading-zeros", post(HOST, cl(b"000%d" % len(INFER)))),
    _p("cl-empty", post(HOST, cl(b""))),
    _p("cl-overflow", post(HOST, cl(b"184467440737095516160"))),
    _p("cl-over-max-body", post(HOST, cl(16 * 1024 * 1024 + 1), body=b""), half_close=True),
    _p("cl-space-before-colon", post(HOST, b"Content-Length : %d\r\n" % len(INFER))),
    _p("cl-tab-before-colon", post(HOST, b"Content-Length\t: %d\r\n" % len(INFER))),
    # --- Transfer-Encoding variations ------------------------------------------------------------
    _p("te-chunked-identity", post(HOST, b"Transfer-Encoding: chunked, identity\r\n", body=chunked())),
    _p("te-identity", post(HOST, b"Transfer-Encoding: identity\r\n", body=INFER)),
    _p("te-xchunked", post(HOST, b"Transfer-Encoding: xchunked\r\n", body=chunked())),
    _p("te-chunked-x", post(HOST, b"Transfer-Encoding: chunked-x\r\n", body=chunked())),
    _p("te-chunked-chunked", post(HOST, b"Transfer-Encoding: chunked, chunked\r\n", body=chunked())),
    _p("te-two-headers", post(HOST, TE, TE, body=chunked())),
    _p("te-two-headers-identity-last", post(HOST, TE, b"Transfer-Encoding: identity\r\n", body=chunked())),
    _p("te-obs-fold", post(HOST, b"Transfer-Encoding:\r\n chunked\r\n", body=chunked())),
    _p("te-obs-fold-tab", post(HOST, b"Transfer-Encoding: x\r\n\tchunked\r\n", body=chunked())),
    _p("te-space-before-colon", post(HOST, b"Transfer-Encoding : chunked\r\n", body=chunked())),
    _p("te-tab-before-colon", post(HOST, b"Transfer-Encoding\t: chunked\r\n", body=chunked())),
    _p("te-vertical-tab", post(HOST, b"Transfer-Encoding: \x0bchunked\r\n", body=chunked())),
    _p("te-quoted", post(HOST, b'Transfer-Encoding: "chunked"\r\n', body=chunked())),
    _p("te-http10", post(HOST, TE, body=chunked(), line=b"POST " + INFER_PATH + b" HTTP/1.0\r\n")),
    # --- chunk sizes and extensions ---------------------------------------------------------------
    _p("chunk-size-overflow", post(HOST, TE, body=b"1" + b"0" * 20 + b"\r\n" + b"x" * 8 + b"\r\n0\r\n\r\n")),
    _p("chunk-size-64bit-wrap", post(HOST, TE, body=b"10000000000000001\r\nx\r\n0\r\n\r\n")),
    _p("chunk-size-negative", post(HOST, TE, body=b"-1\r\nx\r\n0\r\n\r\n")),
    _p("chunk-size-0x", post(HOST, TE, body=b"0x4\r\nabcd\r\n0\r\n\r\n")),
    _p("chunk-size-trailing-space", post(HOST, TE, body=b"%x \r\n" % len(INFER) + INFER + b"\r\n0\r\n\r\n")),
    _p("chunk-size-missing", post(HOST, TE, body=b"\r\nabc\r\n0\r\n\r\n")),
    _p("chunk-data-longer-than-size", post(HOST, TE, body=b"2\r\nabcd\r\n0\r\n\r\n") + get(HOST)),
    _p("chunk-missing-crlf-after-data", post(HOST, TE, body=b"%x\r\n" % len(INFER) + INFER + b"0\r\n\r\n")),
    _p("chunk-ext-ok", post(HOST, TE, body=b"%x;name=value\r\n" % len(INFER) + INFER + b"\r\n0;last\r\n\r\n")),
    _p("chunk-ext-quoted", post(HOST, TE, body=b'%x;a="b\\";c"\r\n' % len(INFER) + INFER + b"\r\n0\r\n\r\n")),
    _p("chunk-ext-bare-lf", post(HOST, TE, body=b"%x;a=b\n" % len(INFER) + INFER + b"\r\n0\r\n\r\n")),
    _p("chunk-ext-bare-cr", post(HOST, TE, body=b"%x;a=\rb\r\n" % len(INFER) + INFER + b"\r\n0\r\n\r\n")),
    _p("chunk-ext-nul", post(HOST, TE, body=b"%x;a=\x00\r\n" % len(INFER) + INFER + b"\r\n0\r\n\r\n")),
    _p("chunk-ext-huge", post(HOST, TE, body=b"%x;" % len(INFER) + b"a" * 80_000 + b"\r\n" + INFER
                              + b"\r\n0\r\n\r\n")),
    _p("chunk-trailer-smuggles-cl", post(HOST, TE, body=b"%x\r\n" % len(INFER) + INFER + b"\r\n0\r\n"
                                         + cl(len(SMUGGLED)) + b"\r\n") + SMUGGLED),
    _p("chunk-unterminated", post(HOST, TE, body=b"%x\r\n" % len(INFER) + INFER + b"\r\n")),
    # --- NUL and control bytes ----------------------------------------------------------------------
    _p("nul-in-header-value", get(HOST, b"X-A: a\x00b\r\n")),
    _p("ctl-in-header-value", get(HOST, b"X-A: a\x01b\r\n")),
    _p("del-in-header-value", get(HOST, b"X-A: a\x7fb\r\n")),
    _p("obs-text-in-header-value", get(HOST, b"X-A: caf\xe9\r\n")),
    _p("nul-in-header-name", get(HOST, b"X-\x00A: b\r\n")),
    _p("utf8-in-header-name", get(HOST, b"X-\xc3\xa9: b\r\n")),
    _p("nul-in-path", get(HOST, line=b"GET /v2/health/live\x00 HTTP/1.1\r\n")),
    _p("ctl-in-path", get(HOST, line=b"GET /v2/\x01health/live HTTP/1.1\r\n")),
    _p("space-in-path", get(HOST, line=b"GET /v2/health /live HTTP/1.1\r\n")),
    _p("utf8-in-path", get(HOST, line=b"GET /v2/h\xc3\xa9alth/live HTTP/1.1\r\n")),
    _p("nul-in-method", get(HOST, line=b"G\x00ET /v2/health/live HTTP/1.1\r\n")),
    _p("lowercase-method", get(HOST, line=b"get /v2/health/live HTTP/1.1\r\n")),
    _p("unknown-method", get(HOST, line=b"FROB /v2/health/live HTTP/1.1\r\n")),
    _p("very-long-method", get(HOST, line=b"G" * 10_000 + b" /v2/health/live HTTP/1.1\r\n")),
    _p("tab-separated-request-line", get(HOST, line=b"GET\t/v2/health/live\tHTTP/1.1\r\n")),
    _p("double-space-request-line", get(HOST, line=b"GET  /v2/health/live HTTP/1.1\r\n")),
    _p("leading-space-request-line", get(HOST, line=b" GET /v2/health/live HTTP/1.1\r\n")),
    # --- header-line syntax ------------------------------------------------------------------------
    _p("header-without-colon", get(HOST, b"X-A b\r\n")),
    _p("header-empty-name", get(HOST, b": b\r\n")),
    _p("header-name-with-space", get(HOST, b"X A: b\r\n")),
    _p("obs-fold-generic", get(HOST, b"X-A: a\r\n b\r\n")),
    _p("first-header-folded", LIVE + b" X-A: b\r\n" + HOST + b"\r\n"),
    # --- Host --------------------------------------------------------------------------------------
    _p("missing-host", get()),
    _p("two-hosts", get(HOST, b"Host: other\r\n")),
    _p("two-hosts-same", get(HOST, HOST)),
    _p("host-and-lowercase-host", get(HOST, b"host: corpus\r\n")),
    _p("missing-host-pipelined-after-good", get(HOST) + get()),
    _p("absolute-form-without-host", get(line=b"GET http://corpus/v2/health/live HTTP/1.1\r\n")),
    # --- versions and other protocols ---------------------------------------------------------------
    _p("http09-simple-request", b"GET /v2/health/live\r\n\r\n"),
    _p("http09-explicit", b"GET /v2/health/live HTTP/0.9\r\n\r\n"),
    _p("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    _p("http20-version", get(HOST, line=b"GET /v2/health/live HTTP/2.0\r\n")),
    _p("http12-version", get(HOST, line=b"GET /v2/health/live HTTP/1.2\r\n")),
    _p("http30-version", get(HOST, line=b"GET /v2/health/live HTTP/3.0\r\n")),
    _p("lowercase-version", get(HOST, line=b"GET /v2/health/live http/1.1\r\n")),
    _p("version-extra-digit", get(HOST, line=b"GET /v2/health/live HTTP/1.10\r\n")),
    _p("version-leading-zero", get(HOST, line=b"GET /v2/health/live HTTP/01.1\r\n")),
    _p("version-junk-suffix", get(HOST, line=b"GET /v2/health/live HTTP/1.1x\r\n")),
    _p("version-missing", get(HOST, line=b"GET /v2/health/live \r\n")),
    _p("tls-client-hello", bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) + b"\x00\x02\x13\x01\x01\x00"),
    _p("binary-garbage", bytes(range(256))),
    _p("connect-authority-form", b"CONNECT corpus:443 HTTP/1.1\r\n" + HOST + b"\r\n" + SMUGGLED),
    _p("upgrade-h2c-then-smuggled", get(HOST, b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                         b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n") + SMUGGLED),
    _p("upgrade-websocket", get(HOST, b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")),
    # --- requests split mid-line ---------------------------------------------------------------------
    _p("split-mid-method", b"GE", b"T /v2/health/live HTTP/1.1\r\n" + HOST + b"\r\n"),
    _p("split-mid-path", b"GET /v2/hea", b"lth/live HTTP/1.1\r\n" + HOST + b"\r\n"),
    _p("split-mid-header-name", LIVE + b"Ho", b"st: corpus\r\n\r\n"),
    _p("split-between-cr-and-lf", LIVE + HOST + b"\r", b"\n"),
    _p("split-mid-body", post(HOST, cl(len(INFER)), body=INFER[:20]), INFER[20:]),
    _p("split-mid-chunk-size", post(HOST, TE, body=(b"%x" % len(INFER))[:1]),
       (b"%x" % len(INFER))[1:] + b"\r\n" + INFER + b"\r\n0\r\n\r\n"),
    _p("split-bare-lf-across-segments", LIVE + b"Host: corpus\n", b"\r\n"),
    # --- pipelined smuggling attempts ----------------------------------------------------------------
    _p("pipeline-cl-swallows-request", get(HOST, cl(len(SMUGGLED))) + SMUGGLED),
    _p("pipeline-cl-short-then-junk", get(HOST, cl(5)) + SMUGGLED),
    _p("pipeline-cl-long-pending", get(HOST, cl(len(SMUGGLED) + 30)) + SMUGGLED),
    _p("pipeline-after-connection-close", get(HOST, b"Connection: close\r\n") + SMUGGLED),
    _p("pipeline-after-http10", get(line=b"GET /v2/health/live HTTP/1.0\r\n") + SMUGGLED),
    _p("pipeline-after-bad-request", get(HOST, b"X-A: a\x00\r\n") + SMUGGLED),
    _p("pipeline-chunked-zero-then-request", post(HOST, TE, body=b"0\r\n\r\n") + SMUGGLED),
    _p("pipeline-bare-lf-hides-request", get(HOST, b"X-A: a\n" + cl(len(SMUGGLED))) + SMUGGLED),
    # --- Expect ---------------------------------------------------------------------------------------
    _p("expect-100-continue", post(HOST, b"Expect: 100-continue\r\n", cl(len(INFER)))),
    _p("expect-100-continue-no-body", post(HOST, b"Expect: 100-continue\r\n", cl(len(INFER)), body=b"")),
    _p("expect-100-continue-uppercase", post(HOST, b"Expect: 100-CONTINUE\r\n", cl(len(INFER)))),
    _p("expect-unknown", post(HOST, b"Expect: 200-ok\r\n", cl(len(INFER)))),
    _p("expect-100-continue-chunked", post(HOST, b"Expect: 100-continue\r\n", TE, body=chunked())),
    _p("expect-on-get", get(HOST, b"Expect: 100-continue\r\n")),
    _p("expect-twice", post(HOST, b"Expect: 100-continue\r\n", b"Expect: 100-continue\r\n", cl(len(INFER)))),
    _p("expect-empty", post(HOST, b"Expect:\r\n", cl(len(INFER)))),
    # --- sizes -------------------------------------------------------------------------------------------
    _p("header-value-70k", get(HOST, b"X-A: " + b"a" * 70_000 + b"\r\n")),
    _p("headers-many-over-64k", get(HOST, *(b"X-%05d: %s\r\n" % (i, b"v" * 40) for i in range(2000)))),
    _p("head-unterminated-100k", LIVE + HOST + b"X-A: " + b"a" * 100_000),
    _p("url-70k", get(HOST, line=b"GET /v2/health/live?" + b"q" * 70_000 + b" HTTP/1.1\r\n")),
    _p("headers-just-under-limit", get(HOST, b"X-A: " + b"a" * 60_000 + b"\r\n")),
]


def main() -> None:
    from tests.support.fuzz import llhttp_verdict

    rejected = 0
    for p in CORPUS:
        v = llhttp_verdict(p.segments)
        rejected += v.rejected
        print(f"{p.name:40s} {v.describe()}")
    print(f"{len(CORPUS)} payloads, {rejected} rejected")


if __name__ == "__main__":
    main()
