"""What the HTTP server and its endpoints exchange: the Request an endpoint reads and the
Reply it answers with. Imports nothing heavy: a front-end process (serving/frontend.py)
serves HTTP without loading torch."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring_ascii
from typing import Protocol

from hybridgnn.errors import RETRY_AFTER_S

JSON = "application/json"
RETRY = {"Retry-After": str(max(1, round(RETRY_AFTER_S)))}


class Reply:
    """One HTTP answer: status, body bytes, content type and any extra headers."""

    __slots__ = ("status", "body", "content_type", "headers", "shared")

    def __init__(self, status: int, body: bytes, content_type: str = JSON, headers: dict[str, str] | None = None):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers
        self.shared = False  # one object answers many requests, unchanged: its encoding may be kept

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, json.dumps(obj).encode(), JSON, headers)

    @classmethod
    def error(cls, status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
        # The bytes json.dumps({"error": message}) gives, at a sixth of its cost: refusals
        # under overload are answered by the thousand per second.
        return cls(status, b'{"error": %s}' % encode_basestring_ascii(message).encode(), JSON, headers)


# The answer to a request whose outcome cannot be known (a state-changing request in flight
# when the engine's process died): the connection is aborted unanswered, as a crash of a
# one-process server would leave it, so no client reads "refused" for what may have been done.
ABORT = Reply(502, b"")


class Request:
    """What an endpoint reads from an HTTP request: route parameters, the headers it
    uses (names lower-case), the body, how long it already waited in the front end
    (from its first byte read, or from the answer before it on a pipelining connection if
    that came later, to its endpoint running), which admission counts, and
    whether it waited past the target of a queue that stands (then an inference is
    refused; other endpoints answer). Endpoints only read params and headers: requests to
    one target share their params, and requests with one head their headers."""

    __slots__ = ("params", "headers", "body", "waited_s", "standing")

    def __init__(self, params: dict[str, str], headers: dict[str, str], body: bytes, waited_s: float = 0.0,
                 standing: bool = False):
        self.params = params
        self.headers = headers
        self.body = body
        self.waited_s = waited_s
        self.standing = standing


Endpoint = Callable[[Request], "Reply | Awaitable[Reply]"]


class Routes(Protocol):
    """What the HTTP server asks of the API it carries (api.py's Api in the engine's
    process; frontend.py's in a front-end process)."""

    draining: bool  # the server is shutting down: every answer says Connection: close

    def route(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | Reply:
        """The endpoint and route parameters for method+path, or the Reply (404, 405). The
        server keeps a route found for a request target and asks only for new ones: the
        answer for a method and path must not change (endpoints judge what they serve)."""

    def internal_error(self, where: str, exc: BaseException | None = None) -> Reply:
        """The answer to an exception that escaped an endpoint or the HTTP layer."""


def model_route(path: str) -> dict[str, str] | None:
    """The parameters of a /v2/models/{model}[/versions/{version}][/{action}] path (action
    "" for the model itself), or None for any other path."""
    parts = path.split("/")
    if len(parts) < 4 or parts[0] != "" or parts[1] != "v2" or parts[2] != "models" or not parts[3]:
        return None
    rest = parts[4:]
    params = {"model": parts[3]}
    if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
        params["version"] = rest[1]
        rest = rest[2:]
    if len(rest) > 1:
        return None
    params["action"] = rest[0] if rest else ""
    return params


_REFUSALS_KEPT = 256  # distinct refusal answers kept (messages name a bound and a retry; few differ)


class Refusals:
    """The Reply to a v2 Failure. A refusal (429/503) is one shared Reply per status,
    message and headers (the server keeps each Reply's bytes): under overload they are
    answered by the thousand per second, with a few messages."""

    def __init__(self):
        self._kept: dict = {}

    def reply_of(self, failure) -> Reply:
        # By value, not by the Failure: a front end decodes a new one from every answer.
        headers = failure.headers
        key = (failure.status, failure.message, tuple(headers.items()) if headers else None)
        reply = self._kept.get(key)
        if reply is not None and failure.request_id is None:
            return reply
        if failure.status in (429, 503) and not (headers and "Retry-After" in headers):
            headers = {**headers, **RETRY} if headers else RETRY
        if failure.request_id is not None:
            return Reply.json({"error": failure.message, "request_id": failure.request_id}, failure.status, headers)
        reply = Reply.error(failure.status, failure.message, headers)
        if failure.status in (429, 503):
            if len(self._kept) >= _REFUSALS_KEPT:
                self._kept.clear()
            self._kept[key] = reply
            reply.shared = True
        return reply
