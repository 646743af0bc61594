"""KServe v2 requests decoded and validated: inferences (existing or new nodes) and graph
updates, from the Tensor objects any transport hands in (serving/v2/types.py)."""

from __future__ import annotations

import math
import time

import numpy as np

from hybridgnn.errors import BadRequest, PayloadTooLarge, brief
from hybridgnn.serving.core.updates import PendingUpdate
from hybridgnn.serving.v2.tensors import (
    ID_DATATYPES,
    INPUT_NAME,
    OUTPUT_NAMES,
    _sizes,
    decode_inputs,
    map_external_ids,
    map_query_edges,
    request_id,
    validate_new_nodes,
    validate_node_ids,
)
from hybridgnn.serving.v2.types import ID_OUTPUT, InferInput, InferRequest, Tensor
from hybridgnn.updates.requests import UPDATE_INPUTS, LoggedRequest, build_request

# name -> (accepted datatypes, layout): "ids" 1-D [n]; "matrix" [q, F]; "edges" [2, m]
INPUTS = {
    INPUT_NAME: ((*ID_DATATYPES, "BYTES"), "ids"),
    "features": (("FP32",), "matrix"),
    "edge_index": ((*ID_DATATYPES, "BYTES"), "edges"),
    "query_ids": ((*ID_DATATYPES, "BYTES"), "ids"),  # new nodes' names, on a dataset with an id map
}


_ACCEPTED_INPUTS = (f"this model takes {INPUT_NAME!r} (INT64 [n]) for existing nodes, or 'features' (FP32 [q, F]) "
                    "and 'edge_index' (INT64 [2, m]) for new nodes")


def declared_ids(request: InferInput) -> int | None:
    """How many node ids a sampled inference declares (the product of its node_ids input's
    shape; 0 when that is not a list of sizes), or None when it is not one: it names
    another mode, or sends new nodes (features, edge_index). Nothing is validated
    (decode_infer does that): this is what admission can judge a request's work by before
    decoding it."""
    params = request.parameters
    if isinstance(params, dict) and params.get("mode", "sampled") != "sampled":
        return None
    declared = 0
    for t in request.inputs:
        name = t.name
        if name == INPUT_NAME:
            if _sizes(t.shape):
                declared = math.prod(t.shape)
        elif name == "features" or name == "edge_index":
            return None
    return declared


def decode_infer(request: InferInput, *, max_nodes: int, num_nodes: int, feature_dim: int | None = None,
                 max_edges: int | None = None, id_map=None,
                 default_outputs: tuple[str, ...] | None = None) -> InferRequest:
    """The validated inference of a request. id_map (graph.idmap.IdMap): the dataset names
    nodes by external ids, which node_ids then holds (INT64 for integer ids, BYTES for
    names) and the answer echoes as node_ids. default_outputs: what a request that names
    no outputs gets (None: all)."""
    if not request.inputs:
        raise BadRequest("inference request needs a non-empty 'inputs' list")
    params = request.parameters
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be an object")
    # Element caps checked on the declared shapes before any element is decoded (twice the
    # node limit, so requests just past it still get the limit's own message below).
    width = max(1, feature_dim or 1)
    edges = max_edges if max_edges is not None else 64 * max_nodes
    limits = {INPUT_NAME: 2 * max_nodes, "query_ids": 2 * max_nodes, "features": 2 * max_nodes * width,
              "edge_index": 4 * edges}
    tensors = decode_inputs(request.inputs, INPUTS, _ACCEPTED_INPUTS, limits)
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
            feature_dim=feature_dim, max_edges=edges)
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
    names = (*OUTPUT_NAMES, ID_OUTPUT) if req.external_ids is not None else OUTPUT_NAMES
    if request.outputs is None:
        req.outputs = (names if default_outputs is None
                       else tuple(n for n in names if n in default_outputs or n == ID_OUTPUT))
    else:
        for name in request.outputs:
            if name not in names:
                raise BadRequest(f"unknown output {brief(name)}; available: {list(names)}")
        req.outputs = tuple(dict.fromkeys(request.outputs))
    req.request_id = request_id(request.id)
    return req


def decode_update(inputs: list[Tensor], *, feature_dim: int, max_updates: int, id_map=None,
                  idempotency_key: str | None = None, body_sha256: str | None = None) -> PendingUpdate:
    """A graph update validated as far as it can be without the graph (400, 413): the
    update request is built here once (updates.requests.build_request); what depends on
    the graph is checked when it is logged. id_map (graph.idmap.IdMap): the dataset names
    nodes by external ids; the request then names every node by one (INT64 or BYTES, as
    the dataset), new ones included (add_node_ids, one per add_node_features row), and is
    built against the graph when it is applied."""
    if not inputs:
        raise BadRequest("a graph update needs a non-empty 'inputs' list naming any of "
                         f"{', '.join(UPDATE_INPUTS)}")
    if idempotency_key is not None and not (1 <= len(idempotency_key) <= 255 and idempotency_key.isprintable()):
        raise BadRequest("Idempotency-Key must be 1 to 255 printable characters")
    tensors = decode_inputs(inputs, UPDATE_INPUTS, f"a graph update takes any of {', '.join(UPDATE_INPUTS)}")
    logged = LoggedRequest(tensors, idempotency_key, body_sha256 if idempotency_key is not None else None)
    built = None
    if id_map is None:
        built = build_request(tensors, feature_dim=feature_dim, max_updates=max_updates)  # needs no graph
        count = built.num_updates
    else:
        for name in ("add_node_features", "update_features"):
            got = tensors.get(name)
            if got is not None and (got.shape[1] != feature_dim or not np.isfinite(got).all()):
                raise BadRequest(f"{name} must be [count, {feature_dim}] finite values (the graph's feature width), "
                                 f"got {list(got.shape)}")
        count = logged.num_updates
        if count == 0:
            raise BadRequest("the update is empty")
        if count > max_updates:
            raise PayloadTooLarge(f"{count} updates in one request; the limit is {max_updates}")
    return PendingUpdate(logged, count, time.monotonic(), built)
