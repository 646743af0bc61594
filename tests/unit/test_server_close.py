"""Server.close stops graph updates before the listeners: an update still in hand past
the drain is answered with what became of it while a transport can carry that answer,
not with the listeners' blanket "retry"."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hybridgnn.serving.server import Server


class _Engine:
    def __init__(self, calls: list):
        self.calls = calls

    async def stop_updates(self):
        self.calls.append("updates")

    async def stop(self):
        self.calls.append("engine")


class _Http:
    def __init__(self, calls: list):
        self.calls = calls

    async def close(self, grace_s):
        self.calls.append("http")


def test_updates_stop_before_the_listeners_close_and_the_engines_stop():
    calls: list[str] = []
    engines = [_Engine(calls), _Engine(calls)]
    service = SimpleNamespace(repository=None, models=SimpleNamespace(engines=lambda: engines))
    cfg = SimpleNamespace(server=SimpleNamespace(shutdown_grace_s=0.0))
    asyncio.run(Server(cfg, service, _Http(calls)).close())
    assert calls == ["updates", "updates", "http", "engine", "engine"]
