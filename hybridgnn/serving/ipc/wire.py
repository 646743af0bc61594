"""The messages between a front-end process and the engine's process, as bytes.

A frame is `<u32 length><u8 kind><u32 id>` then `length - 5` payload bytes. Most payloads
are `<u32 n>`, n bytes of a small JSON head, then raw bytes: tensors travel as their
little-endian bytes (never JSON, never pickle), with name, dtype and shape in the head.
An input whose JSON `data` is not a plain numeric list (strings, mixed or malformed
values) travels as its JSON so the engine finds it bad with the same message it would
give in one process (one exception: data nested so deep that it cannot be written again
raises RecursionError here, and the front end refuses it itself); everything the engine
accepts arrives as an array.

The two ends are processes of one server (the engine starts its front ends), so a frame
that does not decode is a bug, answered by closing the link (WireError).
"""

from __future__ import annotations

import json
import struct

import numpy as np

try:  # the heads of most frames, at a fraction of the standard library's cost
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

from hybridgnn.errors import BadRequest
from hybridgnn.serving.v2.tensors import UnfitRows, fits_its_shape, holds_bool
from hybridgnn.serving.v2.types import MISSING, Failure, InferAnswer, InferInput, Tensor

# Front end -> engine
HELLO = 1  # JSON {"index", "pid"}: a front end connected
LISTENING = 2  # JSON {"port"}: it accepts connections now
INFER = 3  # an inference (encode_infer)
FORWARD = 4  # any other HTTP request, as received (encode_forward)
UNPARSED = 5  # JSON {"model", "version", "status"[, "count"]}: inferences the front end answered (no reply)
STATS = 6  # JSON of the front end's counters now (no reply)
GRPC = 7  # a gRPC call as received: method, authorization, the request's protobuf bytes
LOCAL = 8  # lookups the front end answered itself, to count (encode_local; no reply)
FLUSHED = 9  # every LOCAL frame the engine's FLUSH asked for was sent before this one
# Engine -> front end
SETUP = 101  # JSON: the settings the front end serves with
ANSWER = 102  # an inference's outputs (encode_answer)
FAILED = 103  # JSON {"status", "message", "headers", "request_id"}: an inference's error answer
REPLY = 104  # the answer to a FORWARD (encode_reply)
STATE = 105  # JSON {"draining"}: the server's state changed
STOP = 106  # close (stop accepting, answer what was accepted) and exit
GRPC_REPLY = 107  # a gRPC call's answer: the response's protobuf bytes, or a status code and message
FLUSH = 108  # send the LOCAL frames of every answer counted so far, then FLUSHED
ALIVE = 109  # nothing: the engine's keep-alive, once a KEEPALIVE_S

# Each end speaks at least once a KEEPALIVE_S (the engine its ALIVE, a front end its STATS);
# one silent for QUIET_S while its process lives is taken as hung (channel.Quiet)
KEEPALIVE_S = 1.0
QUIET_S = 10.0

FRAME = struct.Struct("<IBI")  # length (kind + id + payload), kind, id
HEAD = struct.Struct("<I")
MAX_FRAME = 1 << 31  # a frame longer than this is a broken stream
# dtypes an array input may arrive as: what np.asarray makes of a JSON list of numbers
# (and bools alone, which the engine then refuses with its own message; bools among
# numbers cross as JSON, since the array would read them as 1 and 0)
_LIST_DTYPES = {"<i8", "<u8", "<f8", "|b1"}
_NUMERIC = {"INT64", "INT32", "FP32", "UINT64"}
GRPC_REFUSED = "refused_grpc_calls"  # a STATS report's key: gRPC calls its cap refused, since the process began


class WireError(Exception):
    """A frame that does not decode: the link is broken (a bug, never a client's doing)."""


def frame(kind: int, rid: int, *parts: bytes | memoryview) -> bytes:
    """One frame of `kind` for request `rid`, the payload the concatenation of parts."""
    size = sum(len(p) for p in parts)
    return b"".join((FRAME.pack(size + 5, kind, rid), *parts))


def _dumps(obj) -> bytes:
    """JSON as the standard library writes it: every value a client's JSON can hold (NaN,
    integers past 64 bits) comes back as it was."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _fast_dumps(obj) -> bytes | None:
    """JSON of a head known to hold only strings, ints that fit 64 bits, finite floats,
    bools, None, lists and dicts with str keys, by orjson; None without orjson or when it
    refuses (a string holding a lone surrogate)."""
    if _orjson is None:
        return None
    try:
        return _orjson.dumps(obj)
    except (TypeError, _orjson.JSONEncodeError):
        return None


_PLAIN_HEAD = 1 << 31  # set in a head's length: the head was written by _fast_dumps


def _loads(data: bytes, plain: bool = False):
    """plain: a head _fast_dumps wrote (orjson reads it); else the standard library, which
    reads back exactly what it wrote (orjson would read an integer past 64 bits as a float)."""
    if plain and _orjson is not None:
        return _orjson.loads(data)
    return json.loads(data)


def json_frame(kind: int, rid: int, obj) -> bytes:
    return frame(kind, rid, _dumps(obj))


def with_head(kind: int, rid: int, head, *blobs: bytes | memoryview, plain: bool = False) -> bytes:
    """A frame whose payload is a JSON head then raw blobs. plain: the head holds only
    what _fast_dumps takes."""
    h = _fast_dumps(head) if plain else None
    if h is None:
        return frame(kind, rid, HEAD.pack(len(h := _dumps(head))), h, *blobs)
    return frame(kind, rid, HEAD.pack(len(h) | _PLAIN_HEAD), h, *blobs)


def split_head(payload: memoryview) -> tuple[object, memoryview]:
    """(the JSON head, the raw bytes after it) of a with_head payload."""
    if len(payload) < 4:
        raise WireError("payload too short for its head length")
    (n,) = HEAD.unpack_from(payload)
    plain = bool(n & _PLAIN_HEAD)
    n &= _PLAIN_HEAD - 1
    if n > len(payload) - 4:
        raise WireError("head longer than its payload")
    try:
        head = _loads(bytes(payload[4:4 + n]), plain)
    except ValueError as exc:
        raise WireError(f"head is not JSON: {exc}") from None
    return head, payload[4 + n:]


def loads(payload: memoryview):
    try:
        return _loads(bytes(payload))
    except ValueError as exc:
        raise WireError(f"payload is not JSON: {exc}") from None


# --- inference: front end -> engine --------------------------------------------------------
def _list_array(t: Tensor) -> np.ndarray | None:
    """The array the engine would make of a numeric input's JSON data (np.asarray, as
    v2.tensors.decode_tensor does), or None when that data is anything else."""
    data = t.data
    if type(data) is not list or type(t.datatype) is not str or t.datatype not in _NUMERIC:
        return None
    try:
        arr = np.asarray(data)
    except (ValueError, OverflowError, TypeError):
        return None
    if arr.dtype.str not in _LIST_DTYPES or (arr.dtype.kind != "b" and holds_bool(data, arr.ndim)):
        return None  # true/false among numbers: the engine judges the list itself
    if arr.ndim > 1 and list(arr.shape) != t.shape:
        # nested other than its shape ([[1], [2]] for [2]): refused there (its bytes, flat,
        # would have been taken)
        return None
    return arr


def encode_infer(rid: int, inp: InferInput) -> bytes:
    """An inference as a frame: its fields in the head, its tensors' bytes after it."""
    specs, blobs = [], []
    for t in inp.inputs:
        if t.raw is not None:
            how, blob = "raw", t.raw
        elif t.data is MISSING:
            how, blob = "none", b""
        elif type(t.datatype) is str and t.datatype in _NUMERIC and not fits_its_shape(t):
            how, blob = "unfit", struct.pack("<q", len(t.data))  # refused there (tensors.UnfitRows)
        else:
            arr = _list_array(t)
            if arr is not None:
                how, blob = arr.dtype.str, arr.tobytes()
            else:
                how, blob = "json", _dumps(t.data)
        specs.append((t.name, t.datatype, t.shape, how, len(blob)))
        blobs.append(blob)
    head = {"m": inp.model, "v": inp.version, "id": inp.id, "p": inp.parameters, "o": inp.outputs,
            "w": inp.waited_s, "s": inp.standing, "t": specs}
    return with_head(INFER, rid, head, *blobs, plain=_plain_request(inp, specs))


_PLAIN = (str, int, bool, type(None))


def _plain_request(inp: InferInput, specs: list) -> bool:
    """Whether an inference's head holds nothing the fast encoder could change: the client's
    values (parameters, id, outputs, names, datatypes, shapes) are strings, small ints,
    bools or None, one level deep. Anything else (a float, which may be NaN; a nested
    object; an int past 64 bits) goes through the standard library's encoder."""
    params = inp.parameters
    if type(params) is not dict or not all(type(v) in _PLAIN and (type(v) is not int or -(1 << 63) <= v < 1 << 63)
                                           for v in params.values()):
        return False
    if type(inp.id) not in (str, type(None)) or type(inp.model) is not str or type(inp.version) not in (
            str, type(None)):
        return False
    outputs = inp.outputs
    if outputs is not None and not all(type(o) is str for o in outputs):
        return False
    for name, datatype, shape, _, _ in specs:
        if type(name) is not str or type(datatype) is not str or type(shape) is not list:
            return False
        if not all(type(d) is int and 0 <= d < 1 << 62 for d in shape):
            return False
    return True


def decode_infer(payload: memoryview) -> InferInput:
    head, rest = split_head(payload)
    try:
        inputs, offset = [], 0
        for name, datatype, shape, how, n in head["t"]:
            if type(n) is not int or not 0 <= n <= len(rest) - offset:
                raise WireError(f"input {name!r} claims {n!r} bytes")
            blob = rest[offset:offset + n]
            offset += n
            if how == "raw":
                inputs.append(Tensor(name, datatype, shape, raw=blob))
            elif how == "none":
                inputs.append(Tensor(name, datatype, shape))
            elif how == "json":
                try:
                    data = loads(blob)
                except RecursionError:  # read here nearer the stack's limit than the front end read it
                    raise BadRequest("'data' is nested too deeply (an input's data is a list of numbers, or "
                                     "one list per row)") from None
                inputs.append(Tensor(name, datatype, shape, data))
            elif how == "unfit" and n == 8:
                inputs.append(Tensor(name, datatype, shape, UnfitRows(struct.unpack("<q", blob)[0])))
            elif how in _LIST_DTYPES:
                inputs.append(Tensor(name, datatype, shape, np.frombuffer(blob, dtype=how)))
            else:
                raise WireError(f"input {name!r}: unknown encoding {how!r}")
        if offset != len(rest):
            raise WireError(f"{len(rest) - offset} bytes after the inputs")
        return InferInput(head["m"], head["v"], inputs, head["p"], head["o"], head["id"], float(head["w"]),
                          bool(head["s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"inference head does not decode: {exc!r}") from None


# --- inference: engine -> front end --------------------------------------------------------
def encode_answer(rid: int, answer: InferAnswer) -> bytes:
    """An inference's 200 answer as a frame: each output's name, dtype and shape in the
    head, its C-order bytes after it."""
    specs, blobs = [], []
    for name, arr in answer.outputs:
        if arr.dtype.hasobject:
            raise TypeError(f"output {name!r} holds Python objects; it cannot be sent as bytes")
        specs.append((name, arr.dtype.str, arr.shape))
        blobs.append(arr.tobytes())  # C order whatever the strides
    # engine-made: a version string, a validated request id, names, dtype strings, sizes
    return with_head(ANSWER, rid, {"v": answer.version, "id": answer.id, "o": specs}, *blobs, plain=True)


def decode_answer(payload: memoryview, model: str) -> InferAnswer:
    """The answer, its outputs arrays over the frame's bytes (no copy)."""
    head, rest = split_head(payload)
    try:
        outputs, offset = [], 0
        for name, dtype, shape in head["o"]:
            dt = np.dtype(dtype)
            if dt.hasobject:
                raise WireError(f"output {name!r} has dtype {dtype!r}")
            count = 1
            for d in shape:
                count *= d
            arr = np.frombuffer(rest, dtype=dt, count=count, offset=offset).reshape(shape)
            offset += arr.nbytes
            outputs.append((name, arr))
        if offset != len(rest):
            raise WireError(f"{len(rest) - offset} bytes after the outputs")
        return InferAnswer(model, head["v"], head["id"], outputs)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"answer head does not decode: {exc!r}") from None


def encode_failure(rid: int, failure: Failure) -> bytes:
    return json_frame(FAILED, rid, {"status": failure.status, "message": failure.message,
                                    "headers": failure.headers, "request_id": failure.request_id})


def decode_failure(payload: memoryview) -> Failure:
    f = loads(payload)
    try:
        return Failure(int(f["status"]), str(f["message"]), f["headers"], f["request_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"failure does not decode: {exc!r}") from None


# --- any other HTTP request ----------------------------------------------------------------
def encode_forward(rid: int, method: str, path: str, headers: dict[str, str], body: bytes, waited_s: float,
                   standing: bool) -> bytes:
    return with_head(FORWARD, rid, {"method": method, "path": path, "headers": headers, "w": waited_s,
                                    "s": standing}, body)


def decode_forward(payload: memoryview) -> tuple[str, str, dict[str, str], bytes, float, bool]:
    head, body = split_head(payload)
    try:
        return (str(head["method"]), str(head["path"]), dict(head["headers"]), bytes(body), float(head["w"]),
                bool(head["s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"forwarded request does not decode: {exc!r}") from None


def encode_reply(rid: int, status: int, content_type: str, headers: dict[str, str] | None, body: bytes) -> bytes:
    return with_head(REPLY, rid, {"status": status, "type": content_type, "headers": headers}, body)


def decode_reply(payload: memoryview) -> tuple[int, str, dict[str, str] | None, bytes]:
    head, body = split_head(payload)
    try:
        return int(head["status"]), str(head["type"]), head["headers"], bytes(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"reply does not decode: {exc!r}") from None


# --- gRPC calls ------------------------------------------------------------------------------
def encode_grpc(rid: int, method: str, authorization: str, request: bytes) -> bytes:
    return with_head(GRPC, rid, {"method": method, "auth": authorization}, request)


def decode_grpc(payload: memoryview) -> tuple[str, str, bytes]:
    head, body = split_head(payload)
    try:
        return str(head["method"]), str(head["auth"]), bytes(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"gRPC call does not decode: {exc!r}") from None


def encode_grpc_reply(rid: int, response: bytes, code: str | None = None, message: str = "",
                      trailing: tuple = ()) -> bytes:
    """code: None for a response, else the grpc.StatusCode name the call ends with."""
    return with_head(GRPC_REPLY, rid, {"code": code, "message": message, "trailing": [list(t) for t in trailing]},
                     response)


def decode_grpc_reply(payload: memoryview) -> tuple[str | None, str, tuple, bytes]:
    head, body = split_head(payload)
    try:
        return head["code"], str(head["message"]), tuple((str(k), str(v)) for k, v in head["trailing"]), bytes(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"gRPC answer does not decode: {exc!r}") from None


# --- lookups answered in a front end (serving/v2/lookups.py) ---------------------------------
def encode_local(head: dict, seconds: bytes) -> bytes:
    """head {model, version, count, rows}; seconds: count float64 totals then count float64
    encoding times, little-endian (LocalAnswers.take)."""
    return with_head(LOCAL, 0, head, seconds, plain=True)


def decode_local(payload: memoryview) -> tuple[str, str, np.ndarray, np.ndarray, int]:
    """(model, version, seconds, respond seconds, rows) of a LOCAL frame."""
    head, rest = split_head(payload)
    try:
        count = int(head["count"])
        seconds = np.frombuffer(rest, dtype="<f8")
        if count < 0 or len(seconds) != 2 * count:
            raise WireError(f"{len(seconds)} times for {count} answers")
        return str(head["model"]), str(head["version"]), seconds[:count], seconds[count:], int(head["rows"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"local answers do not decode: {exc!r}") from None
