"""KServe v2 inferences decoded and validated (existing or new nodes), from the Tensor
objects any transport hands in (serving/v2/types.py). Imports no torch: a front-end
process decodes the lookups it answers itself with the same code as the engine."""

from __future__ import annotations

import math

import numpy as np

from hybridgnn.errors import BadRequest, brief
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
from hybridgnn.serving.v2.types import ID_OUTPUT, InferInput, InferRequest

# name -> (accepted datatypes, layout): "ids" 1-D [n]; "matrix" [q, F]; "edges" [2, m]
INPUTS = {
    INPUT_NAME: ((*ID_DATATYPES, "BYTES"), "ids"),
    "features": (("FP32",), "matrix"),
    "edge_index": ((*ID_DATATYPES, "BYTES"), "edges"),
    "query_ids": ((*ID_DATATYPES, "BYTES"), "ids"),  # new nodes' names, on a dataset with an id map
}


_ACCEPTED_INPUTS = (f"this model takes {INPUT_NAME!r} (INT64 [n]) for existing nodes, or 'features' (FP32 [q, F]) "
                    "and 'edge_index' (INT64 [2, m]) for new nodes")


def declared_node_ids(request: InferInput) -> int:
    """The product of the node_ids input's declared shape (0 when there is none, or its
    shape is not a list of sizes), whatever the mode; nothing is decoded."""
    for t in request.inputs:
        if t.name == INPUT_NAME and _sizes(t.shape):
            return math.prod(t.shape)
    return 0


def check_declared_node_ids(request: InferInput, max_nodes: int) -> int:
    """declared_node_ids, or BadRequest past max_nodes: the request's own fault at any load
    (a 429 or 503 would be retried), refused before anything is decoded. A front end
    serving the engine's one model refuses it as the engine does, before the copy."""
    named = declared_node_ids(request)
    if named > max_nodes:
        raise BadRequest(f"{INPUT_NAME} holds {named} ids; at most {max_nodes} per request")
    return named


def declared_ids(request: InferInput, named: int | None = None) -> int | None:
    """How many node ids a sampled inference declares (declared_node_ids, or `named` when
    the caller has it already), or None when it is not one: it names another mode, or
    sends new nodes (features, edge_index). Nothing is validated (decode_infer does that):
    this is what admission can judge a request's work by before decoding it."""
    params = request.parameters
    if isinstance(params, dict) and params.get("mode", "sampled") != "sampled":
        return None
    if any(t.name == "features" or t.name == "edge_index" for t in request.inputs):
        return None
    return declared_node_ids(request) if named is None else named


def input_limits(max_nodes: int, feature_dim: int | None = None, max_edges: int | None = None) -> dict[str, int]:
    """The most elements each input may declare, checked on the declared shapes before any
    element is decoded (413 past it)."""
    # twice the node and edge limits, so requests just past them still get the limits' own 400s
    width = max(1, feature_dim or 1)
    edges = max_edges if max_edges is not None else 64 * max_nodes
    return {INPUT_NAME: 2 * max_nodes, "query_ids": 2 * max_nodes, "features": 2 * max_nodes * width,
            "edge_index": 4 * edges}


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
    edges = max_edges if max_edges is not None else 64 * max_nodes
    tensors = decode_inputs(request.inputs, INPUTS, _ACCEPTED_INPUTS, input_limits(max_nodes, feature_dim, edges))
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


# The float outputs a result may hold: each is checked whatever the client asked for, since
# the others come from them (top-k ids ranked by NaN scores came back, with a 200, to a
# client that asked for the ids alone).
FLOAT_OUTPUTS = ("logits", "embeddings", "scores", "topk_scores")


def refuse_non_finite(result) -> None:
    """BadRequest when an output computed from a client's features is inf or NaN: finite
    features can still overflow the model (3e38 passes float32), and JSON has no such
    number (they came back as null, with a 200)."""
    for name in FLOAT_OUTPUTS:
        arr = getattr(result, name, None)
        if arr is not None and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise BadRequest(f"output {name!r} of these features is not finite (inf or NaN): feature values past "
                             "what the model can compute with")


def new_node_parameters(parameters: dict, defaults) -> tuple[str, float, str]:
    """(mode, gamma, policy) of a new-node request, its parameters over the server's
    defaults (NewNodeConfig); BadRequest for a value not offered."""
    mode = parameters.get("mode", defaults.default_mode)
    if mode not in ("full", "pe", "srpe", "sampled"):
        raise BadRequest(f"new-node requests take mode full, pe, srpe or sampled, got {brief(mode)}")
    gamma = parameters.get("gamma", defaults.gamma)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise BadRequest(f"gamma must be a number within [0, 1], got {brief(gamma)}")
    policy = parameters.get("policy", defaults.policy)
    if policy not in ("ratio", "random", "degree"):
        raise BadRequest(f"policy must be ratio, random or degree, got {brief(policy)}")
    return mode, float(gamma), policy
