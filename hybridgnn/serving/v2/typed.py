"""KServe v2 requests to a heterogeneous model decoded and validated: node outputs
(node_ids + parameters.node_type), pair scores (src_ids + dst_ids with src_type and
dst_type) and the top-k of candidates (src_ids + candidate_ids with src_type, dst_type
and k). Every refusal names the input or parameter at fault."""

from __future__ import annotations

import numpy as np

from hybridgnn.errors import BadRequest, PayloadTooLarge, brief
from hybridgnn.serving.v2.tensors import ID_DATATYPES, decode_inputs, request_id
from hybridgnn.serving.v2.types import InferInput
from hybridgnn.types import TypedQuery, TypedResult

_IDS = ((*ID_DATATYPES, "BYTES"), "ids")
INPUTS = {"node_ids": _IDS, "src_ids": _IDS, "dst_ids": _IDS, "candidate_ids": _IDS}
OUTPUTS = {"node": ("logits", "embeddings", "predictions"), "pair": ("scores",),
           "topk": ("topk_ids", "topk_scores")}
# A top-k scores every (seed, candidate): their product is bounded so one request cannot
# hold the workers (or memory) for long.
MAX_TOPK_PAIRS = 1 << 22
# k bounds the answer's size (n x k ids and scores), whatever the catalogue.
MAX_K = 1 << 12
MODES = ("sampled", "precomputed")
_ACCEPTED = ("a heterogeneous model takes 'node_ids' with parameters.node_type (node outputs), 'src_ids' and "
             "'dst_ids' with parameters.src_type and dst_type (pair scores), or 'src_ids' and 'candidate_ids' with "
             "parameters.src_type, dst_type and k (top-k; without candidate_ids, over every node of dst_type, in "
             "mode precomputed)")


class TypedInferRequest:
    """A validated request to a heterogeneous model: its query, the outputs to answer (in
    order) and the candidates as named (external ids, on a type with an id map)."""

    __slots__ = ("query", "outputs", "request_id", "_dst_ids", "mode")

    def __init__(self, query: TypedQuery, outputs: tuple[str, ...], rid: str | None, dst_ids: np.ndarray | None,
                 mode: str = "sampled"):
        self.query, self.outputs, self.request_id, self._dst_ids = query, outputs, rid, dst_ids
        self.mode = mode

    @property
    def num_outputs(self) -> int:
        return int(len(self.query.src_ids))

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


def decode_typed(request: InferInput, engine) -> TypedInferRequest:
    """The validated request (engine: a HeteroEngine: its graph, outputs, link decoder)."""
    if not request.inputs:
        raise BadRequest(f"inference request needs a non-empty 'inputs' list; {_ACCEPTED}")
    params = request.parameters
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")
    mode = params.get("mode", "sampled")
    if mode not in MODES:
        raise BadRequest(f"parameters.mode: heterogeneous models are served in modes {list(MODES)} (precomputed "
                         f"after `hybridgnn precompute`), got {brief(mode)}")
    max_nodes = engine.cfg.server.max_request_nodes
    tensors = decode_inputs(request.inputs, INPUTS, _ACCEPTED, dict.fromkeys(INPUTS, 2 * max_nodes))
    graph, names = engine.graph, set(tensors)
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
            query = TypedQuery("topk", src_type, src, dst_type, dst, k, whole_type=whole)
            id_map = graph.nodes[dst_type].id_map
            if id_map is not None:
                dst_external = id_map.external if whole else tensors["candidate_ids"].reshape(-1)
    else:
        raise BadRequest(f"inputs {sorted(names)} do not make a request; {_ACCEPTED}")
    available = OUTPUTS[query.kind]
    if request.outputs is None:
        outputs = available
    else:
        for name in request.outputs:
            if name not in available:
                raise BadRequest(f"unknown output {brief(name)} for a {query.kind} request; available: "
                                 f"{list(available)}")
        outputs = tuple(dict.fromkeys(request.outputs))
    return TypedInferRequest(query, outputs, request_id(request.id), dst_external, mode)
