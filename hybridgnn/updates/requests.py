"""Graph-update requests: as the log stores them, as the graph takes them, and the merge.

A request is kept in the log as its client sent it (`inputs`: the decoded tensors, node
ids as the client named them). It becomes an UpdateRequest (internal ids, -k for its
own k-th new node) only when it is applied, against the graph as it is at that log
position: on a dataset with an id map an id created by an earlier entry is then known on
every replica, whichever replica accepted the request. Building is deterministic, so
every replica accepts and rejects the same entries.

Log entries are numpy .npz blobs (allow_pickle=False: arrays, never code): each input's
rows of every request of the entry, concatenated, with a [requests, inputs] row-count
table, and each request's idempotency key and body digest.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from hybridgnn.errors import BadRequest, PayloadTooLarge, UpdateError, brief
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.graph.store import check_claimed_sizes

ENTRY_FORMAT = 2

# BYTES ids (and add_node_ids) only on a dataset imported with string node ids.
UPDATE_INPUTS = {
    "add_edges": (("INT64", "INT32", "BYTES"), "pairs"),
    "remove_edges": (("INT64", "INT32", "BYTES"), "pairs"),
    "add_node_features": (("FP32",), "matrix"),
    "add_node_ids": (("INT64", "INT32", "BYTES"), "ids"),
    "remove_nodes": (("INT64", "INT32", "BYTES"), "ids"),
    "update_ids": (("INT64", "INT32", "BYTES"), "ids"),
    "update_features": (("FP32",), "matrix"),
}
ID_INPUTS = ("add_edges", "remove_edges", "remove_nodes", "update_ids")
# The inputs whose rows are the request's updates (each node or edge added or removed, each
# feature row rewritten); update_features and add_node_ids pair with one of them row by row.
COUNTED_INPUTS = ("add_edges", "remove_edges", "add_node_features", "remove_nodes", "update_ids")


@dataclass
class UpdateRequest:
    """One client's update in internal ids; negative ids are its own new nodes (-1 = first)."""

    add_edges: np.ndarray
    remove_edges: np.ndarray
    add_node_features: np.ndarray
    remove_nodes: np.ndarray
    update_ids: np.ndarray
    update_features: np.ndarray
    # On a dataset with an id map: the external ids of the new nodes (add_node_ids), in order.
    new_external_ids: np.ndarray | None = None

    @property
    def num_new(self) -> int:
        return int(self.add_node_features.shape[0])

    @property
    def num_updates(self) -> int:
        return (len(self.add_edges) + len(self.remove_edges) + self.num_new + len(self.remove_nodes)
                + len(self.update_ids))


@dataclass
class LoggedRequest:
    """A request as the log holds it: its inputs as sent, its idempotency key and the
    SHA-256 of its body (a retry with the same key is answered, not applied, again)."""

    inputs: dict[str, np.ndarray]
    idempotency_key: str | None = None
    body_sha256: str | None = None

    @property
    def num_updates(self) -> int:
        rows = {name: len(a) for name, a in self.inputs.items()}
        return sum(rows.get(n, 0) for n in COUNTED_INPUTS)


# The largest feature value an update may set. Precomputed embeddings follow updates by
# running float64 sums per node: a value of 3e38 put in and taken out again left its
# neighbours' rows wrong for good (an error of 0.8 on GraphSAGE; inf - inf made NaN), on
# every replica and across restarts. Below this, what it costs the sums stays under float32
# rounding.
MAX_FEATURE_MAGNITUDE = 1e9


def check_feature_values(name: str, rows: np.ndarray) -> None:
    """BadRequest unless every value is finite and at most MAX_FEATURE_MAGNITUDE in size."""
    if not np.isfinite(rows).all():
        raise BadRequest(f"{name} holds NaN or infinite values")
    if rows.size and float(np.abs(rows).max()) > MAX_FEATURE_MAGNITUDE:
        raise BadRequest(f"{name} holds a value of magnitude {float(np.abs(rows).max()):.3g}; a graph update may set "
                         f"features of at most {MAX_FEATURE_MAGNITUDE:.0e}")


def build_request(inputs: dict[str, np.ndarray], *, feature_dim: int, max_updates: int,
                  id_map=None) -> UpdateRequest:
    """The UpdateRequest of a request's inputs against the graph as it is now (id_map:
    graph.idmap.IdMap when the dataset names nodes by external ids; then every node is
    named by one, new ones by add_node_ids). BadRequest names what is wrong."""
    tensors = dict(inputs)
    new_external = None
    if id_map is not None:
        tensors, new_external = _to_internal_ids(tensors, id_map)
    elif "add_node_ids" in tensors or any(a.dtype.kind == "U" for a in tensors.values()):
        raise BadRequest("this dataset numbers its nodes 0..n-1: name them by INT64 ids; add_node_ids and BYTES "
                         "ids are for datasets imported with an id map (new nodes get the next ids)")
    empty_pairs, empty_ids = np.empty((0, 2), np.int64), np.empty(0, np.int64)
    empty_rows = np.empty((0, feature_dim), np.float32)
    req = UpdateRequest(add_edges=tensors.get("add_edges", empty_pairs).astype(np.int64, copy=False),
                        remove_edges=tensors.get("remove_edges", empty_pairs).astype(np.int64, copy=False),
                        add_node_features=tensors.get("add_node_features", empty_rows),
                        remove_nodes=tensors.get("remove_nodes", empty_ids).astype(np.int64, copy=False),
                        update_ids=tensors.get("update_ids", empty_ids).astype(np.int64, copy=False),
                        update_features=tensors.get("update_features", empty_rows),
                        new_external_ids=new_external)
    for name in ("add_node_features", "update_features"):
        got = getattr(req, name)
        if got.ndim != 2 or got.shape[1] != feature_dim:
            raise BadRequest(f"{name} must be [count, {feature_dim}] (the graph's feature width), "
                             f"got {list(got.shape)}")
        check_feature_values(name, got)
    if len(req.update_ids) != len(req.update_features):
        raise BadRequest(f"update_ids names {len(req.update_ids)} nodes but update_features has "
                         f"{len(req.update_features)} rows")
    for name in ("add_edges", "update_ids"):  # own new nodes: -1 .. -num_new
        arr = getattr(req, name)
        if len(arr) and (arr < -req.num_new).any():
            own = f"-1 .. -{req.num_new}" if req.num_new else "and it adds none in add_node_features"
            raise BadRequest(f"{name}: negative ids name this request's new nodes ({own}); found {int(arr.min())}")
    for name in ("remove_edges", "remove_nodes"):
        if len(getattr(req, name)) and (getattr(req, name) < 0).any():
            raise BadRequest(f"{name}: ids must be >= 0")
    if req.num_updates == 0:
        raise BadRequest("the update is empty")
    if req.num_updates > max_updates:
        raise PayloadTooLarge(f"{req.num_updates} updates in one request; the limit is {max_updates}")
    return req


def _to_internal_ids(tensors: dict[str, np.ndarray], id_map) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every node named by its external id → internal ids; this request's new nodes (by
    their add_node_ids) → -1, -2, ... as on a dataset without a map. A node that is
    neither known nor new is a 400 naming it."""
    want = "BYTES (node names)" if id_map.kind == "string" else "INT64 (the dataset's own integer ids)"
    for name, arr in tensors.items():
        if name in (*ID_INPUTS, "add_node_ids") and not id_map.same_kind(arr):
            raise BadRequest(f"{name} must be {want} on this dataset")
    new = tensors.pop("add_node_ids", None)
    rows = tensors.get("add_node_features")
    if (0 if new is None else len(new)) != (0 if rows is None else len(rows)):
        raise BadRequest(f"add_node_ids names {0 if new is None else len(new)} nodes but add_node_features has "
                         f"{0 if rows is None else len(rows)} rows: on this dataset each new node needs its id")
    new = np.asarray(new if new is not None else np.empty(0, np.str_ if id_map.kind == "string" else np.int64))
    if len(np.unique(new)) != len(new):
        raise BadRequest("add_node_ids names a node twice")
    longest = id_map.max_new_name_chars
    if longest is not None and len(new) and (width := int(np.char.str_len(new).max())) > longest:
        raise BadRequest(f"add_node_ids: a name of {width} characters; a node added to this dataset may have at most "
                         f"{longest} (the longest imported name, or 64)")
    _, exists = id_map.to_internal(new)
    if exists.any():
        raise BadRequest(f"node {brief(new[np.flatnonzero(exists)[0]].item())} already exists")
    order = np.argsort(new, kind="stable")
    out = dict(tensors)
    for name in ID_INPUTS:
        if name not in tensors:
            continue
        ext = tensors[name]
        internal, known = id_map.to_internal(ext)
        if not known.all() and name in ("add_edges", "update_ids") and len(new):
            pos = np.minimum(np.searchsorted(new[order], ext), len(new) - 1)
            is_new = ~known & (new[order][pos] == ext)
            internal = np.where(is_new, -(order[pos] + 1), internal)
            known = known | is_new
        if not known.all():
            raise BadRequest(f"{name}: unknown node {brief(ext[~known].flat[0].item())}")
        out[name] = internal.astype(np.int64)
    return out, new


def to_batch(requests: list[UpdateRequest], num_nodes: int) -> tuple[UpdateBatch, list[np.ndarray]]:
    """Merge requests into one UpdateBatch against a graph of num_nodes nodes; also returns
    each request's assigned new-node ids (in request order, after num_nodes). UpdateError
    when a request names, by its id, a node a later request adds: alone, in order, it names
    no node (merged, it would take that one)."""
    parts = {k: [] for k in ("add", "rm", "feat", "rmn", "uid", "uf")}
    assigned, next_id = [], num_nodes
    for r in requests:
        own = np.arange(next_id, next_id + r.num_new, dtype=np.int64)
        assigned.append(own)

        def resolve(ids: np.ndarray, own=own) -> np.ndarray:
            ids = ids.astype(np.int64, copy=True)
            neg = ids < 0
            ids[neg] = own[-ids[neg] - 1]
            return ids

        next_id += r.num_new
        add, uid = resolve(r.add_edges), resolve(r.update_ids)
        if len(requests) > 1 and ((add >= next_id).any() or (uid >= next_id).any()):
            raise UpdateError(f"node {int(max(add.max(initial=0), uid.max(initial=0)))} is named before the request "
                              "that adds it")
        parts["add"].append(add)
        parts["rm"].append(r.remove_edges.astype(np.int64))
        parts["feat"].append(r.add_node_features)
        parts["rmn"].append(r.remove_nodes.astype(np.int64))
        parts["uid"].append(uid)
        parts["uf"].append(r.update_features)
    feats = np.concatenate(parts["feat"]).astype(np.float32)
    uf = np.concatenate(parts["uf"]).astype(np.float32)
    batch = UpdateBatch(add_edges=np.concatenate(parts["add"]).reshape(-1, 2),
                        remove_edges=np.concatenate(parts["rm"]).reshape(-1, 2),
                        add_node_features=feats if len(feats) else None,
                        remove_nodes=np.concatenate(parts["rmn"]),
                        update_ids=np.concatenate(parts["uid"]), update_features=uf if len(uf) else None)
    return batch, assigned


_NAMES = tuple(UPDATE_INPUTS)


def encode_entry(requests: list[LoggedRequest]) -> bytes:
    """One log entry: the requests a replica merged, in order. Ids a client named by
    string go to a column of their own (a mix never coerces numbers to strings)."""
    counts = np.zeros((len(requests), len(_NAMES)), np.int64)
    strings = np.zeros((len(requests), len(_NAMES)), bool)
    arrays: dict[str, np.ndarray] = {}
    for j, name in enumerate(_NAMES):
        parts: dict[str, list[np.ndarray]] = {name: [], f"{name}__str": []}
        for i, r in enumerate(requests):
            a = r.inputs.get(name)
            if a is None or not len(a):
                continue
            counts[i, j], strings[i, j] = len(a), a.dtype.kind == "U"
            if strings[i, j]:
                parts[f"{name}__str"].append(a)
            else:
                parts[name].append(a.astype(np.int64) if a.dtype.kind in "iu" else a)
        for column, got in parts.items():
            if got:
                arrays[column] = np.ascontiguousarray(np.concatenate(got))
    keys = np.array([r.idempotency_key or "" for r in requests], dtype=np.str_)
    digests = np.array([r.body_sha256 or "" for r in requests], dtype=np.str_)
    buf = io.BytesIO()
    np.savez(buf, format=np.int64(ENTRY_FORMAT), counts=counts, strings=strings, keys=keys, digests=digests,
             **arrays)
    return buf.getvalue()


class EntryFormat(ValueError):
    """A log entry another build wrote, in a format this one does not read."""

    def __init__(self, found: int | None):
        super().__init__(f"log entry format {'?' if found is None else found}, this build reads {ENTRY_FORMAT}")
        self.found = found


def decode_entry(blob: bytes) -> list[LoggedRequest]:
    """The requests of one log entry; EntryFormat if another build wrote it, ValueError if
    it is not one (damaged: a cut or changed blob raised zipfile's BadZipFile, EOFError,
    NotImplementedError or RuntimeError, which the follower did not take for damage and
    which stopped it)."""
    try:
        return _decode_entry(blob)
    except ValueError:  # EntryFormat included
        raise
    except Exception as exc:  # zip and .npy readers fail on damage in many types
        raise ValueError(f"not a log entry ({type(exc).__name__}: {exc})") from exc


def _decode_entry(blob: bytes) -> list[LoggedRequest]:
    f = io.BytesIO(blob)
    check_claimed_sizes(f, len(blob), "the entry")  # a damaged header claiming terabytes is not allocated
    with np.load(f, allow_pickle=False) as z:
        if "format" not in z.files or int(z["format"]) != ENTRY_FORMAT:
            raise EntryFormat(int(z["format"]) if "format" in z.files else None)
        counts, strings, keys, digests = z["counts"], z["strings"], z["keys"], z["digests"]
        columns = {name: z[name] for name in z.files if name.split("__")[0] in UPDATE_INPUTS}
    if counts.shape != strings.shape or counts.shape != (len(keys), len(_NAMES)) or len(digests) != len(keys):
        raise ValueError("log entry tables do not agree")
    if counts.dtype.kind not in "iu" or (counts.size and int(counts.min()) < 0):
        raise ValueError("log entry counts are not whole numbers >= 0")
    for j, name in enumerate(_NAMES):  # each column holds exactly what its requests count (else misread slices)
        for column, mask in ((name, ~strings[:, j].astype(bool)), (f"{name}__str", strings[:, j].astype(bool))):
            if int(counts[mask, j].sum()) != (len(columns[column]) if column in columns else 0):
                raise ValueError(f"log entry column {column} does not hold what its requests count")
    cursor = dict.fromkeys(columns, 0)
    out = []
    for i in range(len(counts)):
        inputs = {}
        for j, name in enumerate(_NAMES):
            if counts[i, j]:
                column = f"{name}__str" if strings[i, j] else name
                start = cursor[column]
                inputs[name] = columns[column][start:start + counts[i, j]]
                cursor[column] = start + counts[i, j]
        out.append(LoggedRequest(inputs, str(keys[i]) or None, str(digests[i]) or None))
    return out
