"""KServe v2 over HTTP: request bodies into v2 types, answers into bodies. JSON, and the
binary tensor extension as Triton and tritonclient speak it: the body starts with a JSON
header of Inference-Header-Content-Length bytes; each input with
parameters.binary_data_size has that many raw little-endian bytes after the header, in
input order. Answers are binary when the request sets parameters.binary_data_output or
an output's parameters.binary_data.

Only the format is checked here (the body parses, binary sizes fit what was sent); what
the request means is the v2 service's to check.
"""

from __future__ import annotations

import gc
import json
import sys

import numpy as np

from hybridgnn.errors import BadRequest, brief
from hybridgnn.serving.v2.tensors import SENT_AS_IS, datatype_of, raw_tensor
from hybridgnn.serving.v2.types import MISSING, InferAnswer, InferInput, Tensor

try:  # optional fast path; the stdlib encoder is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None
# Values per piece of a large JSON array, one turn of the event loop each (~2 ms of
# encoding; smaller pieces cost more in all): see encode_infer_steps
_PIECE_VALUES = 1 << 16

HEADER_LENGTH = "Inference-Header-Content-Length"
# A body past this parses with the collector paused: a parse makes only acyclic objects,
# and a 16 MiB body of small nested lists made some 4M of them, which set off collections
# that walked the whole heap over and over (2 s of the event loop instead of 0.3 s).
GC_PAUSE_BYTES = 64 << 10


def _loads(data: bytes):
    """_parse with the collector paused for a large body (GC_PAUSE_BYTES)."""
    if len(data) < GC_PAUSE_BYTES or not gc.isenabled():
        return _parse(data)
    gc.disable()
    try:
        return _parse(data)
    finally:
        gc.enable()


def _parse(data: bytes):
    """Parse a JSON body. orjson when installed; whatever it refuses goes to the stdlib
    parser, so what is accepted (integers beyond 64 bits, NaN) and each error message are
    the same either way. Raises BadRequest for anything it cannot parse: invalid JSON,
    nesting deeper than the parser's stack (about 1000 levels; a few thousand from Python
    3.12), an integer literal longer than Python converts (sys.get_int_max_str_digits(),
    4300 digits by default)."""
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data.decode())  # a str skips json's encoding detection; KServe bodies are UTF-8
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except ValueError:  # int() of a literal past the interpreter's digit limit
        raise BadRequest(f"request body holds an integer literal of more than {sys.get_int_max_str_digits()} "
                         "digits") from None


def quick_loads(data: bytes):
    """Parse a JSON body the fast way, or raise (any exception): _loads decides what a
    body it refuses is. For lanes that fall back to the general way."""
    return _orjson.loads(data) if _orjson is not None else json.loads(data.decode())


def parse_load(body: bytes) -> dict | None:
    """The parameters of a repository load or unload request's body (none when it is empty)."""
    if not body.strip():
        return None
    doc = _loads(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("parameters", {}), dict):
        raise BadRequest("a repository load or unload body must be a JSON object, its 'parameters' an object")
    return doc.get("parameters")


def split_body(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """(JSON header, binary tail) of a KServe v2 body, plain JSON or binary-extension."""
    if header_length is not None:
        # digits only, as Content-Length: int() also reads "+78", "7_8" and " 78 "
        if not (header_length.isascii() and header_length.isdigit()) or len(header_length) > 20:
            raise BadRequest(f"{HEADER_LENGTH} must be a byte count (digits), got {brief(header_length)}")
        hlen = int(header_length)
        if not 0 < hlen <= len(body):
            raise BadRequest(f"{HEADER_LENGTH}={hlen} does not fit a body of {len(body)} bytes")
        header, binary = _loads(body[:hlen]), memoryview(body)[hlen:]
    else:
        if not body:
            raise BadRequest("request body is empty; expected a KServe v2 inference request")
        header, binary = _loads(body), memoryview(b"")
    if not isinstance(header, dict):
        raise BadRequest("request must be a JSON object")
    return header, binary


def tensors_of(inputs, binary: memoryview) -> list[Tensor]:
    """The input tensors of a parsed header: each input's data as sent, or (never both) its
    slice of the binary tail (parameters.binary_data_size bytes, in input order), which
    must be used up."""
    if not isinstance(inputs, list):
        raise BadRequest("'inputs' must be a list of input tensors")
    out, offset, size = [], 0, len(binary)
    for inp in inputs:
        if not isinstance(inp, dict):
            raise BadRequest("each input must be an object with name, shape, datatype and data")
        params = inp.get("parameters")
        bsize = params.get("binary_data_size") if isinstance(params, dict) else None
        if bsize is None:
            out.append(Tensor(inp.get("name"), inp.get("datatype"), inp.get("shape"), inp.get("data", MISSING)))
            continue
        if "data" in inp:  # one of the two would be ignored: the answer would be for values not meant
            raise BadRequest(f"input {brief(inp.get('name'))} holds both 'data' and binary_data_size: send its "
                             "values in one of them")
        if type(bsize) is not int or bsize < 0 or bsize > size - offset:
            raise BadRequest(f"input {brief(inp.get('name'))}: binary_data_size={brief(bsize)} must be a byte count "
                             f"within the {size - offset} bytes sent")
        out.append(Tensor(inp.get("name"), inp.get("datatype"), inp.get("shape"), raw=binary[offset:offset + bsize]))
        offset += bsize
    if offset != size:
        raise BadRequest(f"binary data holds {size} bytes but inputs declare {offset}")
    return out


def _switch(value, what: str) -> bool:
    """A true/false parameter as sent: "yes", 0 or "false" would be read as whatever
    Python's truth says, which is not what every client means."""
    if type(value) is bool:
        return value
    raise BadRequest(f"{what} must be true or false, got {brief(value)}")


def parse_infer(body: bytes, header_length: str | None, model: str, version: str | None,
                waited_s: float = 0.0, standing: bool = False) -> tuple[InferInput, dict[str, bool] | bool]:
    """(the inference request, how to answer each output: a name -> binary map, or one
    choice for all) of a body."""
    header, binary = split_body(body, header_length)
    get = header.get
    inputs, params, requested = get("inputs"), get("parameters"), get("outputs")
    if params is None:
        params = {}
    default_binary = _switch(params.get("binary_data_output", False), "binary_data_output") \
        if type(params) is dict else False
    names, binary_of = None, default_binary
    if requested is not None:
        if not isinstance(requested, list):
            raise BadRequest("'outputs' must be a list")
        names, binary_of = [], {}
        for out in requested:
            if not isinstance(out, dict):  # the service would name it "unknown output None"
                raise BadRequest(f"each output must be an object with a 'name', got {brief(out)}")
            name = out.get("name")
            oparams = out.get("parameters")
            if oparams is not None and not isinstance(oparams, dict):
                raise BadRequest(f"output {brief(name)}'s parameters must be an object, got {brief(oparams)}")
            names.append(name)
            if isinstance(name, str):
                binary_of[name] = (_switch(oparams.get("binary_data", default_binary), f"output {name!r}'s binary_data")
                                   if oparams else default_binary)
    if inputs is None:
        tensors = []
    elif not binary and type(inputs) is list:
        # Plain JSON (most requests): data as sent, no tail to slice. Every request pays
        # this, a refused one too; anything else takes tensors_of's checks.
        tensors = []
        for i in inputs:
            if type(i) is not dict or "parameters" in i:
                tensors = tensors_of(inputs, binary)
                break
            tensors.append(Tensor(i.get("name"), i.get("datatype"), i.get("shape"), i.get("data", MISSING)))
    else:
        tensors = tensors_of(inputs, binary)
    return InferInput(model, version, tensors, params, names, get("id"), waited_s, standing), binary_of


def parse_update(body: bytes, header_length: str | None) -> list[Tensor]:
    """The input tensors of a graph-update body."""
    header, binary = split_body(body, header_length)
    inputs = header.get("inputs")
    return tensors_of(inputs, binary) if inputs is not None else []


def _dumps(obj) -> bytes:
    if _orjson is not None:
        return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, separators=(",", ":")).encode()


def _json_values(arr):
    """An output's values as the JSON encoder takes them: with orjson the flat array itself,
    whose numbers it writes straight from memory (a float32 in its shortest form, which
    reads back as the same float32), 2-3x cheaper than a list of Python numbers for large
    answers (8192 x 256 embeddings: 64 ms against 214 ms) and about 40% fewer bytes."""
    flat = arr.reshape(-1)
    if _orjson is not None and flat.dtype.kind in "fiub" and flat.dtype.isnative:
        return np.ascontiguousarray(flat)
    return flat.tolist()


def _output_entry(name: str, arr, binary: bool, data=None) -> tuple[dict, bytes | None]:
    """An output's entry in the answer's JSON header (with `data` in place of the values if
    given), and its raw bytes when sent binary."""
    as_is = SENT_AS_IS.get(arr.dtype)  # inline: called for every output of every answer
    datatype = as_is or datatype_of(arr)
    entry = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
    if binary:
        raw = arr.tobytes() if as_is else raw_tensor(arr, datatype)  # tobytes: C order, whatever the strides
        entry["parameters"] = {"binary_data_size": len(raw)}
        return entry, raw
    entry["data"] = _json_values(arr) if data is None else data
    return entry, None


def _answer_header(answer: InferAnswer, entries: list[dict]) -> dict:
    header = {"model_name": answer.model, "outputs": entries}
    if answer.version is not None:
        header["model_version"] = answer.version
    if answer.id is not None:
        header["id"] = answer.id
    return header


def encode_infer_response(answer: InferAnswer, binary: dict[str, bool] | bool) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a 200 answer. binary: per output name, or for all; binary outputs
    follow the JSON header in output order."""
    steps = encode_infer_steps(answer, binary)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def takes_turns(answer: InferAnswer, binary: dict[str, bool] | bool) -> bool:
    """Whether encode_infer_steps stops on the way: an output sent as JSON has more than
    _PIECE_VALUES values."""
    for name, arr in answer.outputs:
        if arr.size > _PIECE_VALUES and not (binary if type(binary) is bool else binary.get(name, False)):
            return True
    return False


def encode_infer_steps(answer: InferAnswer, binary: dict[str, bool] | bool):
    """encode_infer_response as a generator that yields after each piece of a large JSON
    output's data and before joining them (core/eager.in_turns runs one step per turn of
    the loop, ~2 ms each at most), and returns (body, headers): the bytes one encoder call
    writes."""
    entries, blobs, pieced = [], [], []
    for i, (name, arr) in enumerate(answer.outputs):
        as_binary = binary if type(binary) is bool else binary.get(name, False)
        if not as_binary and arr.size > _PIECE_VALUES:  # its data spliced in, in pieces
            mark = f"\x00hybridgnn-data-{i}\x00"
            entry, raw = _output_entry(name, arr, False, mark)
            pieced.append((_dumps(mark), arr))
        else:
            entry, raw = _output_entry(name, arr, as_binary)
        entries.append(entry)
        if raw is not None:
            blobs.append(raw)
    head = _dumps(_answer_header(answer, entries))
    if pieced and any(head.count(mark) != 1 for mark, _ in pieced):  # the request's id holds a mark
        for entry, (name, arr) in zip(entries, answer.outputs, strict=True):
            if "data" in entry:
                entry["data"] = _json_values(arr)
        head, pieced = _dumps(_answer_header(answer, entries)), []
    if pieced:
        out = []
        for mark, arr in pieced:
            before, head = head.split(mark, 1)
            out.append(before)
            flat = arr.reshape(-1)
            for i in range(0, flat.size, _PIECE_VALUES):
                yield
                out.append(b"," if i else b"[")
                out.append(memoryview(_dumps(_json_values(flat[i:i + _PIECE_VALUES])))[1:-1])
            out.append(b"]")
        out.append(head)
        yield
        head = b"".join(out)
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def json_data(arr) -> bytes:
    """An output's `data` as a JSON answer writes it."""
    return _dumps(_json_values(arr))


def json_answer_parts(answer: InferAnswer, id_hole: bool = False) -> list[bytes] | None:
    """The JSON body of `answer` around its outputs' data: parts[0], json_data(output 0),
    parts[1], ... parts[k] joined are encode_infer_response(answer, False)'s body, and so is
    the same with other outputs of the same names, shapes and datatypes. id_hole: the
    answer's id is a hole too, the last one (the header writes it after the outputs), to
    be filled with the id as a JSON string. None when the parts cannot be told apart (a
    name holds a marker)."""
    entries, marks = [], []
    for i, (name, arr) in enumerate(answer.outputs):
        mark = f"\x00hybridgnn-data-{i}\x00"
        entries.append(_output_entry(name, arr, False, mark)[0])
        marks.append(_dumps(mark))
    if id_hole:
        mark = "\x00hybridgnn-id\x00"
        answer = InferAnswer(answer.model, answer.version, mark, answer.outputs)
        marks.append(_dumps(mark))
    head = _dumps(_answer_header(answer, entries))
    parts = []
    for mark in marks:
        if head.count(mark) != 1:
            return None
        part, head = head.split(mark)
        parts.append(part)
    return [*parts, head]
