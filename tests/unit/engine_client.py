"""An Engine and its app in process, behind aiohttp's test client (for unit tests)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from hybridgnn.serving.app import build_app
from hybridgnn.serving.engine import Engine


def body(ids) -> dict:
    return {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)}]}


async def with_client(cfg, fn):
    """Start an Engine for cfg, serve it, run fn(engine, client), tear both down."""
    engine = Engine(cfg)
    await engine.start()
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    try:
        return await fn(engine, client)
    finally:
        await client.close()
        await engine.stop()


def counter(metrics: str, name: str, **labels) -> float:
    """The value of one sample in a /metrics text."""
    want = ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}") if labels else ""
    for line in metrics.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{want} not in metrics")
