"""Precomputed lookups an HTTP server answers itself (serving/v2/lookups.py says which),
as Replies: a front-end process does, and so does the HTTP server in the engine's own
process, where a lookup needs no Later, no completion callback and no per-answer
statistics calls. Answers are counted in batches: `send(taken)` gets LocalAnswers.take()'s
entries at least once a second while lookups are answered (at most COUNTS_KEPT held),
and whenever send_counts() is called (before every statistics read).

Three ways, each answering the same bytes as the next (the tests hold them to it):
- kept forms: a client sends the same body again and again but for its ids. A body the
  quick lane answered is kept by its form (the body with the ids of its `"data": [...]`
  cut out) with the answer's bytes around the data (codec.json_answer_parts); a body of
  a kept form is answered by reading its ids from the text and the rows, without parsing
  the JSON or making any v2 object. Its ids are a list of 1 to 64 JSON integers, and its
  form holds exactly one `"data"` and no escape (which could spell a key another way, so
  that a later duplicate shadows the literal one), so they are that input's data: the
  body parses as the kept one did, with these ids. A request id (`"id"`, a client's own
  per request) is a hole of the form too when it is a string of plain characters (no
  quote, no escape, at most RID_KEPT_CHARS): its text is then the string, written back
  as sent; the form holds exactly one `"id"`, the request's.
- the quick lane (LocalLookups.quick): the body parsed once, checked field by field;
- the general way: parse_infer, then LocalLookups.answer, which decodes as the engine does.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import numpy as np

from hybridgnn.serving.core.eager import Later, in_turns
from hybridgnn.serving.http.codec import (
    HEADER_LENGTH,
    encode_infer_response,
    encode_infer_steps,
    json_answer_parts,
    json_data,
    quick_loads,
    takes_turns,
)
from hybridgnn.serving.http.reply import JSON, Reply, Request
from hybridgnn.serving.v2.lookups import LocalLookups
from hybridgnn.serving.v2.types import InferAnswer, InferInput, internal_failure

log = logging.getLogger("hybridgnn.serve")
COUNTS_KEPT = 65536  # answers held before they are sent to be counted, at most
COUNT_PERIOD_S = 1.0
QUICK_MAX_BODY = 2048  # bytes; a longer body is parsed once, by the general way
_BINARY_HEADER = HEADER_LENGTH.lower()  # request headers reach endpoints with lower-case names
FORMS_KEPT = 256  # kept forms; emptied when full (bodies a client varies cannot grow it)
_WS = rb"[ \t\n\r]*"
_ID = _WS + rb"(?:0|[1-9][0-9]{0,17})" + _WS  # a JSON integer below 10**18: an int64 node id
_IDS = re.compile(rb'"data"' + _WS + rb":" + _WS + rb"\[(" + _ID + rb"(?:," + _ID + rb"){0,63})\]")
RID_KEPT_CHARS = 128
# a request id of printable ASCII but the quote and the backslash: its JSON text is itself
_RID = re.compile(rb'"id"' + _WS + rb":" + _WS + rb'"([ !#-\[\]-~]{0,%d})"' % RID_KEPT_CHARS)


class _Form:
    """A kept form: the table and outputs its bodies ask for, how many ids, and the answer's
    bytes around each output's data."""

    __slots__ = ("table", "count", "outputs", "with_embeddings", "parts", "with_id", "stored")

    def __init__(self, table, count: int, outputs: list[str], parts: list[bytes], with_id: bool):
        self.table = table
        self.count = count
        self.outputs = outputs
        self.with_embeddings = "embeddings" in outputs
        self.parts = parts  # around each output's data, then (with_id) around the id's string
        self.with_id = with_id
        # One node's one output, read straight from its stored row (the commonest lookup).
        self.stored = table.stored(outputs[0]) if count == 1 and len(outputs) == 1 else None


def _form_of(body: bytes, ids: re.Match, rid: re.Match | None) -> bytes:
    """A body's form: the body without its ids' text and its request id's (the two never
    overlap: neither holds a quote)."""
    start, end = ids.span(1)
    if rid is None:
        return body[:start] + body[end:]
    id_start, id_end = rid.span(1)
    if id_start < start:
        return body[:id_start] + body[id_end:start] + body[end:]
    return body[:start] + body[end:id_start] + body[id_end:]


def infer_reply(answer: InferAnswer, binary: dict[str, bool] | bool) -> Reply | Later:
    """The 200 Reply of an inference's answer, encoded as the client asked (JSON or binary);
    a Later of it, encoded over several turns of the loop, for an answer whose JSON would
    hold the loop for long (one of 8192 x 256 embeddings took 80-140 ms in one call, every
    other client waiting). Event loop thread only."""
    if takes_turns(answer, binary):
        return in_turns(encode_infer_steps(answer, binary), _reply_of, _encoding_failed)
    return _reply_of(encode_infer_response(answer, binary))


def _reply_of(encoded: tuple[bytes, dict[str, str]]) -> Reply:
    body, headers = encoded
    content_type = headers.pop("Content-Type")
    return Reply(200, body, content_type, headers or None)


def _encoding_failed(exc: Exception) -> Reply:
    failure = internal_failure(exc, "encoding an answer", log)
    return Reply.json({"error": failure.message, "request_id": failure.request_id}, failure.status)


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
        self._forms: dict[tuple[str, str | None, bytes], _Form] = {}

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
        """The Reply to the commonest lookup (a kept form's, or the quick lane's: see the
        module docstring) straight from its body, before any v2 object is made; None for
        anything else, which then takes the general way (parse_infer, then reply())."""
        body = request.body
        if len(body) > QUICK_MAX_BODY or request.standing or request.waited_s > self.bound_s \
                or _BINARY_HEADER in request.headers:
            return None  # the general way parses it (once)
        # A body with a request id has a kept form only when the id is a plain string (a
        # hole of the form); no kept body holds '"id"' elsewhere.
        if b'"id"' not in body:
            rid = None
            ids = _IDS.search(body)
            if ids is not None:
                start, end = ids.span(1)
                form = self._forms.get((model, version, body[:start] + body[end:]))
                if form is not None:  # None from it: the ids do not fit, and the quick lane would say so too
                    return self._formed(form, ids.group(1), None)
        else:
            rid = _RID.search(body)
            ids = _IDS.search(body) if rid is not None else None
            if ids is not None:
                form = self._forms.get((model, version, _form_of(body, ids, rid)))
                if form is not None:
                    return self._formed(form, ids.group(1), rid)
        if not self.local.may_quick(body, model, version):
            return None
        try:
            header = quick_loads(body)
        except Exception:  # not JSON (the general way says why), or past a parser's limits
            return None
        try:
            found = self.local.quick(header, model, version)
        except Exception:  # a fault here (never a client's): the general way answers
            self._fault("the quick lane")
            return None
        reply = self._answered(found, False)
        if reply is not None and ids is not None:
            self._keep_form(model, version, body, ids, rid, header, found[0])
        return reply

    def _keep_form(self, model: str, version: str | None, body: bytes, ids: re.Match, rid: re.Match | None,
                   header: dict, answer: InferAnswer) -> None:
        """Keep the form of a body the quick lane answered, if its ids are the ones its text
        shows (the form's one `"data"`), its request id (if any) is the one its text shows
        (the form's one `"id"`), and the answer's parts can be told apart."""
        if body.count(b'"data"') != 1 or b"\\" in body:
            # An escape can spell a key another way ("d\u0061ta"), so that the one literal
            # "data" is a key the parser then shadows: without escapes it is the input's own.
            return
        if rid is None:
            if answer.id is not None:
                return
        elif body.count(b'"id"') != 1 or answer.id != rid.group(1).decode("ascii"):
            return
        if header["inputs"][0]["data"] != [int(i) for i in ids.group(1).split(b",")]:
            return
        parts = json_answer_parts(answer, id_hole=rid is not None)
        table = self.local.table(model, version)
        if parts is None or table is None:
            return
        if len(self._forms) >= FORMS_KEPT:
            self._forms.clear()
        start, end = ids.span(1)
        self._forms[(model, version, _form_of(body, ids, rid))] = _Form(
            table, len(header["inputs"][0]["data"]), [name for name, _ in answer.outputs], parts, rid is not None)

    def _formed(self, form: _Form, text: bytes, rid: re.Match | None) -> Reply | None:
        """The Reply to a body of a kept form with the ids `text` and the request id `rid`
        (None if they do not fit it)."""
        if form.with_id != (rid is not None):
            return None  # cannot be: a form's key shows whether it has an id
        table = form.table
        texts = text.split(b",")  # _IDS matched: each is a JSON integer below 10**18
        if len(texts) != form.count:
            return None
        if form.count == 1:
            node = int(texts[0])
            if node >= table.num_nodes:
                return None
            started = time.perf_counter()
            if form.stored is not None:
                parts = form.parts
                if rid is None:
                    body = parts[0] + json_data(form.stored[node]) + parts[1]
                else:
                    body = b"".join((parts[0], json_data(form.stored[node]), parts[1], b'"', rid.group(1), b'"',
                                     parts[2]))
                self._count(table.model, table.version, started, started, 1)
                return Reply(200, body, JSON)
            rows = table.row(node, form.with_embeddings)
        else:
            nodes = [int(i) for i in texts]
            if max(nodes) >= table.num_nodes:
                return None
            started = time.perf_counter()
            rows = table.rows(np.array(nodes, dtype=np.int64), form.with_embeddings)
        encoding = time.perf_counter()
        parts = form.parts
        if len(parts) == 2 and rid is None:  # one output
            body = parts[0] + json_data(getattr(rows, form.outputs[0])) + parts[1]
        else:
            chunks = [parts[0]]
            for name, part in zip(form.outputs, parts[1:], strict=False):  # the id's part follows
                chunks += (json_data(getattr(rows, name)), part)
            if rid is not None:
                chunks += (b'"', rid.group(1), b'"', parts[-1])
            body = b"".join(chunks)
        self._count(table.model, table.version, started, encoding, form.count)
        return Reply(200, body, JSON)

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

    def _answered(self, found, binary: dict[str, bool] | bool) -> Reply | Later | None:
        """The Reply of a lookup's answer (encoded, then counted; a Later of it for one
        encoded over several turns of the loop), or None without one."""
        if found is None:
            return None
        answer, started, rows = found
        encoding = time.perf_counter()
        reply = infer_reply(answer, binary)
        if isinstance(reply, Later):  # encoded over several turns of the loop: counted once it is
            def encoded(done: Later) -> None:
                if done.result().status == 200:
                    self._count(answer.model, answer.version, started, encoding, rows)

            reply.add_eager_callback(encoded)
            return reply
        self._count(answer.model, answer.version, started, encoding, rows)
        return reply

    def _count(self, model: str, version: str, started: float, encoding: float, rows: int) -> None:
        """Count an answer made here once it is encoded (encoding: perf_counter when its
        encoding began); send the counts when many wait or the period is over."""
        done = time.perf_counter()
        counted = self.local.counted
        counted.add(model, version, done - started, done - encoding, rows)
        if counted.size >= COUNTS_KEPT or encoding - self._sent_at >= COUNT_PERIOD_S:
            self.send_counts()

    def send_counts(self) -> None:
        """Send every answer not counted yet."""
        self._sent_at = time.perf_counter()
        taken = self.local.counted.take()
        if taken:
            self._send(taken)
