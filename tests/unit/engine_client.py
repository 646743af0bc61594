"""An Engine and its HTTP server in process on 127.0.0.1, with an aiohttp client (for unit tests)."""

from __future__ import annotations

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from hybridgnn.serving.api import Api
from hybridgnn.serving.app import build_app
from hybridgnn.serving.engine import Engine
from hybridgnn.serving.http import HttpServer


def body(ids) -> dict:
    return {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)}]}


async def with_client(cfg, fn, http_server: str | None = None):
    """Start an Engine for cfg, serve it (cfg's HTTP server unless http_server names one),
    run fn(engine, client), tear both down. client.get/post take paths."""
    engine = Engine(cfg)
    await engine.start()
    api = Api(engine)
    kind = http_server or cfg.server.http_server
    if kind == "aiohttp":
        client = TestClient(TestServer(build_app(api)))
        await client.start_server()
        close_server = None
    else:
        http = HttpServer(api, max_body_bytes=cfg.server.max_body_bytes, idle_timeout_s=cfg.server.idle_timeout_s)
        await http.start("127.0.0.1", 0)
        client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{http.port}")
        close_server = http.close
    try:
        return await fn(engine, client)
    finally:
        await client.close()
        if close_server is not None:
            await close_server(1.0)
        await engine.stop()


def counter(metrics: str, name: str, **labels) -> float:
    """The value of one sample in a /metrics text."""
    want = ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}") if labels else ""
    for line in metrics.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{want} not in metrics")
