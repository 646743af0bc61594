"""The KServe v2 (Open Inference Protocol) request and answer types, as every transport
hands them to the v2 service and takes them back: no JSON, no HTTP, no protobuf.

A transport turns its wire form into these (HTTP: serving/http/codec.py; gRPC:
serving/grpc/service.py) and checks only what its own format defines (that the body
parses, that binary sizes fit what was sent). Everything about meaning (names,
datatypes, shapes, ids, modes) is checked by the v2 service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

MISSING = object()  # Tensor.data when the request gave neither data nor raw bytes
ID_OUTPUT = "node_ids"  # the request's ids echoed, on datasets with an id map (external ids)


class Tensor:
    """One input tensor as received: `data` (a list, as JSON or typed protobuf contents
    give it, or an array) or `raw` (little-endian bytes: the binary tensor extension, or
    gRPC's raw_input_contents; BYTES as 4-byte-length-prefixed elements). Not validated."""

    __slots__ = ("name", "datatype", "shape", "data", "raw")

    def __init__(self, name, datatype, shape, data=MISSING, raw: bytes | memoryview | None = None):
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.data = data
        self.raw = raw


class InferInput:
    """An inference request as a transport received it. outputs: the names asked for, in
    order (None: the model's default outputs). waited_s: how long it already waited in
    the transport before reaching the service (admission adds it); standing: it waited past
    the target of a queue that stands in the front end (then it is refused)."""

    __slots__ = ("model", "version", "id", "inputs", "parameters", "outputs", "waited_s", "standing")

    def __init__(self, model: str, version: str | None, inputs: list[Tensor], parameters=None, outputs=None,
                 id=None, waited_s: float = 0.0, standing: bool = False):
        self.model = model
        self.version = version
        self.inputs = inputs
        self.parameters = parameters if parameters is not None else {}
        self.outputs = outputs
        self.id = id
        self.waited_s = waited_s
        self.standing = standing


@dataclass
class InferRequest:
    """A validated inference: node_ids for existing nodes, or features + edge_index for new
    (query) nodes; the outputs to compute and answer, in order."""

    node_ids: np.ndarray | None = None
    features: np.ndarray | None = None  # float32 [q, F]
    edge_index: np.ndarray | None = None  # int64 [2, m]; query node i is num_nodes + i
    request_id: str | None = None
    outputs: tuple[str, ...] = ()
    external_ids: np.ndarray | None = None  # node_ids as the client named them (datasets with an id map)
    parameters: dict = field(default_factory=dict)

    @property
    def is_new_nodes(self) -> bool:
        return self.features is not None

    @property
    def num_outputs(self) -> int:
        return int(self.features.shape[0] if self.features is not None else self.node_ids.shape[0])

    def answer_outputs(self, result) -> list[tuple[str, np.ndarray]]:
        """The outputs asked for, from a RequestResult's attributes of the same names (and
        the ids echoed as the client named them)."""
        return [(name, getattr(result, name) if name != ID_OUTPUT else self.external_ids) for name in self.outputs]


class InferAnswer:
    """A 200 answer: the named output tensors in the order asked, with who answered."""

    __slots__ = ("model", "version", "id", "outputs")

    def __init__(self, model: str, version: str, id: str | None, outputs: list[tuple[str, np.ndarray]]):
        self.model = model
        self.version = version
        self.id = id
        self.outputs = outputs


class GraphUpdateInput:
    """A graph-update request as received: its tensors, the Authorization it carried, an
    optional Idempotency-Key with the SHA-256 of the request body it came with."""

    __slots__ = ("model", "version", "inputs", "authorization", "idempotency_key", "body_sha256", "waited_s")

    def __init__(self, model: str, version: str | None, inputs: list[Tensor], authorization: str = "",
                 idempotency_key: str | None = None, body_sha256: str | None = None, waited_s: float = 0.0):
        self.model = model
        self.version = version
        self.inputs = inputs
        self.authorization = authorization
        self.idempotency_key = idempotency_key
        self.body_sha256 = body_sha256
        self.waited_s = waited_s


class Failure:
    """What an error answers with, whatever the transport: status (HTTP's; gRPC maps it),
    the client-safe message, headers (Retry-After, Allow, WWW-Authenticate) and, for a bug,
    the request id its log line carries."""

    __slots__ = ("status", "message", "headers", "request_id")

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 request_id: str | None = None):
        self.status = status
        self.message = message
        self.headers = headers
        self.request_id = request_id


def internal_failure(exc: BaseException | None, where: str, log) -> Failure:
    """The answer to a bug (an exception no error class covers): a 500 whose request id the
    log line, with the traceback, carries too, so a report can be matched to it."""
    request_id = os.urandom(6).hex()
    log.error("[%s] internal error in %s", request_id, where,
              exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
    return Failure(500, "internal server error", None, request_id)
