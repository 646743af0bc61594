"""Precomputed lookups an HTTP server answers itself (serving/v2/lookups.py says which),
as Replies: a front-end process does, and so does the HTTP server in the engine's own
process, where a lookup needs no Later, no completion callback and no per-answer
statistics calls. Answers are counted in batches: `send(taken)` gets LocalAnswers.take()'s
entries at least once a second while lookups are answered (at most COUNTS_KEPT held),
and whenever send_counts() is called (before every statistics read)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hybridgnn.serving.http.codec import (
    HEADER_LENGTH,
    encode_infer_response,
    quick_loads,
)
from hybridgnn.serving.http.reply import Reply, Request
from hybridgnn.serving.v2.lookups import LocalLookups
from hybridgnn.serving.v2.types import InferAnswer, InferInput

log = logging.getLogger("hybridgnn.serve")
COUNTS_KEPT = 65536  # answers held before they are sent to be counted, at most
COUNT_PERIOD_S = 1.0
QUICK_MAX_BODY = 2048  # bytes; a longer body is parsed once, by the general way
_BINARY_HEADER = HEADER_LENGTH.lower()  # request headers reach endpoints with lower-case names


def infer_reply(answer: InferAnswer, binary: dict[str, bool] | bool) -> Reply:
    """The 200 Reply of an inference's answer, encoded as the client asked (JSON or binary)."""
    body, headers = encode_infer_response(answer, binary)
    content_type = headers.pop("Content-Type")
    return Reply(200, body, content_type, headers or None)


class HttpLookups:
    def __init__(self, specs: list[dict], bound_s: float, send: Callable[[list[tuple[dict, bytes]]], None]):
        """specs: v2.lookups.lookup_specs(); bound_s: admission's bound on the wait (a
        request that waited longer goes to the engine, which refuses it). OSError or
        ValueError when the stored rows cannot be mapped."""
        self.local = LocalLookups(specs)
        self.bound_s = bound_s
        self._send = send
        self._sent_at = time.perf_counter()
        self._failed = False

    @classmethod
    def open(cls, specs: list[dict], bound_s: float, send: Callable[[list[tuple[dict, bytes]]], None]):
        """HttpLookups, or None when there are no specs or their rows cannot be mapped (then
        the engine answers every lookup; the reason is logged)."""
        if not specs:
            return None
        try:
            return cls(specs, bound_s, send)
        except (OSError, ValueError) as exc:
            log.warning("lookups are left to the engine: cannot map its stored embeddings (%s)", exc)
            return None

    def quick_reply(self, request: Request, model: str, version: str | None) -> Reply | None:
        """The Reply to the commonest lookup (LocalLookups.quick says which) straight from
        its body, before any v2 object is made; None for anything else, which then takes
        the general way (parse_infer, then reply()). Same bytes either way."""
        body = request.body
        if len(body) > QUICK_MAX_BODY or request.standing or request.waited_s > self.bound_s \
                or _BINARY_HEADER in request.headers or not self.local.may_quick(body, model, version):
            return None  # the general way parses it (once)
        try:
            header = quick_loads(body)
        except Exception:  # not JSON (the general way says why), or past a parser's limits
            return None
        try:
            found = self.local.quick(header, model, version)
        except Exception:  # a fault here (never a client's): the general way answers
            self._fault("the quick lane")
            return None
        return self._answered(found, False)

    def _fault(self, where: str) -> None:
        if not self._failed:
            self._failed = True
            log.exception("a lookup failed in %s of the HTTP server; the engine answers it (logged once)", where)

    def reply(self, request: InferInput, binary: dict[str, bool] | bool) -> Reply | None:
        """The Reply to `request` if it is a lookup answered here, else None."""
        try:
            found = self.local.answer(request, self.bound_s)
        except Exception:  # a fault here (never a client's: those go to the engine): the engine answers
            self._fault("the lookups")
            return None
        return self._answered(found, binary)

    def _answered(self, found, binary: dict[str, bool] | bool) -> Reply | None:
        """The Reply of a lookup's answer (encoded, then counted), or None without one."""
        if found is None:
            return None
        answer, started, rows = found
        encoding = time.perf_counter()
        reply = infer_reply(answer, binary)
        counted = self.local.counted
        self.local.count(answer, started, encoding, rows)
        if counted.size >= COUNTS_KEPT or encoding - self._sent_at >= COUNT_PERIOD_S:
            self.send_counts()
        return reply

    def send_counts(self) -> None:
        """Send every answer not counted yet."""
        self._sent_at = time.perf_counter()
        taken = self.local.counted.take()
        if taken:
            self._send(taken)
