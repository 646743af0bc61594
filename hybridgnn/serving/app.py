"""aiohttp application: KServe v2 REST endpoints, /metrics, JSON errors everywhere."""

from __future__ import annotations

import hmac
import logging
import time

from aiohttp import web

from hybridgnn import __version__
from hybridgnn.graph.dynamic import UpdateError
from hybridgnn.serving.codec import (
    HEADER_LENGTH,
    INPUT_NAME,
    RequestError,
    decode_infer_request,
    encode_infer_response,
)
from hybridgnn.serving.engine import (
    BatchFailed,
    Draining,
    Engine,
    Overloaded,
    RemovedNode,
)
from hybridgnn.serving.updates import decode_update_request

log = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("engine", Engine)


def json_error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    """No client input escapes as a traceback or an HTML page: everything is {"error": ...}."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.reason
        if exc.status == 413:
            reason = f"request body too large (limit {request.app[ENGINE_KEY].cfg.server.max_body_bytes} bytes)"
        elif exc.status == 404:
            reason = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            reason = f"method {request.method} not allowed on {request.path}"
        return json_error(exc.status, reason, headers={k: v for k, v in exc.headers.items() if k == "Allow"})
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal server error")


def _model(request: web.Request) -> Engine:
    engine = request.app[ENGINE_KEY]
    name = request.match_info["model"]
    if name != engine.cfg.server.model_name:
        raise RequestError(f"unknown model {name!r}; this server serves {engine.cfg.server.model_name!r}", 404)
    return engine


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"ready": engine.ready}, status=200 if engine.ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "hybridgnn", "version": __version__, "extensions": ["binary_tensor_data"]})


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"models": [{"name": engine.cfg.server.model_name, "versions": ["1"],
                                          "ready": engine.ready}]})


async def model_metadata(request: web.Request) -> web.Response:
    try:
        engine = _model(request)
    except RequestError as exc:
        return json_error(exc.status, str(exc))
    emb_dim = engine.model.spec.out_dim
    return web.json_response({
        "name": engine.cfg.server.model_name,
        "versions": ["1"],
        "platform": "pytorch_geometric",
        "inputs": [{"name": INPUT_NAME, "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "embeddings", "datatype": "FP32", "shape": [-1, emb_dim]},
                    {"name": "predictions", "datatype": "INT64", "shape": [-1]}],
        "parameters": engine.metadata(),
    })


async def model_ready(request: web.Request) -> web.Response:
    try:
        engine = _model(request)
    except RequestError as exc:
        return json_error(exc.status, str(exc))
    return web.json_response({"name": engine.cfg.server.model_name, "ready": engine.ready},
                             status=200 if engine.ready else 503)


def _dispatch(engine: Engine, req):
    """The awaitable that answers a decoded request, by kind and mode; raises RequestError
    for a mode the server does not offer."""
    if req.is_new_nodes:
        if engine.dynamic is not None and engine.dynamic.version > 0:
            raise RequestError("new-node requests are evaluated on the stored graph and embeddings, which graph "
                               "updates have changed since; add the nodes with POST /v2/models/{m}/graph and read "
                               "their fresh embeddings with mode=precomputed", 409)
        return _new_node_call(engine, req)
    engine.check_alive(req.node_ids)
    mode = req.parameters.get("mode", "sampled")
    if mode == "sampled":
        return engine.submit(req.node_ids)
    if mode == "precomputed":
        return engine.lookup_precomputed(req.node_ids)
    raise RequestError(f"unknown mode {mode!r}; this server offers {engine.metadata()['modes']}")


async def infer(request: web.Request) -> web.Response:
    started = time.perf_counter()
    engine = request.app[ENGINE_KEY]
    tel = engine.telemetry
    retry = {"Retry-After": str(engine.cfg.server.retry_after_s)}
    try:
        _model(request)
        body = await request.read()
        req = decode_infer_request(body, request.headers.get(HEADER_LENGTH),
                                   max_nodes=engine.cfg.server.max_request_nodes, num_nodes=engine.num_nodes,
                                   feature_dim=engine.graph.feature_dim)
        result = await _dispatch(engine, req)
    except RequestError as exc:
        tel.count_request(exc.status)
        return json_error(exc.status, str(exc))
    except RemovedNode as exc:
        tel.count_request(404)
        return json_error(404, str(exc))
    except LookupError as exc:  # a mode whose artifacts (precomputed embeddings) are missing
        tel.count_request(409)
        return json_error(409, str(exc))
    except Overloaded as exc:
        tel.count_request(429)
        tel.rejected.labels("overload").inc()
        return json_error(429, f"server overloaded: {exc}; retry later", headers=retry)
    except Draining as exc:
        tel.count_request(503)
        tel.rejected.labels("draining").inc()
        return json_error(503, f"not accepting requests: {exc}", headers=retry)
    except BatchFailed as exc:
        tel.count_request(500)
        return json_error(500, f"inference failed: {exc}")
    t0 = time.perf_counter()
    body, headers = encode_infer_response(
        engine.cfg.server.model_name, req.request_id,
        {"embeddings": result.embeddings, "predictions": result.predictions}, req.outputs)
    done = time.perf_counter()
    tel.observe_stage("respond", result.pipeline, done - t0)
    tel.observe_stage("total", result.pipeline, done - started)
    tel.count_request(200, req.num_outputs)
    return web.Response(body=body, headers=headers)


async def metrics(request: web.Request) -> web.Response:
    tel = request.app[ENGINE_KEY].telemetry
    return web.Response(body=tel.exposition(), headers={"Content-Type": tel.content_type})


def _new_node_call(engine: Engine, req):
    """Validate a new-node request's parameters and return the coroutine that answers it."""
    nn = engine.cfg.new_nodes
    mode = req.parameters.get("mode", nn.default_mode)
    if mode not in ("full", "pe", "srpe", "sampled"):
        raise RequestError(f"new-node requests take mode full, pe, srpe or sampled, got {mode!r}")
    gamma = req.parameters.get("gamma", nn.gamma)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise RequestError(f"gamma must be a number within [0, 1], got {gamma!r}")
    policy = req.parameters.get("policy", nn.policy)
    if policy not in ("ratio", "random", "degree"):
        raise RequestError(f"policy must be ratio, random or degree, got {policy!r}")
    return engine.infer_new_nodes(req.features, req.edge_index, mode=mode, gamma=float(gamma), policy=policy)


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    if request.app[ENGINE_KEY].draining:
        response.force_close()  # sends "Connection: close": the next request opens a new connection


async def update_graph(request: web.Request) -> web.Response:
    """POST /v2/models/{m}/graph: apply a batch of graph updates (see serving/updates.py);
    answers once the graph and every layer's embeddings reflect it."""
    engine = request.app[ENGINE_KEY]
    retry = {"Retry-After": str(engine.cfg.server.retry_after_s)}
    try:
        _model(request)
        token = engine.cfg.updates.token
        if token is None:
            raise RequestError("graph updates are disabled on this server (start it with --update-token)", 403)
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise RequestError("graph updates need 'Authorization: Bearer <token>' with the server's update token",
                               401)
        body = await request.read()
        req = decode_update_request(body, request.headers.get(HEADER_LENGTH), feature_dim=engine.graph.feature_dim,
                                    max_updates=engine.cfg.updates.max_request_updates)
        result = await engine.apply_update(req)
    except RequestError as exc:
        return json_error(exc.status, str(exc))
    except UpdateError as exc:
        return json_error(400, f"update rejected, nothing applied: {exc}")
    except Overloaded as exc:
        return json_error(429, f"server overloaded: {exc}; retry later", headers=retry)
    except Draining as exc:
        return json_error(503, f"not accepting updates: {exc}", headers=retry)
    return web.json_response(result)


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[errors_as_json], client_max_size=engine.cfg.server.max_body_bytes)
    app[ENGINE_KEY] = engine
    app.on_response_prepare.append(_close_when_draining)
    r = app.router
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/models", list_models)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_post(prefix + "/infer", infer)
        r.add_post(prefix + "/graph", update_graph)
    r.add_get("/metrics", metrics)
    return app

