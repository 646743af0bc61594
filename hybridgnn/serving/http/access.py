"""HTTP's lines of the access log (serving/core/access.py): peer, request line, status,
bytes written, milliseconds from the request's first byte to its answer being written,
and the client's X-Request-Id."""

from __future__ import annotations

import time

from hybridgnn.serving.core.access import MAX_TARGET, printable, write_line
from hybridgnn.serving.http.message import Message


def peer_of(transport) -> str:
    """host:port of the client ("-" for none: a Unix socket, or a transport gone)."""
    try:
        peer = transport.get_extra_info("peername")
    except Exception:  # a closed transport may raise instead of answering None
        return "-"
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return "-"


def log_http(transport, msg: Message | None, status: int, nbytes: int) -> None:
    """The line of one answer; msg None: a refusal before any request was read whole (a
    connection over the cap, a head the parser refused)."""
    if msg is None:
        write_line(peer_of(transport), "-", status, nbytes, None, None)
        return
    target = printable(msg.url.decode("latin-1"), MAX_TARGET)
    request = f"{printable(msg.method, 16)} {target} HTTP/{'1.0' if msg.http10 else '1.1'}"
    write_line(peer_of(transport), request, status, nbytes, time.monotonic() - msg.received,
               msg.headers.get("x-request-id"))
