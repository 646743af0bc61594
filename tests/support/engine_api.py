"""A real engine in this process (no sockets) behind the REST API object, for unit tests
that call endpoints directly."""

from __future__ import annotations

import asyncio

from hybridgnn.config import ServeConfig
from hybridgnn.serving.core.engine import Engine
from hybridgnn.serving.http.api import Api
from hybridgnn.telemetry.metrics import Telemetry


def run_api(cfg: ServeConfig, scenario):
    """Start an engine for cfg, await scenario(Api(engine), engine), stop the engine, and
    return what the scenario returned."""

    async def main():
        engine = Engine(cfg, Telemetry(model=cfg.server.model_name))
        await engine.start()
        try:
            return await scenario(Api(engine), engine)
        finally:
            await engine.stop()

    return asyncio.run(main())
