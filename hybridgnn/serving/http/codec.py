"""KServe v2 / Open Inference Protocol codec, JSON and binary-tensor extension.

Binary extension (as Triton and tritonclient speak it): the body starts with a JSON
header of Inference-Header-Content-Length bytes; each input with
parameters.binary_data_size has that many raw little-endian bytes after the header, in
input order. Responses are binary when the request sets parameters.binary_data_output
or an output's parameters.binary_data.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from hybridgnn.errors import BadRequest, PayloadTooLarge, brief

try:  # optional fast path; the stdlib encoder is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

HEADER_LENGTH = "Inference-Header-Content-Length"
DTYPES = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "FP32": np.dtype("<f4"), "UINT64": np.dtype("<u8")}
ID_DATATYPES = ("INT64", "INT32")
# logits: the model's output; embeddings: what its head reads (the hidden representation);
# predictions: argmax of the logits
OUTPUT_NAMES = ("logits", "embeddings", "predictions")
ID_OUTPUT = "node_ids"  # the request's ids echoed, on datasets with an id map (external ids)
MAX_NAME_BYTES = 1024  # one node name in a BYTES input
INPUT_NAME = "node_ids"


# A shape dimension beyond this is refused before any arithmetic on it (no request holds
# 2**48 values; larger ones make products and messages slow or unprintable).
MAX_DIM = 1 << 48


@dataclass
class InferRequest:
    """node_ids for existing nodes, or features + edge_index for new (query) nodes."""

    node_ids: np.ndarray | None = None
    features: np.ndarray | None = None  # float32 [q, F]
    edge_index: np.ndarray | None = None  # int64 [2, m]; query node i is num_nodes + i
    request_id: str | None = None
    outputs: dict[str, bool] = field(default_factory=dict)  # name -> binary
    external_ids: np.ndarray | None = None  # node_ids as the client named them (datasets with an id map)
    parameters: dict = field(default_factory=dict)

    @property
    def is_new_nodes(self) -> bool:
        return self.features is not None

    @property
    def num_outputs(self) -> int:
        return int(self.features.shape[0] if self.features is not None else self.node_ids.shape[0])


# name -> (accepted datatypes, layout): "ids" 1-D [n]; "matrix" [q, F]; "edges" [2, m]
INPUTS = {
    INPUT_NAME: ((*ID_DATATYPES, "BYTES"), "ids"),
    "features": (("FP32",), "matrix"),
    "edge_index": ((*ID_DATATYPES, "BYTES"), "edges"),
    "query_ids": ((*ID_DATATYPES, "BYTES"), "ids"),  # new nodes' names, on a dataset with an id map
}


_ACCEPTED_INPUTS = (f"this model takes {INPUT_NAME!r} (INT64 [n]) for existing nodes, or 'features' (FP32 [q, F]) "
                    "and 'edge_index' (INT64 [2, m]) for new nodes")


def _sizes(shape) -> bool:
    """Whether a declared shape is a list of sizes: integers in [0, MAX_DIM)."""
    if type(shape) is not list:
        return False
    if len(shape) == 1:  # most inputs: a generator's set-up costs more than the check
        d = shape[0]
        return type(d) is int and 0 <= d < MAX_DIM
    return all(type(d) is int and 0 <= d < MAX_DIM for d in shape)


def _loads(data: bytes):
    """Parse a JSON body. orjson when installed; whatever it refuses goes to the stdlib
    parser, so what is accepted (integers beyond 64 bits, NaN) and each error message are
    the same either way. Raises BadRequest for anything it cannot parse: invalid JSON,
    nesting deeper than the parser's stack (about 1000 levels), an integer literal longer
    than Python converts (sys.get_int_max_str_digits(), 4300 digits by default)."""
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


def split_body(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    """(JSON header, binary tail) of a KServe v2 body, plain JSON or binary-extension."""
    if header_length is not None:
        try:
            hlen = int(header_length)
        except ValueError:
            raise BadRequest(f"{HEADER_LENGTH} must be an integer, got {brief(header_length)}") from None
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


def decode_infer_request(body: bytes, header_length: str | None, *, max_nodes: int, num_nodes: int,
                         feature_dim: int | None = None, max_edges: int | None = None,
                         id_map=None, default_outputs: tuple[str, ...] | None = None) -> InferRequest:
    """id_map (graph.idmap.IdMap): the dataset names nodes by external ids, which node_ids
    then holds (INT64 for integer ids, BYTES for names) and the answer echoes as node_ids."""
    header, binary = split_body(body, header_length)
    return decode_infer_parts(header, binary, max_nodes=max_nodes, num_nodes=num_nodes, feature_dim=feature_dim,
                              max_edges=max_edges, id_map=id_map, default_outputs=default_outputs)


def declared_ids(header) -> int | None:
    """How many node ids a parsed inference header declares for a sampled inference (the
    product of its node_ids input's shape; 0 when that is not a list of sizes), or None
    when it is not one: it names another mode, or sends new nodes (features, edge_index).
    Nothing is validated (decode_infer_parts does that): this is what admission can judge
    a request's work by before decoding it."""
    if not isinstance(header, dict):
        return 0
    params = header.get("parameters")
    if isinstance(params, dict) and params.get("mode", "sampled") != "sampled":
        return None
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        return 0
    declared = 0
    for inp in inputs:
        if isinstance(inp, dict):
            name = inp.get("name")
            if name == INPUT_NAME:
                shape = inp.get("shape")
                if _sizes(shape):
                    declared = math.prod(shape)
            elif name == "features" or name == "edge_index":
                return None
    return declared


def decode_infer_parts(header: dict, binary: memoryview, *, max_nodes: int, num_nodes: int,
                       feature_dim: int | None = None, max_edges: int | None = None, id_map=None,
                       default_outputs: tuple[str, ...] | None = None) -> InferRequest:
    """An inference request from its JSON header and binary tail (any transport that can
    put its request in this form: the gRPC front end does). default_outputs: what a
    request that names no outputs gets (default: all)."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("inference request needs a non-empty 'inputs' list")
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")

    # Element caps checked on the declared shapes before any element is decoded (twice the
    # node limit, so requests just past it still get the limit's own message below).
    width = max(1, feature_dim or 1)
    edges = max_edges if max_edges is not None else 64 * max_nodes
    limits = {INPUT_NAME: 2 * max_nodes, "query_ids": 2 * max_nodes, "features": 2 * max_nodes * width,
              "edge_index": 4 * edges}
    tensors = decode_inputs(inputs, binary, INPUTS, _ACCEPTED_INPUTS, limits)
    req = InferRequest(parameters=params)
    if "features" in tensors or "edge_index" in tensors:
        if INPUT_NAME in tensors:
            raise BadRequest(f"send either {INPUT_NAME!r} (existing nodes) or 'features' + 'edge_index' "
                             "(new nodes), not both")
        if not {"features", "edge_index"} <= tensors.keys():
            raise BadRequest("a new-node request needs both 'features' (FP32 [q, F]) and 'edge_index' (INT64 [2, m])")
        if id_map is not None:
            tensors["edge_index"], req.external_ids = map_query_edges(tensors, id_map, num_nodes)
        elif "query_ids" in tensors or tensors["edge_index"].dtype.kind == "U":
            raise BadRequest("this dataset numbers its nodes 0..n-1: edge_index is INT64, query nodes are "
                             f"{num_nodes}.. (query_ids and BYTES ids are for datasets imported with an id map)")
        req.features, req.edge_index = validate_new_nodes(
            tensors["features"], tensors["edge_index"], max_nodes=max_nodes, num_nodes=num_nodes,
            feature_dim=feature_dim, max_edges=max_edges if max_edges is not None else 64 * max_nodes)
    elif INPUT_NAME in tensors:
        ids = tensors[INPUT_NAME]
        if id_map is not None:
            req.external_ids, ids = map_external_ids(ids, id_map, max_nodes=max_nodes)
        elif ids.dtype.kind == "U":
            raise BadRequest(f"{INPUT_NAME} must be INT64 here: this dataset numbers its nodes 0..{num_nodes - 1} "
                             "(BYTES names are for datasets imported with an id map)")
        req.node_ids = validate_node_ids(ids, max_nodes=max_nodes, num_nodes=num_nodes)
    else:
        raise BadRequest(f"input {INPUT_NAME!r} is missing")

    default_binary = bool(params.get("binary_data_output", False))
    requested = header.get("outputs")
    names = (*OUTPUT_NAMES, ID_OUTPUT) if req.external_ids is not None else OUTPUT_NAMES
    if requested is None:
        req.outputs = {n: default_binary for n in names if default_outputs is None or n in default_outputs
                       or n == ID_OUTPUT}
    else:
        if not isinstance(requested, list):
            raise BadRequest("'outputs' must be a list")
        for out in requested:
            name = out.get("name") if isinstance(out, dict) else None
            if name not in names:
                raise BadRequest(f"unknown output {brief(name)}; available: {list(names)}")
            oparams = out.get("parameters") or {}
            req.outputs[name] = (bool(oparams.get("binary_data", default_binary)) if isinstance(oparams, dict)
                                 else default_binary)
    req.request_id = _request_id(header.get("id"))
    return req


def _request_id(rid) -> str | None:
    """The request's 'id', echoed in the answer: a string (a number is taken as its text)."""
    if rid is None:
        return None
    if isinstance(rid, (int, float)) and not isinstance(rid, bool):
        rid = str(rid)  # within the parser's digit limit, so it converts
    if not isinstance(rid, str):
        raise BadRequest(f"'id' must be a string, got {type(rid).__name__}")
    try:
        rid.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): the answer could not carry it
        raise BadRequest("'id' must be valid Unicode (it holds a lone surrogate)") from None
    return rid


def decode_inputs(inputs: list, binary: memoryview, specs: dict, accepted: str,
                  limits: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Named tensors of a request's `inputs`, each checked against specs[name] =
    (datatypes, layout); binary inputs consume the tail in order, which must be used up.
    limits: the most elements an input may declare (413 before any element is decoded)."""
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for inp in inputs:
        if not isinstance(inp, dict):
            raise BadRequest("each input must be an object with name, shape, datatype and data")
        name = inp.get("name")
        if not isinstance(name, str) or name not in specs:
            raise BadRequest(f"unknown input {brief(name)}; {accepted}")
        if name in tensors:
            raise BadRequest(f"input {name!r} appears twice")
        arr, used = decode_tensor(inp, binary[offset:], *specs[name],
                                  limit=limits.get(name) if limits is not None else None)
        offset += used
        tensors[name] = arr
    if offset != len(binary):
        raise BadRequest(f"binary data holds {len(binary)} bytes but inputs declare {offset}")
    return tensors


def _check_shape(name, shape, layout):
    if layout == "ids":
        if len(shape) > 2 or (len(shape) == 2 and 1 not in shape):
            raise BadRequest(f"input {name!r} must be 1-D [n] (or [1, n] / [n, 1]), got shape {brief(shape)}")
    elif layout == "matrix":
        if len(shape) != 2:
            raise BadRequest(f"input {name!r} must be 2-D [q, F], got shape {brief(shape)}")
    elif layout == "pairs":
        if len(shape) != 2 or shape[1] != 2:
            raise BadRequest(f"input {name!r} must be [m, 2] (source, target) pairs, got shape {brief(shape)}")
    elif len(shape) != 2 or shape[0] != 2:
        raise BadRequest(f"input {name!r} must be [2, m] (sources, targets), got shape {brief(shape)}")


def decode_tensor(inp: dict, binary: memoryview, datatypes: tuple[str, ...], layout: str,
                  limit: int | None = None) -> tuple[np.ndarray, int]:
    name = inp.get("name")
    datatype = inp.get("datatype")
    shape = inp.get("shape")
    if datatype not in datatypes:
        raise BadRequest(f"input {name!r} must have datatype {' or '.join(datatypes)}, got {brief(datatype)}")
    if not _sizes(shape):
        raise BadRequest(f"input {name!r} needs 'shape' as a list of non-negative integers (each below "
                         f"2**48), got {brief(shape)}")
    _check_shape(name, shape, layout)
    count = math.prod(shape)  # a Python product: np.prod on a short list costs more than the rest of decoding
    if limit is not None and count > limit:
        raise PayloadTooLarge(f"input {name!r} declares {count} elements; the limit is {limit}")
    if datatype == "BYTES":
        arr, used = decode_bytes(inp, binary, count)
        return (arr.reshape(shape) if layout != "ids" else arr), used
    out_dtype = np.float32 if datatype == "FP32" else np.int64
    iparams = inp.get("parameters") or {}
    bsize = iparams.get("binary_data_size") if isinstance(iparams, dict) else None
    dtype = DTYPES[datatype]
    if bsize is not None:
        if type(bsize) is not int or bsize < 0 or bsize > len(binary):
            raise BadRequest(f"input {name!r}: binary_data_size={brief(bsize)} must be a byte count within the "
                             f"{len(binary)} bytes sent")
        if bsize != count * dtype.itemsize:
            raise BadRequest(f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
                             f"binary_data_size says {bsize}")
        arr = np.frombuffer(binary[:bsize], dtype=dtype).astype(out_dtype)
        return (arr.reshape(shape) if layout != "ids" else arr), bsize
    if "data" not in inp:
        raise BadRequest(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    data = inp["data"]
    kind = "numbers" if datatype == "FP32" else "integers"
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r}: 'data' must be a list of {kind}")
    try:
        arr = np.asarray(data)
    except (ValueError, OverflowError) as exc:
        raise BadRequest(f"input {name!r}: 'data' must be a (nested) list of {kind}: {exc}") from exc
    allowed = "iuf" if datatype == "FP32" else "iu"
    if arr.size and arr.dtype.kind not in allowed:
        raise BadRequest(f"input {name!r}: 'data' must hold {kind} only, found {arr.dtype.name} values")
    if arr.size != count:
        raise BadRequest(f"input {name!r}: shape {shape} has {count} elements but 'data' holds {arr.size}")
    arr = arr.astype(out_dtype).reshape(-1)
    return (arr.reshape(shape) if layout != "ids" else arr), 0


def map_external_ids(ids: np.ndarray, id_map, *, max_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(external ids as given, internal ids); BadRequest naming the first unknown id."""
    if ids.size > max_nodes:
        raise BadRequest(f"node_ids holds {ids.size} ids; at most {max_nodes} per request")
    if (ids.dtype.kind == "U") != (id_map.kind == "string"):
        want = "BYTES (node names)" if id_map.kind == "string" else "INT64 (the dataset's original integer ids)"
        raise BadRequest(f"{INPUT_NAME} must be {want} on this dataset")
    internal, known = id_map.to_internal(ids)
    if not known.all():
        raise BadRequest(f"unknown node id {brief(ids[np.flatnonzero(~known)[0]].item())}")
    return ids, internal


def map_query_edges(tensors: dict, id_map, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """A new-node request on a dataset with an id map: query_ids names the query nodes
    (one per features row, none an existing node) and edge_index names nodes by external
    ids. Returns (edge_index in internal ids, query nodes as num_nodes.., query_ids)."""
    want = "BYTES (node names)" if id_map.kind == "string" else "INT64 (the dataset's own integer ids)"
    query, edges = tensors.get("query_ids"), tensors["edge_index"]
    if query is None:
        raise BadRequest("on this dataset a new-node request names its query nodes in 'query_ids' (one per "
                         "features row), and edge_index names nodes by those and the dataset's own ids")
    for name, arr in (("query_ids", query), ("edge_index", edges)):
        if not id_map.same_kind(arr):
            raise BadRequest(f"{name} must be {want} on this dataset")
    if len(query) != len(tensors["features"]):
        raise BadRequest(f"query_ids names {len(query)} nodes but features has {len(tensors['features'])} rows")
    if len(np.unique(query)) != len(query):
        raise BadRequest("query_ids names a node twice")
    _, exists = id_map.to_internal(query)
    if exists.any():
        raise BadRequest(f"query node {brief(query[np.flatnonzero(exists)[0]].item())} names an existing node")
    internal, known = id_map.to_internal(edges)
    if not known.all() and len(query):
        order = np.argsort(query, kind="stable")
        pos = np.minimum(np.searchsorted(query[order], edges), len(query) - 1)
        is_query = ~known & (query[order][pos] == edges)
        internal = np.where(is_query, num_nodes + order[pos], internal)
        known |= is_query
    if not known.all():
        raise BadRequest(f"edge_index: unknown node {brief(edges[~known].flat[0].item())}")
    return internal.astype(np.int64), query


def decode_bytes(inp: dict, binary: memoryview, count: int) -> tuple[np.ndarray, int]:
    """A BYTES tensor of `count` UTF-8 strings: JSON 'data' (a list of strings) or KServe's
    binary layout (each element a little-endian uint32 length, then its bytes)."""
    name = inp.get("name")
    iparams = inp.get("parameters") or {}
    bsize = iparams.get("binary_data_size") if isinstance(iparams, dict) else None
    if bsize is not None:
        if type(bsize) is not int or bsize < 0 or bsize > len(binary):
            raise BadRequest(f"input {name!r}: binary_data_size={brief(bsize)} must be a byte count within the "
                             f"{len(binary)} bytes sent")
        raw, values, pos = bytes(binary[:bsize]), [], 0
        for _ in range(count):
            if pos + 4 > bsize:
                raise BadRequest(f"input {name!r}: binary BYTES data ends inside element {len(values)}")
            size = int.from_bytes(raw[pos:pos + 4], "little")
            if size > MAX_NAME_BYTES or pos + 4 + size > bsize:
                raise BadRequest(f"input {name!r}: element {len(values)} claims {size} bytes")
            values.append(raw[pos + 4:pos + 4 + size])
            pos += 4 + size
        if pos != bsize:
            raise BadRequest(f"input {name!r}: {bsize - pos} bytes left after {count} elements")
        try:
            return np.array([v.decode("utf-8") for v in values], dtype=str).reshape(-1), bsize
        except UnicodeDecodeError as exc:
            raise BadRequest(f"input {name!r}: node names must be UTF-8: {exc}") from exc
    data = inp.get("data")
    if isinstance(data, list) and data and all(isinstance(v, list) for v in data):
        data = [v for row in data for v in row]  # row-major nesting, as for the numeric types (one level)
    if not isinstance(data, list) or len(data) != count or not all(
            isinstance(v, str) and len(v) <= MAX_NAME_BYTES for v in data):
        raise BadRequest(f"input {name!r}: BYTES 'data' must be a list (flat, or one list per row) of {count} strings "
                         f"(each at most {MAX_NAME_BYTES} characters)")
    return np.array(data, dtype=str).reshape(-1), 0


def validate_node_ids(ids: np.ndarray, *, max_nodes: int, num_nodes: int) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise BadRequest("node_ids is empty; send at least one node id")
    if ids.size > max_nodes:
        raise BadRequest(f"node_ids holds {ids.size} ids; at most {max_nodes} per request")
    if ids.size <= 8:  # a reduction's fixed cost dwarfs a few ids (most requests carry few)
        small = ids.tolist()
        lo, hi = min(small), max(small)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise BadRequest(f"node ids must be >= 0, got {lo}")
    if hi >= num_nodes:
        raise BadRequest(f"node id {hi} is out of range; the graph has {num_nodes} nodes (ids 0..{num_nodes - 1})")
    return ids


def validate_new_nodes(features: np.ndarray, edge_index: np.ndarray, *, max_nodes: int, num_nodes: int,
                       feature_dim: int | None, max_edges: int) -> tuple[np.ndarray, np.ndarray]:
    q = features.shape[0]
    if q == 0:
        raise BadRequest("features has no rows; send at least one query node")
    if q > max_nodes:
        raise BadRequest(f"features has {q} query nodes; at most {max_nodes} per request")
    if feature_dim is not None and features.shape[1] != feature_dim:
        raise BadRequest(f"features must have {feature_dim} columns (the graph's feature width), got {features.shape[1]}")
    if not np.all(np.isfinite(features)):
        raise BadRequest("features must be finite (no NaN or infinity)")
    m = edge_index.shape[1]
    if m > max_edges:
        raise BadRequest(f"edge_index has {m} edges; at most {max_edges} per request")
    if m:
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= num_nodes + q:
            raise BadRequest(f"edge_index ids must lie in [0, {num_nodes + q}) (existing nodes, then query nodes "
                             f"{num_nodes}..{num_nodes + q - 1}); found [{lo}, {hi}]")
        touches_query = (edge_index >= num_nodes).any(axis=0)
        if not touches_query.all():
            bad = int(np.flatnonzero(~touches_query)[0])
            raise BadRequest(f"edge {bad} joins two existing nodes; query edges must touch a query node")
    return np.ascontiguousarray(features, dtype=np.float32), np.ascontiguousarray(edge_index, dtype=np.int64)


def _dumps(obj) -> bytes:
    if _orjson is not None:
        return _orjson.dumps(obj)
    return json.dumps(obj, separators=(",", ":")).encode()


# Output dtypes sent as they are (the datatype's own little-endian dtype), to their datatype.
_SENT_AS_IS = {np.dtype("<f4"): "FP32", np.dtype("<i8"): "INT64"}


def datatype_of(arr: np.ndarray) -> str:
    """The v2 datatype an output array is sent as."""
    return _SENT_AS_IS.get(arr.dtype) or (
        "BYTES" if arr.dtype.kind == "U" else "FP32" if arr.dtype.kind == "f" else "INT64")


def raw_tensor(arr: np.ndarray, datatype: str | None = None) -> bytes:
    """An output's raw little-endian bytes (BYTES: each element 4-byte length prefixed),
    as the binary extension and gRPC's raw contents carry it. datatype: datatype_of(arr),
    when the caller has it."""
    datatype = datatype or datatype_of(arr)
    if datatype == "BYTES":
        return b"".join(len(b).to_bytes(4, "little") + b for b in (s.encode() for s in arr.reshape(-1).tolist()))
    dtype = DTYPES[datatype]
    # tobytes() writes C order whatever the strides; a conversion only when the dtype differs
    return arr.tobytes() if arr.dtype == dtype else arr.astype(dtype).tobytes()


def encode_infer_response(model_name: str, request_id: str | None, tensors: dict[str, np.ndarray],
                          outputs: dict[str, bool], model_version: str | None = None) -> tuple[bytes, dict[str, str]]:
    """Returns (body, headers). Binary outputs follow the JSON header in output order."""
    entries, blobs = [], []
    for name, binary in outputs.items():
        arr = tensors[name]
        as_is = _SENT_AS_IS.get(arr.dtype)
        datatype = as_is or datatype_of(arr)
        entry = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary:
            raw = arr.tobytes() if as_is else raw_tensor(arr, datatype)  # tobytes: C order, whatever the strides
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        entries.append(entry)
    header = {"model_name": model_name, "outputs": entries}
    if model_version is not None:
        header["model_version"] = model_version  # the version that answered
    if request_id is not None:
        header["id"] = request_id
    head = _dumps(header)
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
