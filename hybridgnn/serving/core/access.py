"""The access log (`serve --access-log`): one line per answered request, by whichever
process answered it, on the logger `hybridgnn.access`. Transport-neutral: serving/http
and serving/grpc each say what a line holds.

A line is `PEER "REQUEST" STATUS BYTES MSms REQUEST-ID`, with `-` where a part is not
known. Everything taken from a client (the request target, the X-Request-Id header) is
cut short and has its control characters, quotes and backslashes escaped, so one
request is one line that a log shipper can split on its quotes, whatever was sent.
"""

from __future__ import annotations

import logging

ACCESS_LOG = logging.getLogger("hybridgnn.access")
MAX_TARGET = 512  # characters of a request target kept in a line
MAX_REQUEST_ID = 128

# control characters, DEL, '"' and '\' as \xNN: what a client sends never ends a line early
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, ord('"'), ord("\\"))}


def enable_access_log() -> logging.Logger:
    """The access logger, at INFO whatever the server's --log-level: asking for the lines
    means wanting them. Its records go to the process's log handlers."""
    ACCESS_LOG.setLevel(logging.INFO)
    return ACCESS_LOG


def printable(text: str, limit: int) -> str:
    """`text` as one line of a log: at most `limit` characters of it (then "..."), and
    nothing in it that could end or split the line."""
    cut = text[:limit].translate(_ESCAPES)
    return cut + "..." if len(text) > limit else cut


def write_line(peer: str, request: str, status: int | str, nbytes: int | None, seconds: float | None,
               request_id: str | None) -> None:
    """One access-log line; `request` is already printable (the transport made it so)."""
    ACCESS_LOG.info('%s "%s" %s %s %s %s', peer, request, status, "-" if nbytes is None else nbytes,
                    "-" if seconds is None else f"{seconds * 1000:.2f}ms",
                    "-" if not request_id else printable(request_id, MAX_REQUEST_ID))
