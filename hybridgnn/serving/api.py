"""The KServe v2 REST API, independent of the HTTP server that carries it.

`Api.route(method, path)` finds the endpoint; each endpoint returns a `Reply`, or an
awaitable of one when the answer comes later (an inference). Both front ends — the
built-in asyncio protocol server (serving/http.py) and the aiohttp app (serving/app.py) —
call these, so status codes, messages and headers are the same whichever serves.
Every client error is a JSON body {"error": ...}; nothing a client sends raises out of here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

from hybridgnn import __version__
from hybridgnn.graph.dynamic import UpdateError
from hybridgnn.serving.codec import (
    HEADER_LENGTH,
    INPUT_NAME,
    RequestError,
    decode_infer_request,
    encode_infer_response,
)
from hybridgnn.serving.engine import BatchFailed, Draining, Engine, Overloaded, RemovedNode
from hybridgnn.serving.updates import decode_update_request

log = logging.getLogger(__name__)

JSON = "application/json"
_HEADER_LENGTH = HEADER_LENGTH.lower()  # request headers reach endpoints with lower-case names


class Reply:
    """One HTTP answer: status, body bytes, content type and any extra headers."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int, body: bytes, content_type: str = JSON, headers: dict[str, str] | None = None):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, json.dumps(obj).encode(), JSON, headers)

    @classmethod
    def error(cls, status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
        return cls.json({"error": message}, status, headers)


class Request:
    """What an endpoint reads from an HTTP request: route parameters, the headers it
    uses (names lower-case) and the body."""

    __slots__ = ("params", "headers", "body")

    def __init__(self, params: dict[str, str], headers: dict[str, str], body: bytes):
        self.params = params
        self.headers = headers
        self.body = body


Endpoint = Callable[[Request], "Reply | Awaitable[Reply]"]
# Methods each path shape accepts; GET endpoints also answer HEAD.
_MODEL_ROUTES = {"": "GET", "ready": "GET", "infer": "POST", "graph": "POST"}


def _chain(fut: asyncio.Future, finish: Callable[[asyncio.Future], Reply]) -> asyncio.Future:
    """A future of finish(fut) once fut is done, without a task per request."""
    out = fut.get_loop().create_future()

    def done(f: asyncio.Future) -> None:
        if not out.done():
            try:
                out.set_result(finish(f))
            except Exception as exc:  # finish() maps expected errors; anything else is a 500
                log.exception("could not build a reply")
                out.set_result(Reply.error(500, f"internal server error: {type(exc).__name__}"))

    fut.add_done_callback(done)
    return out


class Api:
    """The endpoints of one engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_name = engine.cfg.server.model_name
        self.retry = {"Retry-After": str(engine.cfg.server.retry_after_s)}
        self._static = {
            "/v2/health/live": self.live,
            "/v2/health/ready": self.ready,
            "/v2": self.server_metadata,
            "/v2/models": self.list_models,
            "/metrics": self.metrics,
        }
        self._model_endpoints = {"": self.model_metadata, "ready": self.model_ready, "infer": self.infer,
                                 "graph": self.update_graph}

    # --- routing ---------------------------------------------------------------------
    def route(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | Reply:
        """The endpoint and route parameters for method+path, or a 404/405 Reply."""
        if "%" in path:
            path = unquote(path)
        endpoint = self._static.get(path)
        if endpoint is not None:
            if method not in ("GET", "HEAD"):
                return self._not_allowed(method, path, "GET, HEAD")
            return endpoint, {}
        parts = path.split("/")
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
        return Reply.error(404, f"no such endpoint: {method} {path}")

    @staticmethod
    def _not_allowed(method: str, path: str, allow: str) -> Reply:
        return Reply.error(405, f"method {method} not allowed on {path}", headers={"Allow": allow})

    def body_too_large(self) -> Reply:
        return Reply.error(413, f"request body too large (limit {self.engine.cfg.server.max_body_bytes} bytes)")

    def _check_model(self, request: Request) -> None:
        name = request.params["model"]
        if name != self.model_name:
            raise RequestError(f"unknown model {name!r}; this server serves {self.model_name!r}", 404)

    # --- endpoints -------------------------------------------------------------------
    def live(self, request: Request) -> Reply:
        return Reply.json({"live": True})

    def ready(self, request: Request) -> Reply:
        ready = self.engine.ready
        return Reply.json({"ready": ready}, 200 if ready else 503)

    def server_metadata(self, request: Request) -> Reply:
        return Reply.json({"name": "hybridgnn", "version": __version__, "extensions": ["binary_tensor_data"]})

    def list_models(self, request: Request) -> Reply:
        return Reply.json({"models": [{"name": self.model_name, "versions": ["1"], "ready": self.engine.ready}]})

    def metrics(self, request: Request) -> Reply:
        tel = self.engine.telemetry
        return Reply(200, tel.exposition(), tel.content_type)

    def model_metadata(self, request: Request) -> Reply:
        try:
            self._check_model(request)
        except RequestError as exc:
            return Reply.error(exc.status, str(exc))
        engine = self.engine
        emb_dim = engine.model.spec.out_dim
        return Reply.json({
            "name": self.model_name,
            "versions": ["1"],
            "platform": "pytorch_geometric",
            "inputs": [{"name": INPUT_NAME, "datatype": "INT64", "shape": [-1]}],
            "outputs": [{"name": "embeddings", "datatype": "FP32", "shape": [-1, emb_dim]},
                        {"name": "predictions", "datatype": "INT64", "shape": [-1]}],
            "parameters": engine.metadata(),
        })

    def model_ready(self, request: Request) -> Reply:
        try:
            self._check_model(request)
        except RequestError as exc:
            return Reply.error(exc.status, str(exc))
        ready = self.engine.ready
        return Reply.json({"name": self.model_name, "ready": ready}, 200 if ready else 503)

    def infer(self, request: Request) -> Reply | asyncio.Future:
        """POST /v2/models/{m}/infer: a Reply at once for a bad or refused request, else a
        future of the Reply that resolves when its batch is done."""
        started = time.perf_counter()
        engine = self.engine
        try:
            self._check_model(request)
            req = decode_infer_request(request.body, request.headers.get(_HEADER_LENGTH),
                                       max_nodes=engine.cfg.server.max_request_nodes, num_nodes=engine.num_nodes,
                                       feature_dim=engine.graph.feature_dim)
            pending = self._dispatch(req)
        except Exception as exc:
            return self._infer_error(exc)
        if not isinstance(pending, asyncio.Future):
            pending = asyncio.ensure_future(pending)

        def finish(fut: asyncio.Future) -> Reply:
            exc = fut.exception()
            if exc is not None:
                return self._infer_error(exc)
            result = fut.result()
            t0 = time.perf_counter()
            body, headers = encode_infer_response(
                self.model_name, req.request_id,
                {"embeddings": result.embeddings, "predictions": result.predictions}, req.outputs)
            done = time.perf_counter()
            tel = engine.telemetry
            tel.observe_stage("respond", result.pipeline, done - t0)
            tel.observe_stage("total", result.pipeline, done - started)
            tel.count_request(200, req.num_outputs)
            content_type = headers.pop("Content-Type")
            return Reply(200, body, content_type, headers or None)

        return _chain(pending, finish)

    def _infer_error(self, exc: BaseException) -> Reply:
        """The Reply for an inference that failed or was refused; counts it by status."""
        tel = self.engine.telemetry
        if isinstance(exc, RequestError):
            reply = Reply.error(exc.status, str(exc))
        elif isinstance(exc, RemovedNode):
            reply = Reply.error(404, str(exc))
        elif isinstance(exc, LookupError):  # a mode whose artifacts (precomputed embeddings) are missing
            reply = Reply.error(409, str(exc))
        elif isinstance(exc, Overloaded):
            tel.rejected.labels("overload").inc()
            reply = Reply.error(429, f"server overloaded: {exc}; retry later", self.retry)
        elif isinstance(exc, Draining):
            tel.rejected.labels("draining").inc()
            reply = Reply.error(503, f"not accepting requests: {exc}", self.retry)
        elif isinstance(exc, BatchFailed):
            reply = Reply.error(500, f"inference failed: {exc}")
        else:
            log.error("inference failed unexpectedly", exc_info=exc)
            reply = Reply.error(500, f"internal server error: {type(exc).__name__}")
        tel.count_request(reply.status)
        return reply

    def _dispatch(self, req):
        """The awaitable that answers a decoded request, by kind and mode; raises RequestError
        for a mode the server does not offer."""
        engine = self.engine
        if req.is_new_nodes:
            if engine.dynamic is not None and engine.dynamic.version > 0:
                raise RequestError("new-node requests are evaluated on the stored graph and embeddings, which graph "
                                   "updates have changed since; add the nodes with POST /v2/models/{m}/graph and "
                                   "read their fresh embeddings with mode=precomputed", 409)
            return self._new_node_call(req)
        engine.check_alive(req.node_ids)
        mode = req.parameters.get("mode", "sampled")
        if mode == "sampled":
            return engine.submit(req.node_ids)
        if mode == "precomputed":
            return engine.lookup_precomputed(req.node_ids)
        raise RequestError(f"unknown mode {mode!r}; this server offers {engine.metadata()['modes']}")

    def _new_node_call(self, req):
        """Validate a new-node request's parameters and return the coroutine that answers it."""
        nn = self.engine.cfg.new_nodes
        mode = req.parameters.get("mode", nn.default_mode)
        if mode not in ("full", "pe", "srpe", "sampled"):
            raise RequestError(f"new-node requests take mode full, pe, srpe or sampled, got {mode!r}")
        gamma = req.parameters.get("gamma", nn.gamma)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
            raise RequestError(f"gamma must be a number within [0, 1], got {gamma!r}")
        policy = req.parameters.get("policy", nn.policy)
        if policy not in ("ratio", "random", "degree"):
            raise RequestError(f"policy must be ratio, random or degree, got {policy!r}")
        return self.engine.infer_new_nodes(req.features, req.edge_index, mode=mode, gamma=float(gamma),
                                           policy=policy)

    async def update_graph(self, request: Request) -> Reply:
        """POST /v2/models/{m}/graph: apply a batch of graph updates (see serving/updates.py);
        answers once the graph and every layer's embeddings reflect it."""
        engine = self.engine
        try:
            self._check_model(request)
            token = engine.cfg.updates.token
            if token is None:
                raise RequestError("graph updates are disabled on this server (start it with --update-token)", 403)
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise RequestError("graph updates need 'Authorization: Bearer <token>' with the server's update "
                                   "token", 401)
            req = decode_update_request(request.body, request.headers.get(_HEADER_LENGTH),
                                        feature_dim=engine.graph.feature_dim,
                                        max_updates=engine.cfg.updates.max_request_updates)
            result = await engine.apply_update(req)
        except RequestError as exc:
            return Reply.error(exc.status, str(exc))
        except UpdateError as exc:
            return Reply.error(400, f"update rejected, nothing applied: {exc}")
        except Overloaded as exc:
            return Reply.error(429, f"server overloaded: {exc}; retry later", self.retry)
        except Draining as exc:
            return Reply.error(503, f"not accepting updates: {exc}", self.retry)
        return Reply.json(result)
