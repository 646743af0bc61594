"""The KServe v2 gRPC messages (package `inference`, service GRPCInferenceService), as
the KServe open inference protocol and Triton define them: the same field numbers, so
any v2 client (tritonclient.grpc among them) talks to this server.

Built at import time as a descriptor in a pool of our own (no generated code, no
protoc): the protocol's subset this server implements, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass as _message_class

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bool": _F.TYPE_BOOL, "int64": _F.TYPE_INT64, "uint64": _F.TYPE_UINT64,
            "double": _F.TYPE_DOUBLE, "int32": _F.TYPE_INT32, "uint32": _F.TYPE_UINT32, "float": _F.TYPE_FLOAT,
            "bytes": _F.TYPE_BYTES}

# message -> [(field, number, type, repeated)]; a type not in _SCALARS is a message
# (".inference.X", or a nested name); "map:<value>" is map<string, value>.
_PARAMS = ("parameters", "map:.inference.InferParameter")
MESSAGES: dict[str, list[tuple]] = {
    "ServerLiveRequest": [],
    "ServerLiveResponse": [("live", 1, "bool", False)],
    "ServerReadyRequest": [],
    "ServerReadyResponse": [("ready", 1, "bool", False)],
    "ModelReadyRequest": [("name", 1, "string", False), ("version", 2, "string", False)],
    "ModelReadyResponse": [("ready", 1, "bool", False)],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", 1, "string", False), ("version", 2, "string", False),
                               ("extensions", 3, "string", True)],
    "ModelMetadataRequest": [("name", 1, "string", False), ("version", 2, "string", False)],
    "ModelMetadataResponse.TensorMetadata": [("name", 1, "string", False), ("datatype", 2, "string", False),
                                             ("shape", 3, "int64", True)],
    "ModelMetadataResponse": [("name", 1, "string", False), ("versions", 2, "string", True),
                              ("platform", 3, "string", False),
                              ("inputs", 4, ".inference.ModelMetadataResponse.TensorMetadata", True),
                              ("outputs", 5, ".inference.ModelMetadataResponse.TensorMetadata", True)],
    "InferParameter": [("bool_param", 1, "bool", False), ("int64_param", 2, "int64", False),
                       ("string_param", 3, "string", False), ("double_param", 4, "double", False),
                       ("uint64_param", 5, "uint64", False)],
    "InferTensorContents": [("bool_contents", 1, "bool", True), ("int_contents", 2, "int32", True),
                            ("int64_contents", 3, "int64", True), ("uint_contents", 4, "uint32", True),
                            ("uint64_contents", 5, "uint64", True), ("fp32_contents", 6, "float", True),
                            ("fp64_contents", 7, "double", True), ("bytes_contents", 8, "bytes", True)],
    "ModelInferRequest.InferInputTensor": [("name", 1, "string", False), ("datatype", 2, "string", False),
                                           ("shape", 3, "int64", True), (*_PARAMS[:1], 4, _PARAMS[1], True),
                                           ("contents", 5, ".inference.InferTensorContents", False)],
    "ModelInferRequest.InferRequestedOutputTensor": [("name", 1, "string", False),
                                                     (*_PARAMS[:1], 2, _PARAMS[1], True)],
    "ModelInferRequest": [("model_name", 1, "string", False), ("model_version", 2, "string", False),
                          ("id", 3, "string", False), (*_PARAMS[:1], 4, _PARAMS[1], True),
                          ("inputs", 5, ".inference.ModelInferRequest.InferInputTensor", True),
                          ("outputs", 6, ".inference.ModelInferRequest.InferRequestedOutputTensor", True),
                          ("raw_input_contents", 7, "bytes", True)],
    "ModelInferResponse.InferOutputTensor": [("name", 1, "string", False), ("datatype", 2, "string", False),
                                             ("shape", 3, "int64", True), (*_PARAMS[:1], 4, _PARAMS[1], True),
                                             ("contents", 5, ".inference.InferTensorContents", False)],
    "ModelInferResponse": [("model_name", 1, "string", False), ("model_version", 2, "string", False),
                           ("id", 3, "string", False), (*_PARAMS[:1], 4, _PARAMS[1], True),
                           ("outputs", 5, ".inference.ModelInferResponse.InferOutputTensor", True),
                           ("raw_output_contents", 6, "bytes", True)],
    "RepositoryIndexRequest": [("repository_name", 1, "string", False), ("ready", 2, "bool", False)],
    "RepositoryIndexResponse.ModelIndex": [("name", 1, "string", False), ("version", 2, "string", False),
                                           ("state", 3, "string", False), ("reason", 4, "string", False)],
    "RepositoryIndexResponse": [("models", 1, ".inference.RepositoryIndexResponse.ModelIndex", True)],
    "ModelRepositoryParameter": [("bool_param", 1, "bool", False), ("int64_param", 2, "int64", False),
                                 ("string_param", 3, "string", False), ("bytes_param", 4, "bytes", False)],
    "RepositoryModelLoadRequest": [("repository_name", 1, "string", False), ("model_name", 2, "string", False),
                                   ("parameters", 3, "map:.inference.ModelRepositoryParameter", True)],
    "RepositoryModelLoadResponse": [],
    "RepositoryModelUnloadRequest": [("repository_name", 1, "string", False), ("model_name", 2, "string", False),
                                     ("parameters", 3, "map:.inference.ModelRepositoryParameter", True)],
    "RepositoryModelUnloadResponse": [],
    "StatisticDuration": [("count", 1, "uint64", False), ("ns", 2, "uint64", False)],
    "InferStatistics": [(stage, i + 1, ".inference.StatisticDuration", False) for i, stage in enumerate(
        ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss"))],
    "ModelStatistics": [("name", 1, "string", False), ("version", 2, "string", False),
                        ("last_inference", 3, "uint64", False), ("inference_count", 4, "uint64", False),
                        ("execution_count", 5, "uint64", False),
                        ("inference_stats", 6, ".inference.InferStatistics", False)],
    "ModelStatisticsRequest": [("name", 1, "string", False), ("version", 2, "string", False)],
    "ModelStatisticsResponse": [("model_stats", 1, ".inference.ModelStatistics", True)],
    # The model configuration: the part this server fills in (data_type is Triton's
    # DataType enum, an int32 on the wire).
    "ModelInput": [("name", 1, "string", False), ("data_type", 2, "int32", False), ("dims", 4, "int64", True)],
    "ModelOutput": [("name", 1, "string", False), ("data_type", 2, "int32", False), ("dims", 3, "int64", True)],
    "ModelConfig": [("name", 1, "string", False), ("platform", 2, "string", False), ("backend", 17, "string", False),
                    ("max_batch_size", 4, "int32", False), ("input", 5, ".inference.ModelInput", True),
                    ("output", 6, ".inference.ModelOutput", True)],
    "ModelConfigRequest": [("name", 1, "string", False), ("version", 2, "string", False)],
    "ModelConfigResponse": [("config", 1, ".inference.ModelConfig", False)],
}
ONEOFS = {"InferParameter": "parameter_choice", "ModelRepositoryParameter": "parameter_choice"}  # all fields in it
DATA_TYPES = {"INT64": 9, "FP32": 11, "BYTES": 13}  # Triton's DataType: TYPE_INT64, TYPE_FP32, TYPE_STRING

# rpc -> (request, response)
METHODS = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
    "ModelConfig": ("ModelConfigRequest", "ModelConfigResponse"),
    "ModelStatistics": ("ModelStatisticsRequest", "ModelStatisticsResponse"),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
    "RepositoryModelLoad": ("RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
    "RepositoryModelUnload": ("RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"),
}


def _file() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name="hybridgnn_kserve_v2.proto", package=PACKAGE, syntax="proto3")
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full in MESSAGES:  # parents come before their nested messages in MESSAGES' order... or not: make both
        parts = full.split(".")
        for depth in range(1, len(parts) + 1):
            key = ".".join(parts[:depth])
            if key in protos:
                continue
            parent = protos[".".join(parts[:depth - 1])].nested_type if depth > 1 else fdp.message_type
            protos[key] = parent.add(name=parts[depth - 1])
    for full, fields in MESSAGES.items():
        msg = protos[full]
        if full in ONEOFS:
            msg.oneof_decl.add(name=ONEOFS[full])
        for name, number, kind, repeated in fields:
            f = msg.field.add(name=name, number=number,
                              label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if kind.startswith("map:"):
                entry_name = "".join(p.capitalize() for p in name.split("_")) + "Entry"
                if not any(n.name == entry_name for n in msg.nested_type):
                    entry = msg.nested_type.add(name=entry_name)
                    entry.options.map_entry = True
                    entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
                    entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL, type=_F.TYPE_MESSAGE,
                                    type_name=kind[4:])
                f.type, f.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{full}.{entry_name}"
            elif kind in _SCALARS:
                f.type = _SCALARS[kind]
            else:
                f.type, f.type_name = _F.TYPE_MESSAGE, kind
            if full in ONEOFS:
                f.oneof_index = 0
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def message(name: str):
    """The message class inference.<name> (nested names with dots)."""
    return _message_class(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


def server_options(max_body_bytes: int, max_connections: int, idle_timeout_s: float, reuse_port: bool) -> list:
    """grpc.aio.server's options: the body limit, and client connections held as the HTTP
    server holds its own: past max_connections open, a new one is closed at once, and one
    idle_timeout_s without a call is closed (GOAWAY). Without these, connections a client
    opens and keeps cost memory and descriptors until the process can open no file."""
    return [("grpc.max_receive_message_length", max_body_bytes), ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", int(reuse_port)), ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.max_connection_idle_ms", min(2**31 - 1, max(1, round(idle_timeout_s * 1000))))]  # a C int


BACKSTOP_SPARE = 256  # calls past the cap grpcio admits, for ours to refuse with retry-after


def call_cap(cap: int, refused: Callable[[], None] | None = None):
    """(wrap, backstop): wrap(handler) serves a gRPC server's calls (unary, bytes in) with
    at most `cap` in flight among every handler it wraps, and refuses one past it as
    admission refuses overload: RESOURCE_EXHAUSTED with `retry-after` in the trailing
    metadata; refused() is called for each one refused (it is counted). grpcio's own cap
    (maximum_concurrent_rpcs) answers RESOURCE_EXHAUSTED with no metadata at all, so a
    client could not tell when to retry; it stays as a backstop, at `backstop` (the cap
    and BACKSTOP_SPARE more), against calls arriving faster than these refusals end. At
    twice the cap, a burst on a small cap (1 per front end) passed it: clients got grpcio's
    bare "Concurrent RPC limit exceeded!" with no retry-after."""
    import grpc

    from hybridgnn.errors import RETRY_AFTER_S

    retry_after = str(max(1, round(RETRY_AFTER_S)))
    refusal = (f"server overloaded: {cap} gRPC calls are in flight here, the most it takes; "
               f"retry in {retry_after} s")
    in_flight = 0

    def wrap(handle):
        async def call(request, context):
            nonlocal in_flight
            if in_flight >= cap:
                if refused is not None:
                    refused()
                context.set_trailing_metadata((("retry-after", retry_after),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            in_flight += 1
            try:
                return await handle(request, context)
            finally:
                in_flight -= 1

        return call

    return wrap, cap + BACKSTOP_SPARE


def bind_grpc(server, host: str, port: int) -> int:
    """server.add_insecure_port as one OSError when the port cannot be had: grpcio returns
    0 or, in newer versions, raises RuntimeError "Failed to bind ...; set GRPC_VERBOSITY=debug"."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port} (the port is in use, or the address is not "
                      "this machine's)")
    return bound
