"""The one error model: every error a client may see is a `ServingError` carrying its
HTTP status (and gRPC-style code name) and a message safe to show; the API maps these,
and only these, to their status. Anything else raised while answering is a bug: a logged
500 with a request id in the body and the log line, never a 4xx.

The table (class: status):
    BadRequest 400 (UpdateError 400), Unauthorized 401, Forbidden 403, NotFound 404
    (RemovedNode 404), MethodNotAllowed 405 (+ Allow), Conflict 409, PayloadTooLarge 413,
    Overloaded 429 (+ Retry-After), BatchFailed 500, Draining 503 and
    ServiceUnavailable 503 (LogTrimmed 503) (both + Retry-After);
    any other exception: 500 {"error": "internal server error", "request_id": ...}.
Code that finds an input bad raises the fitting class where it finds it; nothing maps
LookupError or ValueError to a 4xx (those are bugs, and answer 500).

Errors that are not about a request (a dataset, model or flags that do not fit together)
are `ConfigError`s: the CLI prints their message as one line and exits 2.
"""

from __future__ import annotations

import reprlib


class HybridGNNError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(HybridGNNError, ValueError):
    """The dataset, model, profile or flags do not fit together (exit 2 with this line)."""


# The one Retry-After a 429 or 503 carries unless its error names another: long enough for
# a queue to move, short enough that a client (or a balancer trying another replica) is
# not kept waiting for nothing.
RETRY_AFTER_S = 1.0


class ServingError(HybridGNNError):
    """An answer other than 200 for one request: status, a client-safe message, headers.

    Subclasses fix the status; `retry_after_s` adds a Retry-After header. A 429 or 503
    always has one (RETRY_AFTER_S unless given)."""

    status: int = 400
    reason: str = "bad_request"  # a short fixed label: metrics and logs, never free text
    prefix: str = ""  # what every message of the class starts with (the answer's "error")

    def __init__(self, message: str, *, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if retry_after_s is None and self.status in (429, 503):
            retry_after_s = RETRY_AFTER_S
        self.retry_after_s = retry_after_s

    @property
    def message(self) -> str:
        """What the client reads in {"error": ...}: the class's prefix, then the detail."""
        return self.prefix + str(self)

    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(1, int(-(-self.retry_after_s // 1))))}


class BadRequest(ServingError):
    """The request is malformed or names something invalid (400)."""


class UpdateError(BadRequest):
    """A graph update that does not fit the graph as it is (an unknown node, an edge already
    there): the whole request is refused and nothing of it applied (400)."""

    reason = "update_rejected"
    prefix = "update rejected, nothing applied: "


class Unauthorized(ServingError):
    status, reason = 401, "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}  # what a 401 must name (RFC 9110 §15.5.2)


class Forbidden(ServingError):
    status, reason = 403, "forbidden"


class NotFound(ServingError):
    """A model, version, endpoint or node that does not exist (404)."""

    status, reason = 404, "not_found"


class RemovedNode(NotFound):
    """A request names a node that a graph update removed (404)."""

    @classmethod
    def among(cls, removed_ids, name=str) -> RemovedNode:
        """The error for a request naming removed_ids (a non-empty sequence; the first is
        named, by name(internal id): as the client named it, on a dataset with names)."""
        return cls(f"node {name(int(removed_ids[0]))} was removed from the graph")


class MethodNotAllowed(ServingError):
    status, reason = 405, "method_not_allowed"

    def __init__(self, message: str, allow: str):
        super().__init__(message)
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class Conflict(ServingError):
    """The request is valid but the server's state cannot answer it (409): a mode whose
    artifacts are missing, a new-node request after graph updates."""

    status, reason = 409, "conflict"


class PayloadTooLarge(ServingError):
    status, reason = 413, "too_large"


class Overloaded(ServingError):
    """Admission refused: the queueing delay would exceed its bound (429 + Retry-After)."""

    status, reason = 429, "overload"
    prefix = "server overloaded: "


# The refusal reason (metrics) of a gRPC call past the cap on calls in flight
# (serving/grpc/schema.call_cap): an overload that grpcio's server answers itself.
GRPC_CALL_CAP = "grpc_call_cap"
# ... of an HTTP connection past --max-connections (503 and closed before a request is read)
CONNECTION_CAP = "connection_cap"


class Draining(ServingError):
    """The server is starting or shutting down and takes no new work (503 + Retry-After)."""

    status, reason = 503, "draining"
    prefix = "not accepting requests: "


class ServiceUnavailable(ServingError):
    """Something this request needs is not there now: the update log cannot be reached, or
    this replica has not yet applied the graph version the request asks for (503 +
    Retry-After: a balancer retries on another replica)."""

    status, reason = 503, "unavailable"


class LogTrimmed(ServiceUnavailable):
    """A reader asked for entries that were trimmed from the log: it cannot catch up from
    where it is (a replica restarts from a snapshot at or after the log's first position
    minus one)."""

    def __init__(self, url: str, after: int, first: int, *, replica: str = "this replica"):
        super().__init__(f"the update log {url} holds entries from position {first} on (older ones were trimmed, "
                         f"--update-log-retain), but {replica} is at position {after}: it needs a snapshot at "
                         f"position {first - 1} or later (copy one from another replica into its --snapshot-dir)")
        self.after, self.first_held = after, first


class LogFromAnotherBuild(ServiceUnavailable):
    """An entry of the update log was written by a build that writes another entry format:
    this replica applies nothing past it (skipped, its graph would part from the others'
    for good) and stays unready until it runs a build that reads it."""

    def __init__(self, url: str, position: int, why: str):
        super().__init__(f"the update log {url} position {position} cannot be read by this build ({why}): run the "
                         "same hybridgnn version on every replica; this one applies nothing past it until then")
        self.position = position


class BatchFailed(ServingError):
    """The pipeline could not execute the batch that held this request (500, logged)."""

    status, reason = 500, "batch_failed"
    prefix = "inference failed: "


def status_of(exc: BaseException) -> int:
    """The HTTP status an exception answers with: its own for a ServingError, else 500."""
    return exc.status if isinstance(exc, ServingError) else 500


_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlist, _brief.maxdict = 2, 60, 60, 6, 4
_brief.maxlong = 40


def brief(value) -> str:
    """A short repr of a value a client sent, for an error message: bounded in length and
    depth whatever it holds (a plain repr of JSON nested 1000 deep raises RecursionError,
    and one of a huge list is as large as the list)."""
    try:
        return _brief.repr(value)
    except Exception:  # e.g. an int too long to convert to text
        return f"<{type(value).__name__}>"
