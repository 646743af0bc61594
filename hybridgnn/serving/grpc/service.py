"""KServe v2 over gRPC (inference.GRPCInferenceService), beside the REST front end: the
same v2 service on the same event loop (grpcio's asyncio server). A ModelInferRequest
becomes the v2 types directly (serving/v2/types.py), so validation and dispatch are the
service's; errors are the service's failures, each status mapped to a gRPC status code,
Retry-After in the trailing metadata.

Ids and outputs travel as raw tensor contents (raw_input_contents /
raw_output_contents, as tritonclient sends and reads them); typed `contents` are
accepted on input too.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from hybridgnn.capabilities import connection_limit
from hybridgnn.errors import GRPC_CALL_CAP, BadRequest, PayloadTooLarge, status_of
from hybridgnn.serving.grpc.access import access_interceptors
from hybridgnn.serving.grpc.schema import (
    DATA_TYPES,
    METHODS,
    SERVICE,
    bind_grpc,
    call_cap,
    message,
    server_options,
)
from hybridgnn.serving.v2.service import V2Service
from hybridgnn.serving.v2.tensors import datatype_of, raw_tensor
from hybridgnn.serving.v2.types import Failure, InferAnswer, InferInput, Tensor

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


def grpc_code(exc_or_status: BaseException | int) -> grpc.StatusCode:
    """The gRPC status code of an error (or of an HTTP status)."""
    status = exc_or_status if isinstance(exc_or_status, int) else status_of(exc_or_status)
    return GRPC_CODES.get(status, grpc.StatusCode.INTERNAL)


def _param(p) -> object:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def infer_input(request, max_elements: int | None = None) -> InferInput:
    """The v2 request of a ModelInferRequest: each input's raw contents (one per input,
    or none) or its datatype's typed contents, never both (400). max_elements: typed contents longer than this are a
    413 before they are copied."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors but the request names {len(request.inputs)} "
                         "inputs: send one raw tensor per input, or none")
    inputs = []
    for i, t in enumerate(request.inputs):
        sent = [f.name for f, _ in t.contents.ListFields()]  # the contents fields holding values
        if raw:
            if sent:  # one would be ignored: the answer would be for values the client did not mean
                raise BadRequest(f"input {t.name!r} holds both raw_input_contents and contents ({', '.join(sent)}): "
                                 "send its values in one of them")
            inputs.append(Tensor(t.name, t.datatype, list(t.shape), raw=raw[i]))
            continue
        field = _CONTENTS.get(t.datatype)
        if field is not None and sent and sent != [field]:
            raise BadRequest(f"input {t.name!r} holds {', '.join(sent)}, but a {t.datatype} input's values go in "
                             f"{field}")
        contents = getattr(t.contents, field) if field is not None else ()
        if max_elements is not None and len(contents) > max_elements:
            raise PayloadTooLarge(f"input {t.name!r} holds {len(contents)} elements; the limit is {max_elements}")
        values = list(contents)
        if t.datatype == "BYTES":
            try:
                values = [v.decode() for v in values]
            except UnicodeDecodeError:
                raise BadRequest(f"input {t.name!r}: BYTES elements must be UTF-8 text") from None
        inputs.append(Tensor(t.name, t.datatype, list(t.shape), values))
    return InferInput(request.model_name, request.model_version or None, inputs,
                      {k: _param(v) for k, v in request.parameters.items()},
                      [o.name for o in request.outputs] if request.outputs else None, request.id or None)


class GrpcFrontend:
    """The gRPC transport of one v2 service."""

    def __init__(self, service: V2Service):
        self.service = service
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._messages = {name: (message(req), message(resp)) for name, (req, resp) in METHODS.items()}

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        cfg = self.service.engine.cfg.server
        cap = connection_limit(cfg.max_connections, 2, "gRPC's --max-connections")  # HTTP holds the other share
        stats = self.service.engine.stats
        stats.refused(GRPC_CALL_CAP, 0)  # its series from the first scrape
        capped, backstop = call_cap(cap, lambda: stats.refused(GRPC_CALL_CAP))
        self.server = grpc.aio.server(options=server_options(cfg.max_body_bytes, cap, cfg.idle_timeout_s,
                                                             reuse_port=False),
                                      maximum_concurrent_rpcs=backstop,
                                      interceptors=access_interceptors(cfg.access_log))
        handlers = {}
        for name, (_, resp_cls) in self._messages.items():
            # no request_deserializer: grpcio answers bytes it cannot parse UNKNOWN and logs a traceback
            handlers[name] = grpc.unary_unary_rpc_method_handler(capped(self.handler(name)),
                                                                 response_serializer=resp_cls.SerializeToString)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        bound = bind_grpc(self.server, host, port)
        self.port = bound
        await self.server.start()
        return bound

    def handler(self, name: str):
        """The method `name` of a call's request bytes: parsed, then served; bytes that are
        not its request message end the call INVALID_ARGUMENT in one line."""
        req_cls, fn = self._messages[name][0], getattr(self, _snake(name))

        async def handle(data: bytes, context):
            try:
                request = req_cls.FromString(data)
            except DecodeError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid "
                                    f"{req_cls.DESCRIPTOR.full_name} protobuf message")
            return await fn(request, context)

        return handle

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)

    async def _model(self, request, context):
        """The engine serving request.name (and request.version, if given), or the call
        ends with the service's failure for it."""
        try:
            return self.service.model(request.name, request.version or None)
        except Exception as exc:
            await self._fail(context, exc)

    async def _fail(self, context, exc: BaseException) -> None:
        await self._abort(context, self.service.failure(exc, "gRPC request"))

    @staticmethod
    async def _abort(context, failure: Failure) -> None:
        headers = failure.headers or {}
        if "Retry-After" in headers:
            context.set_trailing_metadata((("retry-after", headers["Retry-After"]),))
        await context.abort(grpc_code(failure.status), failure.message)

    # --- the service ---------------------------------------------------------------------
    async def server_live(self, request, context):
        return self._messages["ServerLive"][1](live=True)

    async def server_ready(self, request, context):
        return self._messages["ServerReady"][1](ready=self.service.ready())

    async def model_ready(self, request, context):
        engine = await self._model(request, context)
        return self._messages["ModelReady"][1](ready=bool(engine.ready))

    async def server_metadata(self, request, context):
        d = self.service.server_metadata()
        return self._messages["ServerMetadata"][1](name=d["name"], version=d["version"], extensions=d["extensions"])

    async def model_metadata(self, request, context):
        try:
            d = self.service.model_metadata(request.name, request.version or None)
        except Exception as exc:
            await self._fail(context, exc)
        out = self._messages["ModelMetadata"][1](name=d["name"], versions=d["versions"], platform=d["platform"])
        for key in ("inputs", "outputs"):
            for t in d[key]:
                getattr(out, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return out

    async def model_config(self, request, context):
        try:
            c = self.service.model_config(request.name, request.version or None)
        except Exception as exc:
            await self._fail(context, exc)
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
            entries = self.service.statistics(request.name or None, request.version or None)
        except Exception as exc:
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
        for e in self.service.index():
            if request.ready and e["state"] != "READY":
                continue
            out.models.add(name=e["name"], version=e["version"], state=e["state"], reason=e["reason"])
        return out

    def _authorization(self, context) -> str:
        return next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")

    async def repository_model_load(self, request, context):
        try:
            await self.service.load(request.model_name, self._authorization(context), dict(request.parameters))
        except Exception as exc:
            await self._fail(context, exc)
        return self._messages["RepositoryModelLoad"][1]()

    async def repository_model_unload(self, request, context):
        try:
            await self.service.unload(request.model_name, self._authorization(context), dict(request.parameters))
        except Exception as exc:
            await self._fail(context, exc)
        return self._messages["RepositoryModelUnload"][1]()

    async def model_infer(self, request, context):
        service = self.service
        engine = None
        try:
            engine = service.model(request.model_name, request.model_version or None)
            # the decoder's own largest limit: a bound of its features' alone refused the edges
            # of a new-node request that REST and raw contents take
            req = infer_input(request, service.max_input_elements(engine))
        except Exception as exc:
            failure = service.failure(exc, "infer")
            (engine or service.counting(request.model_name)).stats.answered(failure.status)  # as the service counts
            if engine is not None:
                engine.model_stats.failed(0.0)
            await self._abort(context, failure)
            raise  # not reached: abort raises
        answer = service.infer(req, self._encode_infer, _failed)
        if not isinstance(answer, (Failure, self._messages["ModelInfer"][1])):
            answer = await answer
        if isinstance(answer, Failure):
            await self._abort(context, answer)
        return answer

    def _encode_infer(self, answer: InferAnswer):
        out = self._messages["ModelInfer"][1](model_name=answer.model, model_version=answer.version,
                                              id=answer.id or "")
        for name, arr in answer.outputs:
            datatype = datatype_of(arr)
            out.outputs.add(name=name, datatype=datatype, shape=list(arr.shape))
            out.raw_output_contents.append(raw_tensor(arr, datatype))
        return out


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class ForwardedCall:
    """What a method of GrpcFrontend reads of its call's context, for a call a front-end
    process received (serving/frontend.py): its metadata, and abort() ending it with a
    status code, a message and trailing metadata."""

    def __init__(self, metadata: tuple):
        self._metadata = metadata
        self.trailing: tuple = ()

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


async def answer_forwarded(frontend: GrpcFrontend, method: str, request: bytes,
                           metadata: tuple) -> tuple[bytes, str | None, str, tuple]:
    """(response bytes, status code name or None, message, trailing metadata) of a call a
    front-end process received: decoded, served and encoded here as if it came in here."""
    if method not in frontend._messages:
        return b"", grpc.StatusCode.UNIMPLEMENTED.name, f"no method {method!r}", ()
    call = ForwardedCall(metadata)
    try:
        response = await frontend.handler(method)(request, call)
    except _Aborted as exc:
        return b"", exc.code.name, exc.details, call.trailing
    except Exception:  # as grpcio answers a method that raises
        log.exception("gRPC %s failed", method)
        return b"", grpc.StatusCode.UNKNOWN.name, "unexpected error in the method", ()
    return response.SerializeToString(), None, "", ()


def _failed(failure: Failure) -> Failure:
    return failure


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")

