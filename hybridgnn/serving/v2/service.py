"""The KServe v2 service, transport-neutral: health, metadata, model configuration and
statistics, the repository extension, inference and graph updates, over the engines of
one server (a Models registry: one model, or a repository's versions over one graph).

Every transport (serving/http, serving/grpc) turns its wire form into v2 types, calls
these methods and turns what they return back into its wire form; none of them goes
through another transport's code. Errors: a method raises a ServingError where it finds
a request bad; `failure()` is the one map from any exception to what is answered (a
ServingError's status, message and headers; anything else a logged 500 with a request
id). inference answers its own errors, through the transport's `fail`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from hybridgnn import __version__
from hybridgnn.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    Draining,
    Forbidden,
    NotFound,
    Overloaded,
    ServiceUnavailable,
    ServingError,
    brief,
)
from hybridgnn.serving.core.eager import Later, when_done
from hybridgnn.serving.core.engine import Engine
from hybridgnn.serving.repository.loader import Repository
from hybridgnn.serving.repository.models import Models
from hybridgnn.serving.v2.describe import config_of, describe_model
from hybridgnn.serving.v2.inference import (
    check_declared_node_ids,
    declared_ids,
    declared_node_ids,
    decode_infer,
    input_limits,
    new_node_parameters,
    refuse_non_finite,
)
from hybridgnn.serving.v2.requests import authorize, decode_update
from hybridgnn.serving.v2.typed import TypedInferRequest, decode_typed
from hybridgnn.serving.v2.typed import input_limits as typed_input_limits
from hybridgnn.serving.v2.types import (
    Failure,
    GraphUpdateInput,
    InferAnswer,
    InferInput,
    InferRequest,
    internal_failure,
)

log = logging.getLogger("hybridgnn.serving.v2")
T = TypeVar("T")
REFUSALS_KEPT = 256  # distinct refusal answers kept (messages name a bound and a retry; few differ)


def graph_version_param(v) -> int:
    """parameters.min_graph_version as given; BadRequest unless an integer >= 0."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"parameters.min_graph_version must be a graph version (an integer >= 0, as a graph "
                         f"update's answer gives), got {brief(v)}")
    return v


class V2Service:
    """The v2 endpoints of a server's engines (and its repository, when it has one)."""

    def __init__(self, engines: Engine | Models | Repository):
        self.repository = engines if isinstance(engines, Repository) else None  # its load/unload API
        if isinstance(engines, Repository):
            engines = engines.models
        if isinstance(engines, Models):
            self.models = engines
        else:
            self.models = Models()
            self.models.add(engines.cfg.server.model_name, engines.model_version, engines)
        # Server-wide settings, stats and drain state come from the first engine: they are
        # the same for every engine of a server.
        self.engine = self.models.engines()[0]
        self.engine.stats.ready_from(self.ready)  # the gauge says what /v2/health/ready says
        self._standing: dict[float, Failure] = {}  # refuse_standing()'s, by target
        self._refusals: dict[tuple, Failure] = {}  # failure()'s 429s and 503s, shared
        self._uncounted: list[Callable[[], None]] = []  # count_from()'s

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down."""
        return self.repository.closing if self.repository is not None else self.engine.draining

    def model(self, name: str, version: str | None = None) -> Engine:
        """The engine serving model `name` (`version`, when given; else its highest);
        NotFound naming what this server serves."""
        return self.models.get(name, version)

    def counting(self, name: str) -> Engine:
        """The engine whose series count an inference that names no model version this
        server serves: the model's highest version when it serves the model, else the
        first model it serves; never a version since unloaded (a repository's first), whose
        series went with it and would come back, for good, at the first such request."""
        try:
            return self.models.get(name)
        except NotFound:
            engines = self.models.engines()
            return engines[0] if engines else self.engine

    @staticmethod
    def max_input_elements(engine: Engine) -> int:
        """The most elements one input of an inference to `engine` may hold (its decoder's
        largest limit): a transport may refuse more before copying them."""
        if getattr(engine, "typed", False):
            return max(typed_input_limits(engine).values())
        return max(input_limits(engine.cfg.server.max_request_nodes, engine.max_feature_dim).values())

    # --- errors ------------------------------------------------------------------------
    def failure(self, exc: BaseException | None, where: str = "request") -> Failure:
        """What exc answers with. A ServingError: its status, its headers and message; a
        refusal (Overloaded, Draining) is counted by reason; a 5xx other than 503 is logged
        with a request id. Anything else is a bug: logged with its traceback and a request
        id that the answer carries too, so a report can be matched to its log line."""
        try:
            if isinstance(exc, ConfigError):  # a repository that cannot be read now: the client can do nothing
                exc = Conflict(str(exc))
            if isinstance(exc, ServingError):
                if isinstance(exc, (Overloaded, Draining)):
                    self.engine.stats.refused(exc.reason)
                if exc.status >= 500 and exc.status != 503:  # ours, not the client's: find it in the log
                    request_id = os.urandom(6).hex()
                    log.error("[%s] %s: %s (%d)", request_id, where, exc.message, exc.status)
                    return Failure(exc.status, exc.message, exc.headers(), request_id)
                if exc.status in (429, 503):  # refusals, thousands a second under overload: one per message
                    key = (exc.status, exc.message, exc.retry_after_s)
                    failure = self._refusals.get(key)
                    if failure is None:
                        if len(self._refusals) >= REFUSALS_KEPT:
                            self._refusals.clear()
                        failure = self._refusals[key] = Failure(exc.status, exc.message, exc.headers())
                    return failure
                return Failure(exc.status, exc.message, exc.headers())
        except Exception:  # a broken error must not take the answer with it
            log.exception("could not answer %r", exc)
        return internal_failure(exc, where, log)

    # --- health and metadata ------------------------------------------------------------
    def ready(self) -> bool:
        return all(e.ready for e in self.models.engines())

    def server_metadata(self) -> dict:
        return {"name": "hybridgnn", "version": __version__, "extensions": ["binary_tensor_data"]}

    def list_models(self) -> dict:
        return {"models": [{"name": name, "versions": self.models.versions(name),
                            "ready": all(self.models.get(name, v).ready for v in self.models.versions(name))}
                           for name in self.models.names()]}

    def model_metadata(self, name: str, version: str | None = None) -> dict:
        return describe_model(self.model(name, version), name, self.models.versions(name))

    def model_ready(self, name: str, version: str | None = None) -> bool:
        return self.model(name, version).ready

    def model_config(self, name: str, version: str | None = None) -> dict:
        """The model's configuration, in the shape Triton's model configuration takes."""
        return config_of(self.model(name, version), name, self.models.versions(name))

    def statistics(self, name: str | None = None, version: str | None = None) -> list[dict]:
        """Counts and cumulative nanoseconds per stage, as Triton's statistics extension
        has them, of one model (version) or every one."""
        self.count_pending()
        if name is not None:
            self.models.get(name, version)  # NotFound naming what exists
        return [e.model_stats.report(n, v) for n, v, e in self.models.items()
                if (name is None or n == name) and (version is None or v == version)]

    def metrics(self) -> tuple[bytes, str]:
        self.count_pending()
        return self.engine.stats.exposition()

    def count_from(self, source: Callable[[], None]) -> None:
        """source() counts answers given outside infer() and not counted yet (lookups a
        transport answered itself, v2/lookups.py); every statistics read calls it first."""
        self._uncounted.append(source)

    def count_pending(self) -> None:
        for source in self._uncounted:
            source()

    # --- repository extension -------------------------------------------------------------
    def index(self) -> list[dict]:
        """Every model version once, READY or UNAVAILABLE (with why). A version that serves
        while its changed files failed to load serves the files it loaded before: READY,
        with the failure as its reason (it was listed twice, READY and UNAVAILABLE)."""
        failed = dict(self.models.unavailable)
        out = []
        for n, v, e in self.models.items():
            why = failed.pop((n, v), None)
            reason = ("" if e.ready else "starting or draining") if why is None else (
                f"serving the files loaded before; loading the changed ones failed: {why}")
            out.append({"name": n, "version": v, "state": "READY" if e.ready else "UNAVAILABLE", "reason": reason})
        out += [{"name": n, "version": v, "state": "UNAVAILABLE", "reason": why} for (n, v), why in sorted(failed.items())]
        return out

    def _repository(self, authorization: str) -> Repository:
        """The repository, for a request whose Authorization carries the server's update token."""
        if self.repository is None:
            raise Forbidden("this server serves one model (--model); a model repository (--model-repository) "
                            "loads and unloads versions")
        if self.repository.cfg.updates.token is None:
            raise Forbidden("repository control is disabled on this server (start it with --update-token)")
        authorize(self.repository.cfg.updates.token, authorization, "repository control needs")
        return self.repository

    async def load(self, name: str, authorization: str, parameters: dict | None = None) -> dict:
        """(Re)load a model from the repository directory; answers once the versions its
        policy chooses serve (or failed: the index says why). parameters: the request's
        (Triton's config and file overrides), which are refused: they were ignored, and
        the model served as its directory holds it."""
        repository = self._repository(authorization)
        if parameters:
            raise BadRequest(f"load parameters {sorted(map(str, parameters))[:8]} are not supported: a model is "
                             "loaded as its repository directory holds it (change its files, then load it)")
        try:
            versions = await repository.load(name)
        except ConfigError as exc:  # the repository itself is unreadable now
            raise Conflict(str(exc)) from exc
        failed = {v: why for (n, v), why in repository.models.unavailable.items() if n == name}
        if not versions:
            # a reason of the model itself (its config.json, no version chosen) is under version ""
            raise Conflict(f"model {name!r} could not be loaded: " + "; ".join(f"version {v}: {why}" if v else why
                                                                               for v, why in failed.items()))
        return {"name": name, "versions": versions, "unavailable": failed}

    async def unload(self, name: str, authorization: str, parameters: dict | None = None) -> dict:
        """Stop serving a model (requests in flight finish first). parameters: the
        request's; Triton's `unload_dependents` (which tritonclient always sends) is taken,
        as this repository's models have no dependents; any other is refused, as a load's
        are (a body that was ignored unloaded the model whatever it asked)."""
        repository = self._repository(authorization)
        unknown = sorted(map(str, parameters or {}))
        if [p for p in unknown if p != "unload_dependents"]:
            raise BadRequest(f"unload parameters {unknown[:8]} are not supported (only 'unload_dependents': this "
                             "repository's models have no dependents)")
        await repository.unload(name)
        return {"name": name, "unloaded": True}

    # --- inference ------------------------------------------------------------------------
    def infer(self, request: InferInput, encode: Callable[[InferAnswer], T], fail: Callable[[Failure], T]):
        """Answer an inference: encode(answer) makes the transport's 200 answer, fail(failure)
        its error answer. Returns that answer at once for a bad or refused request, else a
        Later of it (set in the call that completes the batch), or, for one that waits
        (a graph version, a lookup, new nodes), an awaitable of it."""
        started = time.perf_counter()
        engine, target = self.engine, None
        try:
            engine = target = self.models.get(request.model, request.version)
            server = engine.cfg.server
            # typed requests have limits of their own
            named = (declared_node_ids(request) if getattr(engine, "typed", False)
                     else check_declared_node_ids(request, server.max_request_nodes))
            params = request.parameters
            if isinstance(params, dict) and "min_graph_version" in params:
                wanted = graph_version_param(params["min_graph_version"])
                if wanted > engine.graph_version:
                    return asyncio.ensure_future(self._infer_when_caught_up(request, wanted, engine, encode, fail))
            # Refuse before decoding what would wait past the bound: the wait for its turn, or
            # (a sampled inference) the lane with the work its declared ids are expected to
            # bring. Under overload most requests are refused, and a decode costs more than the
            # rest of a refusal.
            declared = declared_ids(request, named)
            if declared is None:
                engine.shed(request.waited_s)
            else:
                engine.shed(request.waited_s, "sampled", min(declared, server.max_request_nodes))
            if getattr(engine, "typed", False):  # a heterogeneous graph: typed requests
                req = decode_typed(request, engine)
            else:
                graph = engine.graph
                req = decode_infer(request, max_nodes=server.max_request_nodes, num_nodes=engine.num_nodes,
                                   feature_dim=graph.feature_dim, id_map=graph.id_map,
                                   default_outputs=server.default_outputs)
            out = Later()

            def answer(result, error: BaseException | None) -> None:
                """The answer to `req` from its result (or error), into `out`."""
                if out.done():
                    return
                if error is not None:
                    engine.model_stats.failed(time.perf_counter() - started)
                    out.set_result(self._failed(error, engine, fail))
                    return
                try:
                    reply = self._answered(req, request.model, engine, result, started, encode)
                except Exception as exc:
                    reply = self._failed(exc, engine, fail)
                if isinstance(reply, Later):  # encoded over several turns of the loop
                    reply.add_eager_callback(lambda done: out.set_result(done.result()))
                else:
                    out.set_result(reply)

            if isinstance(req, TypedInferRequest):
                pending = engine.infer(req.query, request.waited_s, req.mode, "embeddings" in req.outputs)
            else:
                pending = self._dispatch(req, engine, request.waited_s, answer)
        except Exception as exc:
            if target is not None:  # a request for a model this server has: its statistics count it
                target.model_stats.failed(time.perf_counter() - started)
            else:
                engine = self.counting(request.model)
            return self._failed(exc, engine, fail)
        if pending is None:  # a sampled inference: answer() completes out
            return out

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled():
                answer(None, Draining("request cancelled: server shutting down"))
                return
            error = fut.exception()
            answer(None if error is not None else fut.result(), error)

        when_done(asyncio.ensure_future(pending), done)
        return out

    def _answered(self, req: InferRequest, model: str, engine: Engine, result, started: float, encode):
        """The transport's 200 answer to a decoded inference from its result, counted once
        encoded; a Later of it when the transport's encode gives one (a large JSON answer,
        encoded over several turns of the loop)."""
        t0 = time.perf_counter()
        outputs = req.answer_outputs(result)
        if req.is_new_nodes:
            refuse_non_finite(result)
        reply = encode(InferAnswer(model, engine.model_version, req.request_id, outputs))
        if isinstance(reply, Later):  # the transport encodes it over several turns of the loop
            # counted before it is written (callbacks run in order); an encoding that failed
            # on the way is the transport's error answer (HTTP's 500), counted as a failure
            reply.add_eager_callback(lambda done: self._count_answered(req, engine, result, started, t0)
                                     if getattr(done.result(), "status", 200) == 200 else
                                     self._count_failed(engine, started, done.result().status))
            return reply
        self._count_answered(req, engine, result, started, t0)
        return reply

    def _count_failed(self, engine: Engine, started: float, status: int) -> None:
        engine.model_stats.failed(time.perf_counter() - started)
        engine.stats.answered(status)

    def _count_answered(self, req: InferRequest, engine: Engine, result, started: float, t0: float) -> None:
        """Count an answer encoded now (t0: when its encoding began)."""
        done = time.perf_counter()
        stats = engine.stats
        stats.stage("respond", result.pipeline, done - t0)
        stats.stage("total", result.pipeline, done - started)
        stats.answered(200, req.num_outputs)
        engine.model_stats.answered(done - started, req.num_outputs, result.timings, done - t0)

    def _failed(self, exc: BaseException, engine: Engine, fail):
        """The transport's answer to an inference that failed or was refused, counted by
        status (under the model version asked for, when there is one)."""
        failure = self.failure(exc, "infer")
        engine.stats.answered(failure.status)
        return fail(failure)

    def count_unparsed(self, model: str, version: str | None, status: int, count: int = 1) -> None:
        """Count `count` inferences a transport answered itself (status: their answer),
        because a body did not parse or the engine could not be reached, as failed
        inferences of the model asked for, when this server has it."""
        try:
            engine = self.models.get(model, version)
        except NotFound:
            engine = self.counting(model)
        else:
            for _ in range(count):
                engine.model_stats.failed(0.0)
        for _ in range(count):
            engine.stats.answered(status)

    def count_local(self, model: str, version: str, seconds: np.ndarray, respond_s: np.ndarray, rows: int) -> None:
        """Count lookups a front-end process answered itself (v2/lookups.py): seconds and
        respond_s per answer, rows in all; as _answered counts the engine's own. A version
        unloaded since is not counted."""
        try:
            engine = self.models.get(model, version)
        except NotFound:
            return
        engine.stats.answered_elsewhere("precomputed", seconds, respond_s, rows)
        engine.model_stats.answered_elsewhere(len(seconds), float(seconds.sum()), rows, float(respond_s.sum()))

    def refuse_standing(self, model: str, version: str | None, target_s: float, fail):
        """For an inference that waited past the target of a queue that stands in the front
        end (target_s: its target), before it is parsed: fail(429), or None when it is answered as usual (an
        unknown model, or a server starting or draining: their own answers apply). Under
        overload most refusals are these, thousands a second: one Failure (transports keep
        its encoding), counted as every refusal is."""
        started = time.perf_counter()
        try:
            engine = self.models.get(model, version)
        except ServingError:
            return None
        if not engine.shed_standing():
            return None
        failure = self._standing.get(target_s)
        if failure is None:
            exc = Overloaded(f"waited over {target_s * 1e3:.0f} ms in a standing queue of the front end; retry later")
            failure = self._standing[target_s] = Failure(exc.status, exc.message, exc.headers())
        engine.model_stats.failed(time.perf_counter() - started)
        engine.stats.refused(Overloaded.reason)
        engine.stats.answered(failure.status)
        return fail(failure)


    async def _infer_when_caught_up(self, request: InferInput, wanted: int, engine: Engine, encode, fail):
        """Read your writes: wait (bounded) until this replica has applied graph version
        `wanted`, then answer; else 503 + Retry-After, which a balancer retries elsewhere."""
        try:
            await self.catch_up(wanted, engine)
        except Exception as exc:
            return self._failed(exc, engine, fail)
        answer = self.infer(request, encode, fail)
        return await answer if isinstance(answer, (Later, asyncio.Future)) else answer

    async def catch_up(self, wanted: int, engine: Engine) -> None:
        """Return once this replica has applied graph version `wanted`, waiting at most
        --max-catch-up-ms; else ServiceUnavailable (503: a balancer retries elsewhere)."""
        if wanted <= engine.graph_version:
            return
        if not engine.takes_updates:
            raise BadRequest(f"min_graph_version {wanted}: this server takes no graph updates (its graph "
                             "version stays 0)")
        if not await engine.wait_for_version(wanted):
            engine.stats.refused("behind")
            raise ServiceUnavailable(f"this replica has applied graph version {engine.graph_version}, not yet "
                                     f"{wanted}; retry (another replica may have it)",
                                     retry_after_s=max(0.1, engine.cfg.updates.max_catch_up_s))

    def _dispatch(self, req: InferRequest, engine: Engine, waited_s: float, on_done):
        """Send a decoded request to the engine by kind and mode: None for a sampled
        inference (the engine calls on_done) or a lookup answered at once (on_done was
        called), else the awaitable that answers it. BadRequest for a mode the server does
        not offer."""
        if req.is_new_nodes:
            return self._new_nodes(req, engine, waited_s)
        engine.check_alive(req.node_ids)
        mode = req.parameters.get("mode", engine.default_mode)
        if mode == "sampled":
            engine.submit(req.node_ids, on_done, waited_s)
            return None
        if mode == "full" and engine.serves_full:
            return engine.full(req.node_ids, waited_s)
        if mode == "precomputed":
            with_embeddings = "embeddings" in req.outputs
            result = engine.lookup_now(req.node_ids, with_embeddings=with_embeddings, waited_s=waited_s)
            if result is not None:  # answered in this call: no task, no turn of the loop
                on_done(result, None)
                return None
            return engine.lookup(req.node_ids, with_embeddings=with_embeddings, waited_s=waited_s)
        raise BadRequest(f"unknown mode {brief(mode)}; this server offers {engine.metadata()['modes']}")

    def _new_nodes(self, req: InferRequest, engine: Engine, waited_s: float):
        """Validate a new-node request's parameters and return the coroutine that answers it."""
        mode, gamma, policy = new_node_parameters(req.parameters, engine.cfg.new_nodes)
        return engine.new_nodes(req.features, req.edge_index, mode=mode, gamma=gamma, policy=policy,
                                num_nodes=engine.num_nodes, waited_s=waited_s)

    # --- graph updates ----------------------------------------------------------------------
    def authorize_update(self, model: str, version: str | None, authorization: str) -> Engine:
        """The engine a graph update goes to, if the request may update it (404, 403, 401)."""
        engine = self.model(model, version)
        token = engine.cfg.updates.token
        if token is None:
            if self.repository is not None:  # its --update-token guards load and unload instead
                raise Forbidden("graph updates serve one model (--model), not a model repository; here "
                                "--update-token guards the repository's load and unload")
            raise Forbidden("graph updates are disabled on this server (start it with --update-token)")
        authorize(token, authorization, "graph updates need")
        return engine

    async def update_graph(self, request: GraphUpdateInput) -> dict:
        """Apply a batch of graph updates; answers once the graph and every layer's
        embeddings reflect it (its graph_version, and the ids of new nodes)."""
        engine = self.authorize_update(request.model, request.version, request.authorization)
        graph = engine.graph
        update = decode_update(request.inputs, feature_dim=graph.feature_dim,
                               max_updates=engine.cfg.updates.max_request_updates, id_map=graph.id_map,
                               idempotency_key=request.idempotency_key, body_sha256=request.body_sha256)
        return await engine.update_graph(update, request.waited_s)

