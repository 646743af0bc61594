"""KServe v2 over gRPC (inference.GRPCInferenceService), beside the REST front end: the
same engine on the same event loop (grpcio's asyncio server), the same decoding and
validation (a ModelInferRequest becomes the REST request's header and binary tail), the
same error model (each error's HTTP status mapped to a gRPC status code, Retry-After in
the trailing metadata).

Ids and outputs travel as raw tensor contents (raw_input_contents /
raw_output_contents, as tritonclient sends and reads them); typed `contents` are
accepted on input too.
"""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np

from hybridgnn import __version__
from hybridgnn.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    Draining,
    Overloaded,
    PayloadTooLarge,
    ServingError,
    status_of,
)
from hybridgnn.serving.grpc.schema import DATA_TYPES, METHODS, SERVICE, message
from hybridgnn.serving.http.api import Api, graph_version_param
from hybridgnn.serving.http.codec import (
    ID_OUTPUT,
    datatype_of,
    decode_infer_parts,
    raw_tensor,
)

log = logging.getLogger("hybridgnn.grpc")

# HTTP status of an error -> gRPC status code
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

# typed `contents` field per datatype (inputs sent without raw contents)
_CONTENTS = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents",
             "UINT64": "uint64_contents"}


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    return GRPC_CODES.get(status_of(exc), grpc.StatusCode.INTERNAL)


def _param(p) -> object:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def request_parts(request, max_elements: int | None = None) -> tuple[dict, memoryview]:
    """The REST form of a ModelInferRequest: (JSON-like header, binary tail).
    max_elements: typed contents longer than this are a 413 before they are copied."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors but the request names {len(request.inputs)} "
                         "inputs: send one raw tensor per input, or none")
    inputs = []
    for i, t in enumerate(request.inputs):
        entry = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if raw:
            entry["parameters"] = {"binary_data_size": len(raw[i])}
        else:
            field = _CONTENTS.get(t.datatype)
            contents = getattr(t.contents, field) if field is not None else ()
            if max_elements is not None and len(contents) > max_elements:
                raise PayloadTooLarge(f"input {t.name!r} holds {len(contents)} elements; the limit is {max_elements}")
            values = list(contents)
            if t.datatype == "BYTES":
                try:
                    values = [v.decode() for v in values]
                except UnicodeDecodeError:
                    raise BadRequest(f"input {t.name!r}: BYTES elements must be UTF-8 text") from None
            entry["data"] = values
        inputs.append(entry)
    header = {"inputs": inputs, "parameters": {k: _param(v) for k, v in request.parameters.items()}}
    if request.outputs:
        header["outputs"] = [{"name": o.name} for o in request.outputs]
    if request.id:
        header["id"] = request.id
    return header, memoryview(b"".join(raw))


class GrpcFrontend:
    """The gRPC service of one Api (its engine, checks and dispatch)."""

    def __init__(self, api: Api):
        self.api = api
        self.engine = api.engine
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._messages = {name: (message(req), message(resp)) for name, (req, resp) in METHODS.items()}

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        cfg = self.engine.cfg.server
        limit = cfg.max_body_bytes
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                               ("grpc.max_send_message_length", -1),
                                               ("grpc.so_reuseport", 0)],
                                      maximum_concurrent_rpcs=cfg.max_connections)
        handlers = {}
        for name, (req_cls, resp_cls) in self._messages.items():
            fn = getattr(self, _snake(name))
            handlers[name] = grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req_cls.FromString,
                                                                 response_serializer=resp_cls.SerializeToString)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        self.port = bound
        await self.server.start()
        return bound

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)

    async def _model(self, request, context):
        """The engine serving request.name (and request.version, if given), or the call
        ends with the API's error for it."""
        try:
            return self.api.check_model(request.name, request.version or None)
        except ServingError as exc:
            await self._fail(context, exc)

    async def _fail(self, context, exc: BaseException) -> None:
        if isinstance(exc, ConfigError):  # a repository that cannot be read now: the client can do nothing
            exc = Conflict(str(exc))
        if isinstance(exc, (Overloaded, Draining)):
            self.engine.stats.refused(exc.reason)
        if not isinstance(exc, ServingError):
            log.error("gRPC request failed", exc_info=exc)
            message_ = "internal server error"
        else:
            message_ = exc.message
            headers = exc.headers() or {}
            if "Retry-After" in headers:
                context.set_trailing_metadata((("retry-after", headers["Retry-After"]),))
        await context.abort(grpc_code(exc), message_)

    # --- the service ---------------------------------------------------------------------
    async def server_live(self, request, context):
        return self._messages["ServerLive"][1](live=True)

    async def server_ready(self, request, context):
        return self._messages["ServerReady"][1](ready=all(e.ready for e in self.api.models.engines()))

    async def model_ready(self, request, context):
        engine = await self._model(request, context)
        return self._messages["ModelReady"][1](ready=bool(engine.ready))

    async def server_metadata(self, request, context):
        return self._messages["ServerMetadata"][1](name="hybridgnn", version=__version__,
                                                   extensions=["binary_tensor_data"])

    async def model_metadata(self, request, context):
        engine = await self._model(request, context)
        d = self.api.describe_model(engine, request.name)
        out = self._messages["ModelMetadata"][1](name=d["name"], versions=d["versions"], platform=d["platform"])
        for key in ("inputs", "outputs"):
            for t in d[key]:
                getattr(out, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return out

    async def model_config(self, request, context):
        engine = await self._model(request, context)
        c = self.api.config_of(engine, request.name)
        out = self._messages["ModelConfig"][1]()
        cfg = out.config
        cfg.name, cfg.platform, cfg.backend, cfg.max_batch_size = c["name"], c["platform"], c["backend"], 0
        for key, target in (("input", cfg.input), ("output", cfg.output)):
            for t in c[key]:
                datatype = t["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES")
                target.add(name=t["name"], data_type=DATA_TYPES[datatype], dims=t["dims"])
        return out

    async def model_statistics(self, request, context):
        try:
            entries = self.api.stats_entries(request.name or None, request.version or None)
        except ServingError as exc:
            await self._fail(context, exc)
        out = self._messages["ModelStatistics"][1]()
        for e in entries:
            m = out.model_stats.add(name=e["name"], version=e["version"], last_inference=e["last_inference"],
                                    inference_count=e["inference_count"], execution_count=e["execution_count"])
            for stage, d in e["inference_stats"].items():
                getattr(m.inference_stats, stage).count = d["count"]
                getattr(m.inference_stats, stage).ns = d["ns"]
        return out

    async def repository_index(self, request, context):
        out = self._messages["RepositoryIndex"][1]()
        for e in self.api.index_entries():
            if request.ready and e["state"] != "READY":
                continue
            out.models.add(name=e["name"], version=e["version"], state=e["state"], reason=e["reason"])
        return out

    def _authorization(self, context) -> str:
        return next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")

    async def repository_model_load(self, request, context):
        try:
            repository = self.api.repository_control(self._authorization(context))
            versions = await repository.load(request.model_name)
            if not versions:
                failed = {v: why for (n, v), why in repository.models.unavailable.items() if n == request.model_name}
                raise Conflict(f"model {request.model_name!r} could not be loaded: {failed}")
        except Exception as exc:
            await self._fail(context, exc)
        return self._messages["RepositoryModelLoad"][1]()

    async def repository_model_unload(self, request, context):
        try:
            await self.api.repository_control(self._authorization(context)).unload(request.model_name)
        except Exception as exc:
            await self._fail(context, exc)
        return self._messages["RepositoryModelUnload"][1]()

    async def model_infer(self, request, context):
        started = time.perf_counter()
        engine, target = self.engine, None
        try:
            engine = target = self.api.check_model(request.model_name, request.model_version or None)
            header, binary = request_parts(request, 2 * engine.cfg.server.max_request_nodes
                                           * max(1, engine.graph.feature_dim))
            wanted = header["parameters"].get("min_graph_version")
            if wanted is not None and graph_version_param(wanted) > engine.graph_version:
                await self.api.catch_up(wanted, engine)
            req = decode_infer_parts(header, binary, max_nodes=engine.cfg.server.max_request_nodes,
                                     num_nodes=engine.num_nodes, feature_dim=engine.graph.feature_dim,
                                     id_map=engine.graph.id_map, default_outputs=engine.cfg.server.default_outputs)
            result = await self.api.dispatch(req, engine)
        except Exception as exc:
            engine.stats.answered(status_of(exc))
            if target is not None:
                target.model_stats.failed(time.perf_counter() - started)
            await self._fail(context, exc)
            raise  # not reached: abort raises
        t0 = time.perf_counter()
        tensors = {"logits": result.logits, "embeddings": result.embeddings, "predictions": result.predictions}
        if req.external_ids is not None:
            tensors[ID_OUTPUT] = req.external_ids
        out = self._messages["ModelInfer"][1](model_name=request.model_name, model_version=engine.model_version,
                                              id=req.request_id or "")
        for name in req.outputs:
            arr = np.asarray(tensors[name])
            out.outputs.add(name=name, datatype=datatype_of(arr), shape=list(arr.shape))
            out.raw_output_contents.append(raw_tensor(arr))
        done = time.perf_counter()
        engine.stats.stage("respond", result.pipeline, done - t0)
        engine.stats.stage("total", result.pipeline, done - started)
        engine.stats.answered(200, req.num_outputs)
        engine.model_stats.answered(done - started, req.num_outputs, result.timings, done - t0)
        return out


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
