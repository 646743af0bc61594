"""KServe v2 graph updates decoded and validated, from the Tensor objects any transport
hands in (serving/v2/types.py), and the token check of every request that changes state;
inferences are serving/v2/inference.py's."""

from __future__ import annotations

import hmac
import math
import time

from hybridgnn.errors import BadRequest, PayloadTooLarge, Unauthorized
from hybridgnn.serving.core.updates import PendingUpdate
from hybridgnn.serving.v2.tensors import declared_shape, decode_inputs
from hybridgnn.serving.v2.types import Tensor
from hybridgnn.updates.requests import (
    COUNTED_INPUTS,
    UPDATE_INPUTS,
    LoggedRequest,
    build_request,
    check_feature_values,
)


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
    # Too many updates is a 413 before any element is decoded: a 9 MB body declaring 1.5M
    # edges held the event loop 0.8 s in numpy, after its JSON, only to be refused for its count.
    declared = declared_updates(inputs)
    if declared > max_updates:
        raise PayloadTooLarge(f"{declared} updates in one request; the limit is {max_updates}")
    tensors = decode_inputs(inputs, UPDATE_INPUTS, f"a graph update takes any of {', '.join(UPDATE_INPUTS)}",
                            _element_limits(feature_dim, max_updates))
    logged = LoggedRequest(tensors, idempotency_key, body_sha256 if idempotency_key is not None else None)
    built = None
    if id_map is None:
        built = build_request(tensors, feature_dim=feature_dim, max_updates=max_updates)  # needs no graph
        count = built.num_updates
    else:
        for name in ("add_node_features", "update_features"):
            got = tensors.get(name)
            if got is not None and got.shape[1] != feature_dim:
                raise BadRequest(f"{name} must be [count, {feature_dim}] (the graph's feature width), "
                                 f"got {list(got.shape)}")
            if got is not None:
                check_feature_values(name, got)
        count = logged.num_updates
        if count == 0:
            raise BadRequest("the update is empty")
        if count > max_updates:
            raise PayloadTooLarge(f"{count} updates in one request; the limit is {max_updates}")
    return PendingUpdate(logged, count, time.monotonic(), built)


def declared_updates(inputs: list[Tensor]) -> int:
    """The updates the inputs' shapes declare (the rows of COUNTED_INPUTS: ids [n], or [1, n]
    and [n, 1], and pairs and feature rows [n, ...]); inputs whose name or shape decoding
    refuses count nothing here."""
    total = 0
    for t in inputs:
        if not (isinstance(t.name, str) and t.name in COUNTED_INPUTS):
            continue
        shape = declared_shape(t)
        if shape:
            total += math.prod(shape) if UPDATE_INPUTS[t.name][1] == "ids" else shape[0]
    return total


def _element_limits(feature_dim: int, max_updates: int) -> dict[str, int]:
    """The most elements each input may declare in a request of max_updates updates (a
    413 before it is decoded: update_features and add_node_ids, which count no updates of
    their own, too)."""
    width = {"pairs": 2, "matrix": feature_dim, "ids": 1}
    return {name: max_updates * width[layout] for name, (_, layout) in UPDATE_INPUTS.items()}


def authorize(token: str, authorization: str, needs: str) -> None:
    """Unauthorized unless `authorization` is 'Bearer <token>': the scheme in any case and
    one or more spaces after it (RFC 9110 11.1 and 11.4; 'bearer <token>' was refused), the
    token compared in constant time."""
    scheme, _, credentials = authorization.partition(" ")
    matches = hmac.compare_digest(credentials.lstrip(" ").encode(errors="replace"), token.encode())
    if not (matches and scheme.lower() == "bearer"):
        raise Unauthorized(f"{needs} 'Authorization: Bearer <token>' with the server's update token")
