"""KServe v2 requests to a heterogeneous model decoded and validated: node outputs
(node_ids + parameters.node_type), pair scores (src_ids + dst_ids with src_type and
dst_type) and the top-k of candidates (src_ids + candidate_ids with src_type, dst_type
and k). Every refusal names the input or parameter at fault."""

from __future__ import annotations

import numpy as np

from hybridgnn.errors import BadRequest, Conflict, PayloadTooLarge, brief
from hybridgnn.graph.hetero import reverse_edge_type
from hybridgnn.serving.v2.tensors import ID_DATATYPES, decode_inputs, request_id
from hybridgnn.serving.v2.types import InferInput
from hybridgnn.types import TypedNewNodes, TypedQuery, TypedResult

_IDS = ((*ID_DATATYPES, "BYTES"), "ids")
INPUTS = {"node_ids": _IDS, "src_ids": _IDS, "dst_ids": _IDS, "candidate_ids": _IDS,
          "features": (("FP32",), "matrix"), "neighbor_ids": _IDS, "query_index": (ID_DATATYPES, "ids"),
          "edge_type": (("BYTES",), "ids")}
NEW_NODE_INPUTS = {"features", "neighbor_ids", "query_index", "edge_type"}
NEW_NODE_MODES = ("full", "pe", "srpe")
# Edges per query node a request may bring, as for homogeneous new-node requests.
EDGES_PER_NODE = 64
OUTPUTS = {"node": ("logits", "embeddings", "predictions"), "pair": ("scores",),
           "topk": ("topk_ids", "topk_scores"), "new": ("logits", "embeddings", "predictions"),
           "new_topk": ("logits", "embeddings", "predictions", "topk_ids", "topk_scores")}
# A top-k scores every (seed, candidate): their product is bounded so one request cannot
# hold the workers (or memory) for long.
MAX_TOPK_PAIRS = 1 << 22
# k bounds the answer's size (n x k ids and scores), whatever the catalogue.
MAX_K = 1 << 12
# and so does n x k: the answer is encoded on the event loop, and 2048 x 2048 ids and
# scores (96 MB of JSON) held it 0.5 s, every other request waiting behind it.
MAX_TOPK_ANSWER = 1 << 18
MODES = ("sampled", "precomputed")
_ACCEPTED = ("a heterogeneous model takes 'node_ids' with parameters.node_type (node outputs), 'src_ids' and "
             "'dst_ids' with parameters.src_type and dst_type (pair scores), 'src_ids' and 'candidate_ids' with "
             "parameters.src_type, dst_type and k (top-k; without candidate_ids, over every node of dst_type, in "
             "mode precomputed), or 'features' with 'neighbor_ids', 'query_index' and 'edge_type' (new nodes)")


class TypedInferRequest:
    """A validated request to a heterogeneous model: its query, the outputs to answer (in
    order) and the candidates as named (external ids, on a type with an id map)."""

    __slots__ = ("query", "outputs", "request_id", "_dst_ids", "mode")

    def __init__(self, query: TypedQuery, outputs: tuple[str, ...], rid: str | None, dst_ids: np.ndarray | None,
                 mode: str = "sampled"):
        self.query, self.outputs, self.request_id, self._dst_ids = query, outputs, rid, dst_ids
        self.mode = mode

    @property
    def is_new_nodes(self) -> bool:
        return isinstance(self.query, TypedNewNodes)

    @property
    def num_outputs(self) -> int:
        q = self.query
        return int(len(q.features) if isinstance(q, TypedNewNodes) else len(q.src_ids))

    def answer_outputs(self, result: TypedResult) -> list[tuple[str, np.ndarray]]:
        out = []
        for name in self.outputs:
            if name == "topk_ids":  # the candidates as the client named them
                named = self._dst_ids if self._dst_ids is not None else self.query.dst_ids
                out.append((name, named[result.topk_index]))
            else:
                out.append((name, getattr(result, name)))
        return out


def _type_param(params: dict, name: str, choices: list[str], what: str) -> str:
    if name not in params:
        raise BadRequest(f"parameters.{name} is required: the node type of {what} (one of {choices})")
    value = params[name]
    if not isinstance(value, str) or value not in choices:
        raise BadRequest(f"parameters.{name}: unknown node type {brief(value)}; {what} may be of {choices}")
    return value


def _ids(field: str, values: np.ndarray, graph, ntype: str) -> np.ndarray:
    """Internal ids of type `ntype` named by input `field`; BadRequest naming the field."""
    if values.size == 0:
        raise BadRequest(f"{field} is empty; send at least one id")
    id_map = graph.nodes[ntype].id_map
    n = graph.num_nodes(ntype)
    if id_map is not None:
        if not id_map.same_kind(values):
            want = "BYTES (node names)" if id_map.kind == "string" else "INT64 (the dataset's own integer ids)"
            raise BadRequest(f"{field} must be {want} for node type {ntype!r}")
        internal, known = id_map.to_internal(values)
        if not known.all():
            raise BadRequest(f"{field}: unknown {ntype!r} id {brief(values[np.flatnonzero(~known)[0]].item())}")
        return np.ascontiguousarray(internal, dtype=np.int64)
    if values.dtype.kind == "U":
        raise BadRequest(f"{field} must be INT64: node type {ntype!r} numbers its nodes 0..{n - 1}")
    ids = np.ascontiguousarray(values, dtype=np.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise BadRequest(f"{field}: id {bad} is out of range for node type {ntype!r} ({n} nodes: ids 0..{n - 1})")
    return ids


def input_limits(engine) -> dict[str, int]:
    """The most elements each input may declare (413 past it, before any is decoded)."""
    max_nodes = engine.cfg.server.max_request_nodes
    return {**dict.fromkeys(INPUTS, 2 * max_nodes), "features": max_nodes * max(1, engine.max_feature_dim),
            **dict.fromkeys(("neighbor_ids", "query_index", "edge_type"), EDGES_PER_NODE * max_nodes)}


def decode_typed(request: InferInput, engine) -> TypedInferRequest:
    """The validated request (engine: a HeteroEngine: its graph, outputs, link decoder)."""
    if not request.inputs:
        raise BadRequest(f"inference request needs a non-empty 'inputs' list; {_ACCEPTED}")
    params = request.parameters
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")
    max_nodes = engine.cfg.server.max_request_nodes
    tensors = decode_inputs(request.inputs, INPUTS, _ACCEPTED, input_limits(engine))
    graph, names = engine.graph, set(tensors)
    if names & NEW_NODE_INPUTS:
        query, dst_external = _new_nodes(tensors, params, engine)
        return TypedInferRequest(query, _outputs(request, "new_topk" if query.k else "new"), request_id(request.id),
                                 dst_external, query.mode)
    mode = params.get("mode", "sampled")
    if mode not in MODES:
        raise BadRequest(f"parameters.mode: heterogeneous models are served in modes {list(MODES)} (precomputed "
                         f"after `hybridgnn precompute`), got {brief(mode)}")
    total = sum(v.size for v in tensors.values())
    if total > max_nodes:
        raise PayloadTooLarge(f"the request names {total} ids; at most {max_nodes} per request")
    dst_external = None
    if names == {"node_ids"}:
        ntype = _type_param(params, "node_type", list(engine.out_dims), "node_ids")
        query = TypedQuery("node", ntype, _ids("node_ids", tensors["node_ids"], graph, ntype))
    elif names in ({"src_ids", "dst_ids"}, {"src_ids", "candidate_ids"}, {"src_ids"}):
        if engine.decoder is None:
            raise BadRequest("this model has no link decoder, so it answers node requests only (save it with "
                             "hybridgnn.save_model(..., link_decoder='dot') to score pairs)")
        pairs = [list(p) for p in engine.link_pairs]
        src_type = _type_param(params, "src_type", sorted({p[0] for p in pairs}), "src_ids")
        other = "dst_ids" if "dst_ids" in names else "candidate_ids"
        dst_type = _type_param(params, "dst_type", sorted({p[1] for p in pairs}), other)
        if [src_type, dst_type] not in pairs:
            raise BadRequest(f"parameters.src_type/dst_type: the link decoder does not score ({src_type!r}, "
                             f"{dst_type!r}) pairs; it scores {pairs}")
        src = _ids("src_ids", tensors["src_ids"], graph, src_type)
        whole = names == {"src_ids"}
        if whole:  # a top-k over every node of dst_type: only precomputed rows make it cheap
            if mode != "precomputed":
                raise BadRequest("src_ids without dst_ids or candidate_ids asks for a top-k over every "
                                 f"{dst_type!r} node, which needs parameters.mode 'precomputed'; send "
                                 "candidate_ids to rank a candidate set in mode 'sampled'")
            dst = np.arange(graph.num_nodes(dst_type), dtype=np.int64)
        else:
            dst = _ids(other, tensors[other], graph, dst_type)
        if other == "dst_ids":
            if len(src) != len(dst):
                raise BadRequest(f"src_ids and dst_ids must have the same length (one pair each), got {len(src)} "
                                 f"and {len(dst)}")
            query = TypedQuery("pair", src_type, src, dst_type, dst)
        else:
            named = f"every {dst_type!r} node" if whole else "candidate_ids"
            if len(src) * len(dst) > MAX_TOPK_PAIRS:
                raise PayloadTooLarge(f"src_ids x {named} = {len(src) * len(dst)} pairs to score; the limit is "
                                      f"{MAX_TOPK_PAIRS}")
            k = params.get("k")
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(len(dst), MAX_K):
                raise BadRequest(f"parameters.k must be an integer in [1, {min(len(dst), MAX_K)}] (at most the "
                                 f"number of candidates, {len(dst)}), got {brief(k)}")
            check_topk_answer(len(src), k)
            query = TypedQuery("topk", src_type, src, dst_type, dst, k, whole_type=whole)
            id_map = graph.nodes[dst_type].id_map
            if id_map is not None:
                dst_external = id_map.external if whole else tensors["candidate_ids"].reshape(-1)
    else:
        raise BadRequest(f"inputs {sorted(names)} do not make a request; {_ACCEPTED}")
    return TypedInferRequest(query, _outputs(request, query.kind), request_id(request.id), dst_external, mode)


def check_topk_answer(n: int, k: int) -> None:
    """PayloadTooLarge when n seeds' top k would answer more than MAX_TOPK_ANSWER entries."""
    if n * k > MAX_TOPK_ANSWER:
        raise PayloadTooLarge(f"{n} seeds x k {k} = {n * k} top-k entries to answer; the limit is {MAX_TOPK_ANSWER} "
                              "(fewer seeds per request, or a smaller k)")


def _outputs(request: InferInput, kind: str) -> tuple[str, ...]:
    available = OUTPUTS[kind]
    if request.outputs is None:
        return available
    for name in request.outputs:
        if name not in available:
            what = "new-node" if kind.startswith("new") else kind
            raise BadRequest(f"unknown output {brief(name)} for a {what} request; available: {list(available)}")
    return tuple(dict.fromkeys(request.outputs))


def _edge_type(name, graph, node_type: str, field: str):
    """The edge type `name` ('src__rel__dst') names, one that touches node_type."""
    by_name = {"__".join(e): e for e in graph.edge_types}
    e = by_name.get(name) if isinstance(name, str) else None
    touching = [n for n, e in by_name.items() if node_type in (e[0], e[2])]
    if e is None or node_type not in (e[0], e[2]):
        raise BadRequest(f"{field}: {brief(name)} is not an edge type touching node type {node_type!r}; one of "
                         f"{touching}")
    return e


def _new_nodes(tensors: dict, params: dict, engine) -> tuple[TypedNewNodes, np.ndarray | None]:
    """New query nodes of parameters.node_type: features [q, F], and for edge i the
    existing node neighbor_ids[i] joined to query node query_index[i] (default 0) by
    relation edge_type[i] (or parameters.edge_type for every edge). The query node is the
    relation's source when it is of the source type, else its target; the reverse edge
    type (rev_<rel>), where the graph has one, gets the reversed edge, and so does the
    relation itself when it joins a type to itself and is stored both ways."""
    graph, cfg = engine.graph, engine.cfg
    if "features" not in tensors:
        raise BadRequest("a new-node request needs 'features' (FP32 [q, F]): one row per query node")
    extra = set(tensors) - NEW_NODE_INPUTS
    if extra:
        raise BadRequest(f"inputs {sorted(extra)} do not go with 'features' (a new-node request); {_ACCEPTED}")
    if not getattr(engine, "serves_new_nodes", False):
        raise Conflict("new-node requests need precomputed embeddings; run `hybridgnn precompute --dataset "
                       f"{cfg.dataset_dir} --model {cfg.model_dir}` and restart")
    node_type = _type_param(params, "node_type", list(engine.out_dims), "the query nodes")
    features = tensors["features"]
    q, width = features.shape
    if q == 0 or q > cfg.server.max_request_nodes:
        # too many is the request's size, a 413 as past the other limits: a type narrower
        # than the widest passes the declared-size check before decoding, and got a 400
        refusal = BadRequest if q == 0 else PayloadTooLarge
        raise refusal(f"features must have 1 to {cfg.server.max_request_nodes} rows (query nodes), got {q}")
    if width != graph.nodes[node_type].feature_dim:
        raise BadRequest(f"features must have {graph.nodes[node_type].feature_dim} columns (node type "
                         f"{node_type!r}'s feature width), got {width}")
    if not np.all(np.isfinite(features)):
        raise BadRequest("features must be finite (no NaN or infinity)")
    mode = params.get("mode", cfg.new_nodes.default_mode)
    if mode not in NEW_NODE_MODES:
        raise BadRequest(f"parameters.mode: new-node requests to a heterogeneous model take {list(NEW_NODE_MODES)}, "
                         f"got {brief(mode)}")
    gamma = params.get("gamma", cfg.new_nodes.gamma)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise BadRequest(f"parameters.gamma must be a number within [0, 1], got {brief(gamma)}")
    policy = params.get("policy", cfg.new_nodes.policy)
    if policy not in ("ratio", "random", "degree"):
        raise BadRequest(f"parameters.policy must be ratio, random or degree, got {brief(policy)}")
    k, dst_type, dst_external = params.get("k"), None, None
    if k is not None:
        pairs = [list(p) for p in engine.link_pairs]
        if engine.decoder is None or not any(p[0] == node_type for p in pairs):
            raise BadRequest(f"parameters.k: the model's link decoder does not score pairs from node type "
                             f"{node_type!r} ({pairs or 'no decoder'})")
        dst_type = _type_param(params, "dst_type", sorted({p[1] for p in pairs if p[0] == node_type}),
                               "the candidates (every node of it)")
        n_dst = graph.num_nodes(dst_type)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(n_dst, MAX_K):
            raise BadRequest(f"parameters.k must be an integer in [1, {min(n_dst, MAX_K)}], got {brief(k)}")
        check_topk_answer(q, k)
        if q * n_dst > MAX_TOPK_PAIRS:
            raise PayloadTooLarge(f"query nodes x every {dst_type!r} node = {q * n_dst} pairs to score; the limit "
                                  f"is {MAX_TOPK_PAIRS}")
        id_map = graph.nodes[dst_type].id_map
        dst_external = id_map.external if id_map is not None else np.arange(n_dst, dtype=np.int64)
    # after the cheap refusals: a request bound to be refused costs no edge decoding
    edges = _new_node_edges(tensors, params, graph, node_type, q)
    return TypedNewNodes(node_type, np.ascontiguousarray(features, dtype=np.float32), edges, mode, float(gamma),
                         policy, dst_type, int(k or 0)), dst_external


def _new_node_edges(tensors: dict, params: dict, graph, node_type: str, q: int) -> dict:
    """Local [2, m] edges per edge type of a new-node request (reverse types added)."""
    if "neighbor_ids" not in tensors:
        if "query_index" in tensors or "edge_type" in tensors:
            raise BadRequest("query_index and edge_type describe edges; send the neighbours in 'neighbor_ids'")
        return {}
    neighbors = tensors["neighbor_ids"].reshape(-1)
    m = len(neighbors)
    index = tensors.get("query_index")
    if index is None:
        if q != 1:
            raise BadRequest(f"query_index is required with {q} query nodes: the query node (0..{q - 1}) of each "
                             "neighbour")
        index = np.zeros(m, np.int64)
    index = index.reshape(-1)
    if len(index) != m:
        raise BadRequest(f"query_index must have one entry per neighbor_ids entry ({m}), got {len(index)}")
    if m and (int(index.min()) < 0 or int(index.max()) >= q):
        raise BadRequest(f"query_index must lie in [0, {q}) (a row of features), found [{int(index.min())}, "
                         f"{int(index.max())}]")
    if "edge_type" in tensors:
        names = tensors["edge_type"].reshape(-1)
        if len(names) != m:
            raise BadRequest(f"edge_type must have one entry per neighbor_ids entry ({m}), got {len(names)}")
        relations = [str(v) for v in np.unique(names)]
        kinds = {r: _edge_type(r, graph, node_type, "edge_type") for r in relations}
        which = np.searchsorted(np.asarray(relations), names)
    else:
        if "edge_type" not in params:
            if m == 0:  # no edges to join: isolated query nodes, as without neighbor_ids
                return {}
            raise BadRequest("parameters.edge_type (or an edge_type input, one per neighbour) is required: the "
                             "relation joining each query node to its neighbour, as 'src__rel__dst'")
        relations = [params["edge_type"]]
        kinds = {relations[0]: _edge_type(relations[0], graph, node_type, "parameters.edge_type")}
        which = np.zeros(m, np.int64)
    edges: dict = {}
    n_q = graph.num_nodes(node_type)
    for j, r in enumerate(relations):
        e = kinds[r]
        at = np.flatnonzero(which == j)
        if at.size == 0:  # an empty neighbour list: isolated query nodes, however the relation is given
            continue
        other = e[2] if e[0] == node_type else e[0]
        ids = _ids("neighbor_ids", neighbors[at], graph, other)
        query = n_q + index[at].astype(np.int64)
        pair = np.stack([query, ids]) if e[0] == node_type else np.stack([ids, query])
        rev = reverse_edge_type(graph.edge_types, e)
        if rev is None and graph.symmetric(e):  # a relation stored both ways: the new edges too
            rev = e
        for kind, ei in ((e, pair), (rev, pair[::-1])):
            if kind is not None:
                edges[kind] = np.concatenate([edges[kind], ei], axis=1) if kind in edges else ei
    return {e: _unique_columns(ei) for e, ei in edges.items()}


def _unique_columns(ei: np.ndarray) -> np.ndarray:
    """np.unique(ei, axis=1) for [2, m] node ids, through one int64 key per column: the
    same columns in the same (lexicographic) order, at the cost of a 1-D unique.
    np.unique(axis=1) sorts rows as structured values, and held the event loop 0.8 s for
    a request of half a million edges."""
    if ei.shape[1] == 0:
        return ei
    span = int(ei[1].max()) + 1
    if (int(ei[0].max()) + 1) * span >= 1 << 62:  # ids this large do not fit one key
        return np.unique(ei, axis=1)
    _, first = np.unique(ei[0].astype(np.int64) * span + ei[1], return_index=True)
    return ei[:, first]
