"""Input tensors of a v2 request checked and decoded into arrays, ids validated against
the graph, and output tensors as raw little-endian bytes. Transport-neutral: HTTP and
gRPC hand in the same Tensor objects (serving/v2/types.py)."""

from __future__ import annotations

import math
from itertools import chain

import numpy as np

from hybridgnn.errors import BadRequest, PayloadTooLarge, brief
from hybridgnn.serving.v2.types import MISSING, Tensor

DTYPES = {"INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "FP32": np.dtype("<f4"), "UINT64": np.dtype("<u8")}
ID_DATATYPES = ("INT64", "INT32")
# logits: the model's output; embeddings: what its head reads (the hidden representation);
# predictions: argmax of the logits
OUTPUT_NAMES = ("logits", "embeddings", "predictions")
MAX_NAME_BYTES = 1024  # one node name in a BYTES input
# Names decode into a fixed-width array: every element as wide as the longest. It may
# take 4x what the names take unpadded (16 bytes a character sent), or this, whichever
# is larger, so a few long names among many short ones cannot make a small body cost
# gigabytes.
MAX_NAMES_FIXED_WIDTH_BYTES = 64 << 20
INPUT_NAME = "node_ids"


# A shape dimension beyond this is refused before any arithmetic on it (no request holds
# 2**48 values; larger ones make products and messages slow or unprintable).
MAX_DIM = 1 << 48
# Nor more dimensions than this (every input here has one or two): the product of a
# shape as long as a body holds took minutes, on the event loop, and its message raised.
MAX_RANK = 8
_INT64_MAX = (1 << 63) - 1


def _sizes(shape) -> bool:
    """Whether a declared shape is a list of at most MAX_RANK sizes: integers in [0, MAX_DIM)."""
    if type(shape) is not list or len(shape) > MAX_RANK:
        return False
    if len(shape) == 1:  # most inputs: a generator's set-up costs more than the check
        d = shape[0]
        return type(d) is int and 0 <= d < MAX_DIM
    return all(type(d) is int and 0 <= d < MAX_DIM for d in shape)


def declared_shape(t: Tensor) -> list[int] | None:
    """t's shape if it is one decode_tensor takes (a list of at most MAX_RANK sizes), else
    None: what a request declares, read before any element is decoded."""
    return t.shape if _sizes(t.shape) else None


def request_id(rid) -> str | None:
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


def decode_inputs(inputs: list[Tensor], specs: dict, accepted: str,
                  limits: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Named arrays of a request's inputs, each checked against specs[name] = (datatypes,
    layout). limits: the most elements an input may declare (413 before any element is
    decoded)."""
    tensors: dict[str, np.ndarray] = {}
    for t in inputs:
        name = t.name
        if not isinstance(name, str) or name not in specs:
            raise BadRequest(f"unknown input {brief(name)}; {accepted}")
        if name in tensors:
            raise BadRequest(f"input {name!r} appears twice")
        tensors[name] = decode_tensor(t, *specs[name], limit=limits.get(name) if limits is not None else None)
    return tensors


def decode_tensor(t: Tensor, datatypes: tuple[str, ...], layout: str, limit: int | None = None) -> np.ndarray:
    name, datatype, shape = t.name, t.datatype, t.shape
    if datatype not in datatypes:
        raise BadRequest(f"input {name!r} must have datatype {' or '.join(datatypes)}, got {brief(datatype)}")
    if not _sizes(shape):
        raise BadRequest(f"input {name!r} needs 'shape' as a list of at most {MAX_RANK} non-negative integers "
                         f"(each below 2**48), got {brief(shape)}")
    _check_shape(name, shape, layout)
    count = math.prod(shape)  # a Python product: np.prod on a short list costs more than the rest of decoding
    if limit is not None and count > limit:
        raise PayloadTooLarge(f"input {name!r} declares {count} elements; the limit is {limit}")
    if datatype == "BYTES":
        arr = decode_bytes(t, count)
        return arr.reshape(shape) if layout != "ids" else arr
    out_dtype = np.float32 if datatype == "FP32" else np.int64
    dtype = DTYPES[datatype]
    if t.raw is not None:
        if len(t.raw) != count * dtype.itemsize:
            raise BadRequest(f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
                             f"{len(t.raw)} were sent")
        arr = np.frombuffer(t.raw, dtype=dtype).astype(out_dtype)
        return arr.reshape(shape) if layout != "ids" else arr
    data = t.data
    if data is MISSING:
        raise BadRequest(f"input {name!r} has neither 'data' nor binary contents")
    kind = "numbers" if datatype == "FP32" else "integers"
    if isinstance(data, np.ndarray):
        arr = data
    else:
        if not isinstance(data, list):
            raise BadRequest(f"input {name!r}: 'data' must be a list of {kind}")
        _check_top_level(name, shape, count, data)
        try:
            arr = np.asarray(data)
        except (ValueError, OverflowError) as exc:
            raise BadRequest(f"input {name!r}: 'data' must be a (nested) list of {kind}: {exc}") from exc
    allowed = "iuf" if datatype == "FP32" else "iu"
    if arr.size and arr.dtype.kind not in allowed:
        if arr.dtype.kind == "b":
            raise _not_numbers(name, kind)
        if arr.dtype.kind in "fO" and not isinstance(data, np.ndarray):
            # numpy makes ints past int64 float64 (beside floats) or object: named as themselves
            _refuse_beyond_int64(name, data)
        raise BadRequest(f"input {name!r}: 'data' must hold {kind} only, found {arr.dtype.name} values")
    if arr.size != count:
        raise BadRequest(f"input {name!r}: shape {shape} has {count} elements but 'data' holds {arr.size}")
    if arr.ndim > 1 and list(arr.shape) != shape:
        # nested another way ([3, 2] rows for shape [2, 3]): reshaped, its values would
        # land in other places than the client put them
        raise BadRequest(f"input {name!r}: 'data' is nested as {list(arr.shape)}, not as its shape {shape}; send "
                         "it flat or nested as the shape")
    if not isinstance(data, np.ndarray) and holds_bool(data, arr.ndim):
        raise _not_numbers(name, kind)
    if arr.dtype.kind == "u" and out_dtype is np.int64 and arr.size and (top := int(arr.max())) > _INT64_MAX:
        raise _beyond_int64(name, top)
    # Past float32's range a value becomes inf, which the features' checks refuse (400);
    # numpy's overflow warning would only reach the server's stderr, once per client.
    with np.errstate(over="ignore"):
        arr = arr.astype(out_dtype).reshape(-1)
    return arr.reshape(shape) if layout != "ids" else arr


def holds_bool(data: list, ndim: int) -> bool:
    """Whether JSON data that numpy made a numeric array of `ndim` dimensions holds true or
    false: beside numbers numpy reads them as 1 and 0 (its array's dtype does not tell).
    Each element's type is compared in C (map, chain), not in a Python loop."""
    values = data
    for _ in range(ndim - 1):
        values = chain.from_iterable(values)
    return bool in map(type, values)


def _not_numbers(name: str, kind: str) -> BadRequest:
    return BadRequest(f"input {name!r}: 'data' must hold {kind}, not true/false")


def _length_fits(shape: list, count: int, n: int) -> bool:
    """Whether data of top-level length n may hold a shape's elements: flat (n = count) or
    nested as the shape (n = its first dimension)."""
    return n == count or (len(shape) > 1 and n == shape[0])


def _check_top_level(name, shape: list, count: int, data: list) -> None:
    """BadRequest when data's top-level length cannot fit the shape (_length_fits): refused
    before numpy walks it, since millions of tiny rows under a small shape held the event
    loop most of a second to be counted."""
    if not _length_fits(shape, count, len(data)):
        raise BadRequest(f"input {name!r}: shape {shape} has {count} elements but 'data' holds "
                         f"{len(data)} entries at its top level (send it flat or nested as the shape)")


def fits_its_shape(t: Tensor) -> bool:
    """Whether an input's JSON data (a list) may fit its declared shape by its top-level
    length, as decode_tensor reads it (True for anything else: decode_tensor judges it)."""
    return type(t.data) is not list or not _sizes(t.shape) or _length_fits(t.shape, math.prod(t.shape), len(t.data))


class UnfitRows(list):
    """Stands for JSON data that cannot fit its shape, of which only the top-level length
    crossed from a front end (numpy would walk millions of rows to turn them into bytes the
    engine then refuses): decode_tensor refuses it, after the same checks before, in the
    words it has for the list."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n


def _refuse_beyond_int64(name: str, data: list) -> None:
    """BadRequest naming the first integer in data beyond int64, if there is one."""
    for v in np.asarray(data, dtype=object).reshape(-1):
        if type(v) is int and not -_INT64_MAX - 1 <= v <= _INT64_MAX:
            raise _beyond_int64(name, v)


def _beyond_int64(name: str, value: int) -> BadRequest:
    if value < 0:
        return BadRequest(f"input {name!r}: {value} is beyond the smallest 64-bit signed integer "
                          f"({-_INT64_MAX - 1})")
    return BadRequest(f"input {name!r}: {value} is beyond the largest 64-bit signed integer ({_INT64_MAX})")


def decode_bytes(t: Tensor, count: int) -> np.ndarray:
    """A BYTES tensor of `count` UTF-8 strings: a list of strings (flat, or one list per
    row), or raw bytes in KServe's binary layout (each element a little-endian uint32
    length, then its bytes)."""
    name = t.name
    if t.raw is not None:
        raw, values, pos, size_all = bytes(t.raw), [], 0, len(t.raw)
        for _ in range(count):
            if pos + 4 > size_all:
                raise BadRequest(f"input {name!r}: binary BYTES data ends inside element {len(values)}")
            size = int.from_bytes(raw[pos:pos + 4], "little")
            if size > MAX_NAME_BYTES or pos + 4 + size > size_all:
                raise BadRequest(f"input {name!r}: element {len(values)} claims {size} bytes")
            values.append(raw[pos + 4:pos + 4 + size])
            pos += 4 + size
        if pos != size_all:
            raise BadRequest(f"input {name!r}: {size_all - pos} bytes left after {count} elements")
        try:
            names = [v.decode("utf-8") for v in values]
        except UnicodeDecodeError as exc:
            raise BadRequest(f"input {name!r}: node names must be UTF-8: {exc}") from exc
        return _fixed_width(name, names)
    data = t.data
    if isinstance(data, list) and data and all(isinstance(v, list) for v in data):
        data = [v for row in data for v in row]  # row-major nesting, as for the numeric types (one level)
    if not isinstance(data, list) or len(data) != count or not all(
            isinstance(v, str) and _name_fits(v) for v in data):
        raise BadRequest(f"input {name!r}: BYTES 'data' must be a list (flat, or one list per row) of {count} strings "
                         f"(each at most {MAX_NAME_BYTES} bytes of UTF-8)")
    return _fixed_width(name, data)


def _name_fits(text: str) -> bool:
    """Whether a name holds at most MAX_NAME_BYTES bytes of UTF-8, as in the binary layout
    (JSON counted characters: up to 4 times as many bytes passed there). Up to a quarter
    of the bound in characters always fits, so only longer names are encoded; a lone
    surrogate (JSON "\\ud800") is counted, not an error."""
    return len(text) <= MAX_NAME_BYTES // 4 or len(text.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES


def _fixed_width(name: str, names: list[str]) -> np.ndarray:
    """names as one fixed-width string array, refused (413) before it is made if it would
    be far larger than the names themselves."""
    if not names:
        return np.array(names, dtype=str)
    lengths = list(map(len, names))
    width_bytes = 4 * len(names) * max(lengths)  # numpy stores 4 bytes per character
    if width_bytes > max(MAX_NAMES_FIXED_WIDTH_BYTES, 16 * sum(lengths)):
        raise PayloadTooLarge(f"input {name!r}: {len(names)} names padded to the longest ({max(lengths)} characters) "
                              f"would take {width_bytes >> 20} MiB; send names of similar lengths, or fewer")
    return np.array(names, dtype=str).reshape(-1)


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
        if lo < -q or hi >= num_nodes + q:
            raise BadRequest(f"edge_index ids must lie in [0, {num_nodes + q}) (existing nodes, then query nodes "
                             f"{num_nodes}..{num_nodes + q - 1}) or name query nodes -1..-{q}; found [{lo}, {hi}]")
        if lo < 0:
            # -1 is the first query node, as in graph updates: ids that stay right when
            # nodes are added between the client reading num_nodes and sending this
            edge_index = np.where(edge_index < 0, num_nodes - 1 - edge_index, edge_index)
        touches_query = (edge_index >= num_nodes).any(axis=0)
        if not touches_query.all():
            bad = int(np.flatnonzero(~touches_query)[0])
            raise BadRequest(f"edge {bad} joins two existing nodes; query edges must touch a query node")
    return np.ascontiguousarray(features, dtype=np.float32), np.ascontiguousarray(edge_index, dtype=np.int64)


# Output dtypes sent as they are (the datatype's own little-endian dtype), to their datatype.
SENT_AS_IS = {np.dtype("<f4"): "FP32", np.dtype("<i8"): "INT64"}


def datatype_of(arr: np.ndarray) -> str:
    """The v2 datatype an output array is sent as."""
    return SENT_AS_IS.get(arr.dtype) or (
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


