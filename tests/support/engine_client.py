"""An Engine and its HTTP server in process on 127.0.0.1, with an aiohttp client (integration tests)."""

from __future__ import annotations

import aiohttp

from hybridgnn.serving.core.engine import Engine
from hybridgnn.serving.server import http_server
from hybridgnn.telemetry.metrics import Telemetry
from tests.support.payloads import body, counter  # noqa: F401 (re-exported for tests)


async def with_client(cfg, fn):
    """Start an Engine for cfg, serve it over HTTP on 127.0.0.1, run fn(engine, client),
    tear both down. client.get/post take paths."""
    engine = Engine(cfg, Telemetry(model=cfg.server.model_name))
    await engine.start()
    http = http_server(engine, cfg)
    await http.start("127.0.0.1", 0)
    client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{http.port}")
    try:
        return await fn(engine, client)
    finally:
        await client.close()
        await http.close(1.0)
        await engine.stop()
