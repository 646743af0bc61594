"""A server built in process on 127.0.0.1 by the one assembly point (serving/server.py),
with an aiohttp client (integration tests)."""

from __future__ import annotations

import dataclasses

import aiohttp

from hybridgnn.serving.server import start_server
from hybridgnn.telemetry.metrics import Telemetry
from tests.support.payloads import body, counter  # noqa: F401 (re-exported for tests)


async def with_client(cfg, fn):
    """Start a server for cfg on 127.0.0.1 (any free port), run fn(engine, client), tear
    both down. client.get/post take paths."""
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, host="127.0.0.1", port=0, grpc_port=None))
    server = await start_server(cfg, Telemetry(model=cfg.server.model_name))
    client = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{server.port}")
    try:
        return await fn(server.engine, client)
    finally:
        await client.close()
        await server.close()
