"""An update log, follower and applier over an in-memory graph, for tests and benchmarks
that exercise graph updates without a server."""

from __future__ import annotations

import asyncio

from hybridgnn.config import UpdateConfig
from hybridgnn.serving.core.updates import UpdateApplier
from hybridgnn.types import ServingStats
from hybridgnn.updates.follower import Follower
from hybridgnn.updates.log import MemoryLog, UpdateLog

TOKEN = "12345678"


def follower_for(dyn, inc, update_log: UpdateLog | None = None, *, cfg: UpdateConfig | None = None,
                 stats: ServingStats | None = None, **kw) -> Follower:
    """A follower of `update_log` (default: a new in-memory log) applying to dyn / inc."""
    return Follower(update_log if update_log is not None else MemoryLog(), dyn, inc, stats or ServingStats(),
                    cfg or UpdateConfig(token=TOKEN), **kw)


async def submit_all(follower: Follower, updates, *, together: bool = False, cfg: UpdateConfig | None = None,
                     ) -> list:
    """Send decoded updates through an applier and this follower; each result is the
    answer or the exception. together: all queued before the applier runs (one merged
    entry when they fit), else one at a time (one entry each)."""
    applier = UpdateApplier(cfg or follower.cfg, follower, follower.graph, follower.stats)
    follower.start()
    try:
        if together:
            futs = [applier.submit(u) for u in updates]
            applier.start()
            return list(await asyncio.gather(*futs, return_exceptions=True))
        applier.start()
        out = []
        for u in updates:
            out.append((await asyncio.gather(applier.submit(u), return_exceptions=True))[0])
        return out
    finally:
        await applier.stop()
        await follower.stop()


def run_updates(follower: Follower, updates, **kw) -> list:
    return asyncio.run(submit_all(follower, updates, **kw))
