"""The KServe v2 REST API: routes (method and path) to the v2 service, request bodies
decoded by codec.py and answers encoded by it. The HTTP server (protocol.py) calls
`Api.route` and the endpoint it finds; each endpoint returns a `Reply`, or an awaitable
of one when the answer comes later (an inference). Every error is answered from the v2
service's one map (V2Service.failure); refusals (429/503) share one Reply per message,
whose encoding the protocol keeps. Nothing a client sends raises out of here.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Awaitable
from urllib.parse import unquote

from hybridgnn.errors import MethodNotAllowed, NotFound
from hybridgnn.serving.core.engine import Engine
from hybridgnn.serving.http.codec import (
    HEADER_LENGTH,
    parse_infer,
    parse_load,
    parse_update,
)
from hybridgnn.serving.http.lookups import HttpLookups, infer_reply
from hybridgnn.serving.http.reply import Endpoint, Refusals, Reply, Request, model_route
from hybridgnn.serving.http.turns import standing_queue_limits
from hybridgnn.serving.repository.loader import Repository
from hybridgnn.serving.repository.models import Models
from hybridgnn.serving.v2.lookups import count_taken, lookup_specs
from hybridgnn.serving.v2.service import V2Service
from hybridgnn.serving.v2.types import Failure, GraphUpdateInput, InferAnswer

_HEADER_LENGTH = HEADER_LENGTH.lower()  # request headers reach endpoints with lower-case names
# Methods each path shape accepts; GET endpoints also answer HEAD.
_MODEL_ROUTES = {"": "GET", "ready": "GET", "infer": "POST", "graph": "POST", "config": "GET", "stats": "GET"}


class Api:
    """The REST endpoints of a v2 service (one engine, or a repository's engines)."""

    def __init__(self, engines: Engine | Models | Repository | V2Service):
        self.service = service = engines if isinstance(engines, V2Service) else V2Service(engines)
        self.engine = service.engine  # server-wide settings (limits) come from the first engine
        self._refusals = Refusals()
        self.standing_target_s = standing_queue_limits(self.engine.queue_bound_s)[0]
        self.lookups = _lookups(service)  # answered by this process's HTTP server itself (http/lookups.py)
        s = service
        self._static = {
            "/v2/health/live": self._guarded(lambda r: Reply.json({"live": True}), "live"),
            "/v2/health/ready": self._guarded(lambda r: _ready(s.ready()), "ready"),
            "/v2": self._guarded(lambda r: Reply.json(s.server_metadata()), "server_metadata"),
            "/v2/models": self._guarded(lambda r: Reply.json(s.list_models()), "list_models"),
            "/metrics": self._guarded(lambda r: Reply(200, *s.metrics()), "metrics"),
            "/v2/models/stats": self._guarded(self.model_stats, "model_stats"),
        }
        self._posts = {"/v2/repository/index": self._guarded(lambda r: Reply.json(s.index()), "repository_index")}
        self._repository_endpoints = {
            "load": self._guarded(lambda r: self._json_later(s.load(r.params["model"], _auth(r), parse_load(r.body))),
                                  "repository_load"),
            "unload": self._guarded(lambda r: self._json_later(s.unload(r.params["model"], _auth(r),
                                                                        parse_load(r.body))), "repository_unload")}
        self._model_endpoints = {
            "": self._guarded(lambda r: Reply.json(s.model_metadata(r.params["model"], r.params.get("version"))),
                              "model_metadata"),
            "ready": self._guarded(self.model_ready, "model_ready"),
            "infer": self.infer,
            "graph": self._guarded(self.update_graph, "update_graph"),
            "config": self._guarded(lambda r: Reply.json(s.model_config(r.params["model"], r.params.get("version"))),
                                    "model_config"),
            "stats": self._guarded(self.model_stats, "model_stats")}

    # --- routing ---------------------------------------------------------------------
    def route(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | Reply:
        """The endpoint and route parameters for method+path, or a 404/405 Reply (the HTTP
        server keeps a route found per request target; the parameters are only read)."""
        return self._route(method, path)

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
        params = model_route(path)
        if params is not None:
            action = params.pop("action")
            allowed = _MODEL_ROUTES.get(action)
            if allowed is not None:
                if method == allowed or (allowed == "GET" and method == "HEAD"):
                    return self._model_endpoints[action], params
                return self._not_allowed(method, path, "GET, HEAD" if allowed == "GET" else allowed)
        return self.error_reply(NotFound(f"no such endpoint: {method} {path}"))

    # --- errors ---------------------------------------------------------------------------
    def reply_of(self, failure: Failure) -> Reply:
        """The Reply to a failure (a refusal's shared: http/reply.py's Refusals)."""
        return self._refusals.reply_of(failure)

    def error_reply(self, exc: BaseException | None, where: str = "request") -> Reply:
        """The Reply to an exception (V2Service.failure: a ServingError's own answer, else
        a logged 500 with a request id)."""
        return self.reply_of(self.service.failure(exc, where))

    def internal_error(self, where: str, exc: BaseException | None = None) -> Reply:
        """The answer to an exception that escaped an endpoint or the HTTP layer (exc, or the
        one being handled)."""
        return self.error_reply(exc if exc is not None else sys.exc_info()[1], where)

    def _guarded(self, endpoint: Endpoint, name: str) -> Endpoint:
        """endpoint, answering whatever it raises (or its coroutine raises) with error_reply()."""

        def call(request: Request):
            try:
                reply = endpoint(request)
            except Exception as exc:
                return self.error_reply(exc, name)
            if isinstance(reply, Reply):
                return reply
            return self._settled(reply, name)

        call.__name__ = name
        return call

    async def _settled(self, answer: Awaitable[Reply], where: str) -> Reply:
        try:
            return await answer
        except Exception as exc:
            return self.error_reply(exc, where)

    @staticmethod
    async def _json_later(answer: Awaitable) -> Reply:
        return Reply.json(await answer)

    def _not_allowed(self, method: str, path: str, allow: str) -> Reply:
        return self.error_reply(MethodNotAllowed(f"method {method} not allowed on {path}", allow))

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down (every answer then says Connection: close)."""
        return self.service.draining

    # --- endpoints that read the request --------------------------------------------------
    def model_ready(self, request: Request) -> Reply:
        ready = self.service.model_ready(request.params["model"], request.params.get("version"))
        return Reply.json({"name": request.params["model"], "ready": ready}, 200 if ready else 503)

    def model_stats(self, request: Request) -> Reply:
        """GET /v2/models/{m}[/versions/{v}]/stats (or /v2/models/stats: every model)."""
        return Reply.json({"model_stats": self.service.statistics(request.params.get("model"),
                                                                  request.params.get("version"))})

    def infer(self, request: Request):
        """POST /v2/models/{m}/infer: a Reply at once for a bad or refused request, else a
        Later (or, for one that waits, an awaitable) of the Reply, set in the call that
        completes its batch."""
        if request.standing:
            refused = self.service.refuse_standing(request.params["model"], request.params.get("version"),
                                                   self.standing_target_s, self.reply_of)
            if refused is not None:
                return refused
        lookups = self.lookups
        if lookups is not None and not self.service.draining:
            reply = lookups.quick_reply(request, request.params["model"], request.params.get("version"))
            if reply is not None:
                return reply
        try:
            req, binary = parse_infer(request.body, request.headers.get(_HEADER_LENGTH), request.params["model"],
                                      request.params.get("version"), request.waited_s, request.standing)
        except Exception as exc:
            return self._unparsed(request, exc)
        if self.lookups is not None and not self.service.draining:
            reply = self.lookups.reply(req, binary)
            if reply is not None:
                return reply

        def encode(answer: InferAnswer) -> Reply:
            return infer_reply(answer, binary)

        return self.service.infer(req, encode, self.reply_of)

    def _unparsed(self, request: Request, exc: Exception) -> Reply:
        """The answer to an inference whose body does not parse, counted as the v2 service
        counts a failed inference."""
        reply = self.error_reply(exc, "infer")
        self.service.count_unparsed(request.params["model"], request.params.get("version"), reply.status)
        return reply

    async def update_graph(self, request: Request) -> Reply:
        """POST /v2/models/{m}/graph: a batch of graph updates (serving/core/updates.py)."""
        model, version, key = request.params["model"], request.params.get("version"), request.headers.get(
            "idempotency-key")
        self.service.authorize_update(model, version, _auth(request))  # 404, 403, 401 before the body is read
        update = GraphUpdateInput(model, version, parse_update(request.body, request.headers.get(_HEADER_LENGTH)),
                                  _auth(request), key, hashlib.sha256(request.body).hexdigest() if key else None,
                                  request.waited_s)
        return Reply.json(await self.service.update_graph(update))


def _lookups(service: V2Service) -> HttpLookups | None:
    """The precomputed lookups this process's HTTP server answers itself, counted straight
    into the service (before every statistics read too); None when there are none."""
    lookups = HttpLookups.open(lookup_specs(service), service.engine.queue_bound_s,
                               lambda taken: count_taken(service, taken))
    if lookups is not None:
        service.count_from(lookups.send_counts)
    return lookups


def _auth(request: Request) -> str:
    return request.headers.get("authorization", "")


def _ready(ready: bool) -> Reply:
    return Reply.json({"ready": ready}, 200 if ready else 503)
