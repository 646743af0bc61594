"""The KServe v2 REST API, independent of the HTTP server that carries it.

`Api.route(method, path)` finds the endpoint; each endpoint returns a `Reply`, or an
awaitable of one when the answer comes later (an inference). The HTTP server
(serving/http/protocol.py) calls these; so could any other transport.
Every error is answered by `Api.error_reply` from the one table in hybridgnn/errors.py: a
ServingError with its status, headers and {"error": message}; anything else is a bug,
logged with a request id and answered 500 {"error": "internal server error", "request_id"}.
Nothing a client sends raises out of here.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring_ascii
from urllib.parse import unquote

from hybridgnn import __version__
from hybridgnn.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    Draining,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
    ServingError,
    Unauthorized,
    brief,
)
from hybridgnn.serving.eager import Later, when_done
from hybridgnn.serving.engine import Engine
from hybridgnn.serving.http.codec import (
    HEADER_LENGTH,
    ID_OUTPUT,
    INPUT_NAME,
    declared_ids,
    decode_infer_parts,
    encode_infer_response,
    split_body,
)
from hybridgnn.serving.http.turns import standing_queue_limits
from hybridgnn.serving.repository import Models, Repository
from hybridgnn.serving.updates import decode_update_request

log = logging.getLogger(__name__)

JSON = "application/json"
_HEADER_LENGTH = HEADER_LENGTH.lower()  # request headers reach endpoints with lower-case names


def _request_id() -> str:
    """A short random id naming one failed request in its answer and its log line."""
    return os.urandom(6).hex()


def graph_version_param(v) -> int:
    """parameters.min_graph_version as given; BadRequest unless an integer >= 0."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"parameters.min_graph_version must be a graph version (an integer >= 0, as a graph "
                         f"update's answer gives), got {brief(v)}")
    return v


class Reply:
    """One HTTP answer: status, body bytes, content type and any extra headers."""

    __slots__ = ("status", "body", "content_type", "headers", "shared")

    def __init__(self, status: int, body: bytes, content_type: str = JSON, headers: dict[str, str] | None = None):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers
        self.shared = False  # one object answers many requests, unchanged: its encoding may be kept

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, json.dumps(obj).encode(), JSON, headers)

    @classmethod
    def error(cls, status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
        # The bytes json.dumps({"error": message}) gives, at a sixth of its cost: refusals
        # under overload are answered by the thousand per second.
        return cls(status, b'{"error": %s}' % encode_basestring_ascii(message).encode(), JSON, headers)


class Request:
    """What an endpoint reads from an HTTP request: route parameters, the headers it
    uses (names lower-case), the body, how long it already waited in the front end
    (from its first byte read, or from the answer before it on a pipelining connection if
    that came later, to its endpoint running), which admission counts, and
    whether it waited past the target of a queue that stands (then an inference is
    refused; other endpoints answer)."""

    __slots__ = ("params", "headers", "body", "waited_s", "standing")

    def __init__(self, params: dict[str, str], headers: dict[str, str], body: bytes, waited_s: float = 0.0,
                 standing: bool = False):
        self.params = params
        self.headers = headers
        self.body = body
        self.waited_s = waited_s
        self.standing = standing


Endpoint = Callable[[Request], "Reply | Awaitable[Reply]"]
_ROUTES_KEPT = 1024  # routes found that Api.route keeps (of paths up to _ROUTE_KEPT_CHARS)
_ROUTE_KEPT_CHARS = 256
_REFUSALS_KEPT = 256  # distinct refusal answers kept (messages name a bound and a retry; few differ)
# Methods each path shape accepts; GET endpoints also answer HEAD.
_MODEL_ROUTES = {"": "GET", "ready": "GET", "infer": "POST", "graph": "POST", "config": "GET", "stats": "GET"}


class Api:
    """The endpoints of one engine, or of the engines of a model repository (Models: one
    per model and version, over one graph)."""

    def __init__(self, engines: Engine | Models | Repository):
        self.repository = engines if isinstance(engines, Repository) else None  # its load/unload API
        if isinstance(engines, Repository):
            engines = engines.models
        if isinstance(engines, Models):
            self.models = engines
        else:
            self.models = Models()
            self.models.add(engines.cfg.server.model_name, "1", engines)
        # Server-wide settings, stats and drain state come from the first engine: they
        # are the same for every engine of a server.
        self.engine = engine = self.models.engines()[0]
        self.model_name = engine.cfg.server.model_name
        self.retry = {"Retry-After": str(engine.cfg.server.retry_after_s)}
        self._standing_reply: Reply | None = None  # built on first use (_refused_standing)
        # Endpoints raise ServingErrors where they find a request bad; _guarded answers
        # whatever they raise with error_reply(). infer answers its own (it counts them).
        self._static = {
            "/v2/health/live": self._guarded(self.live),
            "/v2/health/ready": self._guarded(self.ready),
            "/v2": self._guarded(self.server_metadata),
            "/v2/models": self._guarded(self.list_models),
            "/metrics": self._guarded(self.metrics),
            "/v2/models/stats": self._guarded(self.model_stats),
        }
        self._posts = {"/v2/repository/index": self._guarded(self.repository_index)}
        self._routes: dict[tuple[str, str], tuple[Endpoint, dict[str, str]]] = {}  # route()'s, kept
        self._refusals: dict[tuple, Reply] = {}  # client_error_reply()'s shared 429/503 answers
        self._repository_endpoints = {"load": self._guarded(self.repository_load),
                                      "unload": self._guarded(self.repository_unload)}
        self._model_endpoints = {"": self._guarded(self.model_metadata), "ready": self._guarded(self.model_ready),
                                 "infer": self.infer, "graph": self._guarded(self.update_graph),
                                 "config": self._guarded(self.model_config), "stats": self._guarded(self.model_stats)}

    # --- routing ---------------------------------------------------------------------
    def route(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | Reply:
        """The endpoint and route parameters for method+path, or a 404/405 Reply. Routes
        found are kept (clients ask the same few paths; the parameters are only read)."""
        key = (method, path)
        found = self._routes.get(key)
        if found is None:
            found = self._route(method, path)
            if not isinstance(found, Reply) and len(path) <= _ROUTE_KEPT_CHARS:
                if len(self._routes) >= _ROUTES_KEPT:  # paths a client makes up cannot grow it
                    self._routes.clear()
                self._routes[key] = found
        return found

    def _route(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | Reply:
        if "%" in path:
            path = unquote(path)
        endpoint = self._static.get(path)
        if endpoint is not None:
            if method not in ("GET", "HEAD"):
                return self._not_allowed(method, path, "GET, HEAD")
            return endpoint, {}
        endpoint = self._posts.get(path)
        if endpoint is not None:
            return (endpoint, {}) if method == "POST" else self._not_allowed(method, path, "POST")
        parts = path.split("/")
        # /v2/repository/models/{model}/load|unload
        if len(parts) == 6 and parts[:4] == ["", "v2", "repository", "models"] and parts[4] and parts[5] in (
                "load", "unload"):
            if method != "POST":
                return self._not_allowed(method, path, "POST")
            return self._repository_endpoints[parts[5]], {"model": parts[4]}
        # /v2/models/{model}[/versions/{version}][/ready|/infer|/graph]
        if len(parts) >= 4 and parts[0] == "" and parts[1] == "v2" and parts[2] == "models" and parts[3]:
            rest = parts[4:]
            params = {"model": parts[3]}
            if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
                params["version"] = rest[1]
                rest = rest[2:]
            if len(rest) <= 1:
                action = rest[0] if rest else ""
                allowed = _MODEL_ROUTES.get(action)
                if allowed is not None:
                    if method == allowed or (allowed == "GET" and method == "HEAD"):
                        return self._model_endpoints[action], params
                    return self._not_allowed(method, path, "GET, HEAD" if allowed == "GET" else allowed)
        return self.error_reply(NotFound(f"no such endpoint: {method} {path}"))

    # --- errors: the one map from an exception to an answer ----------------------------
    def error_reply(self, exc: BaseException | None, where: str = "request") -> Reply:
        """The answer to exc. A ServingError: its status, its headers (Retry-After from the
        server's retry_after_s on a 429/503 that names none) and {"error": message}; a
        refusal (Overloaded, Draining) is counted by reason.
        Anything else is a bug: logged with its traceback and a request id that the 500's
        body carries too, so a report can be matched to its log line."""
        try:
            if isinstance(exc, ServingError):
                if isinstance(exc, (Overloaded, Draining)):
                    self.engine.stats.refused(exc.reason)
                if exc.status >= 500 and exc.status != 503:  # ours, not the client's: find it in the log
                    request_id = _request_id()
                    log.error("[%s] %s: %s (%d)", request_id, where, exc.message, exc.status)
                    return Reply.json({"error": exc.message, "request_id": request_id}, exc.status,
                                      self._headers_of(exc))
                return self.client_error_reply(exc)
        except Exception:  # a broken error must not take the answer with it
            log.exception("could not answer %r", exc)
        request_id = _request_id()
        log.error("[%s] internal error in %s", request_id, where,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
        return Reply.json({"error": "internal server error", "request_id": request_id}, 500)

    def _headers_of(self, exc: ServingError) -> dict[str, str] | None:
        headers = exc.headers()
        if exc.status in (429, 503) and not (headers and "Retry-After" in headers):
            headers = {**headers, **self.retry} if headers else self.retry
        return headers

    def client_error_reply(self, exc: ServingError) -> Reply:
        """The answer to a ServingError that is not a 5xx of ours (no log line, nothing counted).
        A refusal (429/503) is one shared Reply per message (the protocol keeps its bytes):
        under overload they are answered by the thousand per second, with a few messages."""
        if exc.status not in (429, 503):
            return Reply.error(exc.status, exc.message, self._headers_of(exc))
        message = exc.message
        key = (exc.status, message, exc.retry_after_s)
        reply = self._refusals.get(key)
        if reply is None:
            if len(self._refusals) >= _REFUSALS_KEPT:
                self._refusals.clear()
            reply = self._refusals[key] = Reply.error(exc.status, message, self._headers_of(exc))
            reply.shared = True
        return reply

    def internal_error(self, where: str, exc: BaseException | None = None) -> Reply:
        """The answer to an exception that escaped an endpoint or the HTTP layer (exc, or the
        one being handled): error_reply(), so a ServingError keeps its status and anything
        else is a logged 500 with a request id."""
        return self.error_reply(exc if exc is not None else sys.exc_info()[1], where)

    def _guarded(self, endpoint: Endpoint) -> Endpoint:
        """endpoint, answering whatever it raises (or its coroutine raises) with error_reply()."""

        def call(request: Request):
            try:
                reply = endpoint(request)
            except Exception as exc:
                return self.error_reply(exc, endpoint.__name__)
            if isinstance(reply, Reply):
                return reply
            return self._settled(reply, endpoint.__name__)

        call.__name__ = endpoint.__name__
        return call

    async def _settled(self, answer: Awaitable[Reply], where: str) -> Reply:
        try:
            return await answer
        except Exception as exc:
            return self.error_reply(exc, where)

    def _not_allowed(self, method: str, path: str, allow: str) -> Reply:
        return self.error_reply(MethodNotAllowed(f"method {method} not allowed on {path}", allow))

    def body_too_large(self) -> Reply:
        return self.error_reply(PayloadTooLarge(
            f"request body too large (limit {self.engine.cfg.server.max_body_bytes} bytes)"))

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down (every answer then says Connection: close)."""
        return self.repository.closing if self.repository is not None else self.engine.draining

    def _check_model(self, request: Request) -> Engine:
        return self.check_model(request.params["model"], request.params.get("version"))

    def check_model(self, name: str, version: str | None) -> Engine:
        """The engine serving model `name` (`version`, when given; else its highest);
        NotFound naming what this server serves."""
        return self.models.get(name, version)

    # --- endpoints -------------------------------------------------------------------
    def live(self, request: Request) -> Reply:
        return Reply.json({"live": True})

    def ready(self, request: Request) -> Reply:
        ready = all(e.ready for e in self.models.engines())
        return Reply.json({"ready": ready}, 200 if ready else 503)

    def server_metadata(self, request: Request) -> Reply:
        return Reply.json({"name": "hybridgnn", "version": __version__, "extensions": ["binary_tensor_data"]})

    def list_models(self, request: Request) -> Reply:
        return Reply.json({"models": [{"name": name, "versions": self.models.versions(name),
                                       "ready": all(self.models.get(name, v).ready for v in self.models.versions(name))}
                                      for name in self.models.names()]})

    def repository_index(self, request: Request) -> Reply:
        """POST /v2/repository/index: every model version, READY or UNAVAILABLE (with why)."""
        return Reply.json(self.index_entries())

    def index_entries(self) -> list[dict]:
        out = [{"name": n, "version": v, "state": "READY" if e.ready else "UNAVAILABLE",
                "reason": "" if e.ready else "starting or draining"} for n, v, e in self.models.items()]
        out += [{"name": n, "version": v, "state": "UNAVAILABLE", "reason": why}
                for (n, v), why in sorted(self.models.unavailable.items())]
        return out

    def model_stats(self, request: Request) -> Reply:
        """GET /v2/models/{m}[/versions/{v}]/stats (or /v2/models/stats: every model): counts
        and cumulative nanoseconds per stage, in Triton's statistics extension's form."""
        return Reply.json({"model_stats": self.stats_entries(request.params.get("model"),
                                                             request.params.get("version"))})

    def stats_entries(self, name: str | None, version: str | None) -> list[dict]:
        if name is not None:
            self.models.get(name, version)  # NotFound naming what exists
        return [e.model_stats.report(n, v) for n, v, e in self.models.items()
                if (name is None or n == name) and (version is None or v == version)]

    def _repository_control(self, request: Request) -> Repository:
        return self.repository_control(request.headers.get("authorization", ""))

    def repository_control(self, authorization: str) -> Repository:
        """The repository, for a request whose Authorization carries the server's update token."""
        if self.repository is None:
            raise Forbidden("this server serves one model (--model); a model repository (--model-repository) "
                            "loads and unloads versions")
        token = self.repository.cfg.updates.token
        if token is None:
            raise Forbidden("repository control is disabled on this server (start it with --update-token)")
        if not hmac.compare_digest(authorization.encode(errors="replace"), f"Bearer {token}".encode()):
            raise Unauthorized("repository control needs 'Authorization: Bearer <token>' with the server's update "
                               "token")
        return self.repository

    async def repository_load(self, request: Request) -> Reply:
        """POST /v2/repository/models/{m}/load: (re)load the model from the repository
        directory; answers once the versions its policy chooses serve (or failed: the
        index says why)."""
        repository = self._repository_control(request)
        name = request.params["model"]
        try:
            versions = await repository.load(name)
        except ConfigError as exc:  # the repository itself is unreadable now
            raise Conflict(str(exc)) from exc
        failed = {v: why for (n, v), why in repository.models.unavailable.items() if n == name}
        if not versions:
            raise Conflict(f"model {name!r} could not be loaded: " + "; ".join(f"version {v}: {why}"
                                                                               for v, why in failed.items()))
        return Reply.json({"name": name, "versions": versions, "unavailable": failed})

    async def repository_unload(self, request: Request) -> Reply:
        """POST /v2/repository/models/{m}/unload: stop serving the model (requests in
        flight finish first)."""
        await self._repository_control(request).unload(request.params["model"])
        return Reply.json({"name": request.params["model"], "unloaded": True})

    def model_config(self, request: Request) -> Reply:
        """GET /v2/models/{m}[/versions/{v}]/config: the model's configuration, in the
        shape Triton's model configuration takes (what tritonclient's get_model_config reads)."""
        return Reply.json(self.config_of(self._check_model(request), request.params["model"]))

    def config_of(self, engine: Engine, name: str) -> dict:
        d = self.describe_model(engine, name)
        triton_type = {"INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}
        return {
            "name": d["name"], "platform": d["platform"], "backend": "hybridgnn", "max_batch_size": 0,
            "input": [{"name": t["name"], "data_type": triton_type[t["datatype"]], "dims": t["shape"]}
                      for t in d["inputs"]],
            "output": [{"name": t["name"], "data_type": triton_type[t["datatype"]], "dims": t["shape"]}
                       for t in d["outputs"]],
            "version_policy": {"specific": {"versions": [int(v) for v in d["versions"] if v.isdigit()]}},
            "parameters": {"fanouts": {"string_value": ",".join(map(str, engine.cfg.sampling.fanouts))}},
        }

    def metrics(self, request: Request) -> Reply:
        body, content_type = self.engine.stats.exposition()
        return Reply(200, body, content_type)

    def model_metadata(self, request: Request) -> Reply:
        engine = self._check_model(request)
        return Reply.json(self.describe_model(engine, request.params["model"]))

    def describe_model(self, engine: Engine, name: str | None = None) -> dict:
        """A model's metadata: name, versions, platform, inputs, outputs, parameters."""
        name = name if name is not None else self.model_name
        id_map = engine.graph.id_map
        id_type = "BYTES" if id_map is not None and id_map.kind == "string" else "INT64"
        outputs = [{"name": "logits", "datatype": "FP32", "shape": [-1, engine.model.out_dim]},
                   {"name": "embeddings", "datatype": "FP32", "shape": [-1, engine.embedding_dim]},
                   {"name": "predictions", "datatype": "INT64", "shape": [-1]}]
        if id_map is not None:
            outputs.append({"name": ID_OUTPUT, "datatype": id_type, "shape": [-1]})
        return {
            "name": name,
            "versions": self.models.versions(name),
            "platform": "pytorch_geometric",
            "inputs": [{"name": INPUT_NAME, "datatype": id_type, "shape": [-1]}],
            "outputs": outputs,
            "parameters": engine.metadata(),
        }

    def model_ready(self, request: Request) -> Reply:
        ready = self._check_model(request).ready
        return Reply.json({"name": self.model_name, "ready": ready}, 200 if ready else 503)

    def infer(self, request: Request) -> Reply | Later | asyncio.Future:
        """POST /v2/models/{m}/infer: a Reply at once for a bad or refused request, else a
        Later (or, for a request that waits for a graph version, a future) of the Reply,
        set in the call that completes its batch."""
        started = time.perf_counter()
        engine, target = self.engine, None
        try:
            engine = target = self._check_model(request)
            if request.standing and engine.shed_standing():
                return self._refused_standing(engine, started)
            header, binary = split_body(request.body, request.headers.get(_HEADER_LENGTH))
            params = header.get("parameters")
            if isinstance(params, dict) and "min_graph_version" in params:
                wanted = graph_version_param(params["min_graph_version"])
                if wanted > engine.graph_version:
                    return asyncio.ensure_future(self._infer_when_caught_up(request, wanted, engine))
            # Refuse before decoding what would wait past the bound: the wait for its turn, or
            # (a sampled inference) the lane with the work its declared ids are expected to
            # bring. Under overload most requests are refused, and a decode costs more than the
            # rest of a refusal.
            declared = declared_ids(header)
            if declared is None:
                engine.shed(request.waited_s)
            else:
                engine.shed(request.waited_s, "sampled", min(declared, engine.cfg.server.max_request_nodes))
            req = decode_infer_parts(header, binary, max_nodes=engine.cfg.server.max_request_nodes,
                                     num_nodes=engine.num_nodes, feature_dim=engine.graph.feature_dim,
                                     id_map=engine.graph.id_map, default_outputs=engine.cfg.server.default_outputs)
            out = Later()

            def answer(result, error: BaseException | None) -> None:
                """The Reply to `req` from its result (or error), into `out`."""
                if out.done():
                    return
                if error is not None:
                    engine.model_stats.failed(time.perf_counter() - started)
                    out.set_result(self._infer_failed(error, engine))
                    return
                try:
                    reply = self._infer_reply(request, req, engine, result, started)
                except Exception as exc:
                    reply = self._infer_failed(exc, engine)
                out.set_result(reply)

            pending = self.dispatch(req, engine, request.waited_s, on_done=answer)
        except Exception as exc:
            if target is not None:  # a request for a model this server has: its statistics count it
                target.model_stats.failed(time.perf_counter() - started)
            return self._infer_failed(exc, engine)
        if pending is None:  # a sampled inference: answer() completes out
            return out
        if not isinstance(pending, asyncio.Future):
            pending = asyncio.ensure_future(pending)

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled():
                answer(None, Draining("request cancelled: server shutting down"))
                return
            error = fut.exception()
            answer(None if error is not None else fut.result(), error)

        when_done(pending, done)
        return out

    def _infer_reply(self, request: Request, req, engine: Engine, result, started: float) -> Reply:
        """The 200 answer to a decoded inference from its result, counted."""
        t0 = time.perf_counter()
        tensors = {"logits": result.logits, "embeddings": result.embeddings, "predictions": result.predictions}
        if req.external_ids is not None:
            tensors[ID_OUTPUT] = req.external_ids
        body, headers = encode_infer_response(request.params["model"], req.request_id, tensors, req.outputs,
                                              model_version=engine.model_version)
        done = time.perf_counter()
        stats = engine.stats
        stats.stage("respond", result.pipeline, done - t0)
        stats.stage("total", result.pipeline, done - started)
        stats.answered(200, req.num_outputs)
        engine.model_stats.answered(done - started, req.num_outputs, result.timings, done - t0)
        content_type = headers.pop("Content-Type")
        return Reply(200, body, content_type, headers or None)

    def _refused_standing(self, engine: Engine, started: float) -> Reply:
        """429 for an inference that waited past the target of a queue that stands in the
        front end. Under overload most refusals are these, thousands a second: one shared
        Reply (the protocol keeps its encoding), counted as every refusal is."""
        reply = self._standing_reply
        if reply is None:
            target_s = standing_queue_limits(self.engine.admission.bound_s)[0]
            reply = self._standing_reply = self.client_error_reply(Overloaded(
                f"waited over {target_s * 1e3:.0f} ms in a standing queue of the front end; retry later",
                retry_after_s=1.0))  # shared: client_error_reply keeps one per message
        engine.model_stats.failed(time.perf_counter() - started)
        engine.stats.refused(Overloaded.reason)
        engine.stats.answered(reply.status)
        return reply

    async def _infer_when_caught_up(self, request: Request, wanted: int, engine: Engine) -> Reply:
        """Read your writes: wait (bounded) until this replica has applied graph version
        `wanted`, then answer; else 503 + Retry-After, which a balancer retries elsewhere."""
        try:
            await self.catch_up(wanted, engine)
        except Exception as exc:
            return self._infer_failed(exc, engine)
        reply = self.infer(request)
        return reply if isinstance(reply, Reply) else await reply

    async def catch_up(self, wanted: int, engine: Engine | None = None) -> None:
        """Return once this replica has applied graph version `wanted`, waiting at most
        --max-catch-up-ms; else ServiceUnavailable (503: a balancer retries elsewhere)."""
        engine = engine if engine is not None else self.engine
        if engine.follower is None:
            raise BadRequest(f"min_graph_version {wanted}: this server takes no graph updates (its graph "
                             "version stays 0)")
        if not await engine.follower.wait_for(wanted, engine.cfg.updates.max_catch_up_s):
            engine.stats.refused("behind")
            raise ServiceUnavailable(f"this replica has applied graph version {engine.graph_version}, not yet "
                                     f"{wanted}; retry (another replica may have it)",
                                     retry_after_s=max(0.1, engine.cfg.updates.max_catch_up_s))

    def _infer_failed(self, exc: BaseException, engine: Engine | None = None) -> Reply:
        """error_reply() for an inference that failed or was refused, counted by status
        (under the model version asked for, when there is one)."""
        reply = self.error_reply(exc, "infer")
        (engine if engine is not None else self.engine).stats.answered(reply.status)
        return reply

    def dispatch(self, req, engine: Engine | None = None, waited_s: float = 0.0, on_done=None):
        """The awaitable that answers a decoded request on `engine` (default: the first),
        by kind and mode; raises BadRequest for a mode the server does not offer.
        waited_s: how long it waited before it was decoded (admission adds it).
        on_done(result, error): for a sampled inference, what the engine calls with its
        answer instead of completing an awaitable (None is returned then)."""
        engine = engine if engine is not None else self.engine
        if req.is_new_nodes:
            return self._new_node_call(req, engine, waited_s)
        engine.check_alive(req.node_ids)
        mode = req.parameters.get("mode", "sampled")
        if mode == "sampled":
            return engine.submit(req.node_ids, waited_s, on_done)
        if mode == "precomputed":
            return engine.side.lookup(req.node_ids, with_embeddings="embeddings" in req.outputs, waited_s=waited_s)
        raise BadRequest(f"unknown mode {brief(mode)}; this server offers {engine.metadata()['modes']}")

    def _new_node_call(self, req, engine: Engine, waited_s: float = 0.0):
        """Validate a new-node request's parameters and return the coroutine that answers it."""
        nn = engine.cfg.new_nodes
        mode = req.parameters.get("mode", nn.default_mode)
        if mode not in ("full", "pe", "srpe", "sampled"):
            raise BadRequest(f"new-node requests take mode full, pe, srpe or sampled, got {brief(mode)}")
        gamma = req.parameters.get("gamma", nn.gamma)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
            raise BadRequest(f"gamma must be a number within [0, 1], got {brief(gamma)}")
        policy = req.parameters.get("policy", nn.policy)
        if policy not in ("ratio", "random", "degree"):
            raise BadRequest(f"policy must be ratio, random or degree, got {brief(policy)}")
        return engine.side.new_nodes_infer(req.features, req.edge_index, mode=mode, gamma=float(gamma),
                                           policy=policy, num_nodes=engine.num_nodes, waited_s=waited_s)

    async def update_graph(self, request: Request) -> Reply:
        """POST /v2/models/{m}/graph: apply a batch of graph updates (see serving/updates.py);
        answers once the graph and every layer's embeddings reflect it."""
        engine = self._check_model(request)
        token = engine.cfg.updates.token
        if token is None:
            raise Forbidden("graph updates are disabled on this server (start it with --update-token)")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(errors="replace"), f"Bearer {token}".encode()):
            raise Unauthorized("graph updates need 'Authorization: Bearer <token>' with the server's update token")
        req = decode_update_request(request.body, request.headers.get(_HEADER_LENGTH),
                                    feature_dim=engine.graph.feature_dim,
                                    max_updates=engine.cfg.updates.max_request_updates,
                                    id_map=engine.graph.id_map)
        key = request.headers.get("idempotency-key")
        if key is not None:
            if not 1 <= len(key) <= 255 or not key.isprintable():
                raise BadRequest("Idempotency-Key must be 1 to 255 printable characters")
            req.logged.idempotency_key, req.logged.body_sha256 = key, hashlib.sha256(request.body).hexdigest()
        return Reply.json(await engine.side.update_graph(req, request.waited_s))
