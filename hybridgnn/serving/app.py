"""aiohttp front end (`--http-server aiohttp`): the API of serving/api.py on aiohttp's
HTTP server. One catch-all route hands method and path to `Api.route`, so both front
ends answer every endpoint and every error the same way."""

from __future__ import annotations

import inspect
import logging

from aiohttp import web

from hybridgnn.serving.api import Api, Reply, Request

log = logging.getLogger(__name__)
API_KEY = web.AppKey("api", Api)


def _response(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, content_type=None,
                        headers={"Content-Type": reply.content_type, **(reply.headers or {})})


async def handle(request: web.Request) -> web.StreamResponse:
    api = request.app[API_KEY]
    found = api.route(request.method, request.rel_url.raw_path)
    if isinstance(found, Reply):
        return _response(found)
    endpoint, params = found
    try:
        body = await request.read() if request.method == "POST" else b""
    except web.HTTPRequestEntityTooLarge:
        return _response(api.body_too_large())
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        reply = endpoint(Request(params, headers, body))
        if inspect.isawaitable(reply):
            reply = await reply
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        reply = Reply.error(500, "internal server error")
    return _response(reply)


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    if request.app[API_KEY].engine.draining:
        response.force_close()  # sends "Connection: close": the next request opens a new connection


def build_app(api: Api) -> web.Application:
    app = web.Application(client_max_size=api.engine.cfg.server.max_body_bytes)
    app[API_KEY] = api
    app.on_response_prepare.append(_close_when_draining)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app
