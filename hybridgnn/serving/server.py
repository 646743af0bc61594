"""The one assembly point: a server built from one ServeConfig. `hybridgnn serve`, tests
and bench build theirs here; the model repository's versions are engines it starts
(core.engine.open_engine).

    server = await start_server(cfg, stats)   # engine(s), v2 service, HTTP (and gRPC)
    ...                                       # serve
    await server.shutdown()                   # not ready, drain, close listeners, stop engines
"""

from __future__ import annotations

import asyncio
import logging

from hybridgnn.capabilities import usable_cores
from hybridgnn.config import ServeConfig
from hybridgnn.errors import CONNECTION_CAP, ConfigError
from hybridgnn.serving.core.admitting import started
from hybridgnn.serving.core.engine import Engine, open_engine
from hybridgnn.serving.core.partitioned import PartitionedEngine
from hybridgnn.serving.frontends import Frontends, frontends_for
from hybridgnn.serving.http.api import Api
from hybridgnn.serving.http.server import HttpServer
from hybridgnn.serving.partitions import RankGroup
from hybridgnn.serving.repository.loader import open_repository
from hybridgnn.serving.v2.service import V2Service
from hybridgnn.types import ServingStats
from hybridgnn.updates.log import logged_updates, parse_log_url

log = logging.getLogger("hybridgnn.serve")


class Server:
    """A started server: its engines (one, or a repository's versions), the v2 service over
    them and the transports carrying it. Everything it holds is stopped by shutdown()."""

    def __init__(self, cfg: ServeConfig, service: V2Service, http: HttpServer | None, grpc=None):
        self.cfg = cfg
        self.service = service
        self.http = http  # HTTP in this process, or
        self.frontends: Frontends | None = None  # ... in front-end processes (--frontends N > 1)
        self.grpc = grpc

    @property
    def engines(self) -> list[Engine]:
        """The engines serving now (a repository's change as versions load and unload)."""
        return self.service.models.engines()

    @property
    def engine(self) -> Engine:
        """The first engine: server-wide state (seed counts, limits)."""
        return self.engines[0]

    @property
    def port(self) -> int:
        return self.frontends.port if self.frontends is not None else self.http.port

    @property
    def grpc_port(self) -> int | None:
        if self.frontends is not None:
            return self.frontends.grpc_port
        return self.grpc.port if self.grpc is not None else None

    def describe(self) -> str:
        repository = self.service.repository
        return (", ".join(f"{n} v{v}" for n, v, _ in repository.models.items()) if repository is not None
                else repr(self.cfg.server.model_name))

    def begin_shutdown(self) -> None:
        """Report not-ready everywhere (still serving what arrives); no more model loads."""
        if self.service.repository is not None:
            self.service.repository.begin_shutdown()
        if self.frontends is not None:
            self.frontends.begin_shutdown()
        for e in self.engines:
            e.mark_unready()

    async def drain(self) -> bool:
        """Refuse new requests (503) and wait for the admitted ones; True if all finished
        within drain_timeout_s."""
        log.info("draining %d pending requests", sum(e.pending for e in self.engines))
        if self.frontends is not None:
            self.frontends.set_draining()
        return all(await asyncio.gather(*(e.drain(self.cfg.server.drain_timeout_s) for e in self.engines)))

    async def close(self) -> None:
        """Close the listeners (in-flight answers go out) and stop every engine. Graph
        updates stop first: an update still in hand past the drain is answered with what
        became of it, not with the listeners' "retry" (which could apply it twice)."""
        s = self.cfg.server
        for e in self.engines:
            await e.stop_updates()
        if self.http is not None:
            await self.http.close(s.shutdown_grace_s + 1)
        if self.frontends is not None:
            await self.frontends.stop(s.shutdown_grace_s + 1)
        if self.grpc is not None:
            await self.grpc.stop(s.shutdown_grace_s)
        await self._stop_engines()

    async def _stop_engines(self) -> None:
        if self.service.repository is not None:
            await self.service.repository.stop()
        for e in self.engines:
            await e.stop()

    async def shutdown(self) -> bool:
        """begin_shutdown, drain, a grace period answering 503, close. True if drained."""
        self.begin_shutdown()
        drained = await self.drain()
        await asyncio.sleep(self.cfg.server.shutdown_grace_s)
        await self.close()
        return drained


async def start_engines(cfg: ServeConfig, stats: ServingStats | None = None) -> V2Service:
    """The v2 service over what cfg serves: one engine, or every version a model repository
    chooses over one graph."""
    refuse_unfollowed_updates(cfg)
    from hybridgnn.graph.store import dataset_kind

    hetero = cfg.dataset_dir is not None and dataset_kind(cfg.dataset_dir) == "hetero"
    refuse_seed_log_of_the_other_kind(cfg, hetero)
    if hetero:
        from hybridgnn.serving.core.hetero import open_hetero_engine

        return V2Service(await open_hetero_engine(cfg, stats))
    if cfg.model_repository is not None:
        return V2Service(await open_repository(cfg, stats))
    if cfg.partitions.enabled:
        return V2Service(await open_partitioned(cfg, stats))
    return V2Service(await open_engine(cfg, stats))


async def open_partitioned(cfg: ServeConfig, stats: ServingStats | None = None) -> PartitionedEngine:
    """A started engine over partition ranks (started here, or reached with --ranks); one
    that fails to start stops its ranks before the error propagates."""
    return await started(await asyncio.to_thread(PartitionedEngine, cfg, RankGroup(cfg), stats))


async def start_server(cfg: ServeConfig, stats: ServingStats | None = None, *,
                       service: V2Service | None = None) -> Server:
    """Build and start the server cfg describes: engines, v2 service, HTTP on
    cfg.server.host:port (port 0: any free one; in this process, or in front-end processes
    as cfg.server.frontends says) and, with cfg.server.grpc_port, gRPC. service: one
    already started (its engines are then this server's). Raises OSError when a port
    cannot be listened on, ImportError when gRPC is asked for without grpcio,
    RuntimeError when a front-end process cannot start; whatever was started is stopped
    first."""
    service = service if service is not None else await start_engines(cfg, stats)
    server = Server(cfg, service, None)
    try:
        count = frontends_for(cfg.server.frontends, usable_cores(), cfg.server.max_connections)
        if cfg.server.grpc_port is not None and count == 1:  # first: HTTP answers ready once it listens
            from hybridgnn.serving.grpc.service import (
                GrpcFrontend,  # grpcio only when asked for
            )

            server.grpc = GrpcFrontend(service)
            await server.grpc.start(cfg.server.host, cfg.server.grpc_port)
        if count > 1:  # front-end processes serve HTTP and gRPC
            server.frontends = Frontends(Api(service), cfg, count)
            await server.frontends.start()
        else:
            server.http = http_server(service, cfg)
            await server.http.start(cfg.server.host, cfg.server.port)
    except BaseException:
        await asyncio.shield(server.close())
        raise
    return server


def refuse_seed_log_of_the_other_kind(cfg: ServeConfig, hetero: bool) -> None:
    """ConfigError (at start, before any engine is built) when --seed-log names the other
    kind of file: one counts array (.counts.npy) for a homogeneous dataset, one per node
    type (.counts.npz) for a heterogeneous one."""
    from hybridgnn.workload.tables import COUNTS_SUFFIX, TYPED_COUNTS_SUFFIX

    log_path = cfg.server.seed_log
    kind, want, holds = (("heterogeneous", TYPED_COUNTS_SUFFIX, "one counts array per node type") if hetero else
                         ("homogeneous", COUNTS_SUFFIX, "one counts array"))
    if log_path is not None and not str(log_path).endswith(want):
        raise ConfigError(f"--seed-log {log_path}: the seed log of a {kind} dataset is a {want} file ({holds})")


def refuse_unfollowed_updates(cfg: ServeConfig) -> None:
    """ConfigError when the dataset's update log holds acknowledged updates that this
    server, with updates off, would not apply: it would serve the graph as it was before
    them, unlike every replica that follows the log."""
    if cfg.graph_updates or cfg.dataset_dir is None or cfg.updates.log == "off":
        return
    logged = logged_updates(cfg.updates.log, cfg.dataset_dir)
    if logged:
        url = parse_log_url(cfg.updates.log, cfg.dataset_dir)
        held = f"the update log {url} holds acknowledged graph updates (up to position {logged})"
        if cfg.model_repository is not None:
            raise ConfigError(f"{held}, and a model repository's versions serve no graph updates: pass --update-log "
                              "off to serve the dataset as stored")
        raise ConfigError(f"{held}, which a server without the update token does not apply: set "
                          "HYBRIDGNN_UPDATE_TOKEN (or --update-token) to serve the updated graph, or pass "
                          "--update-log off to serve the dataset as stored")


def http_server(service: V2Service | Engine, cfg: ServeConfig) -> HttpServer:
    """The HTTP server carrying the v2 service, with the configured limits."""
    s, api = cfg.server, Api(service)
    stats = api.engine.stats
    stats.refused(CONNECTION_CAP, 0)  # its series from the first scrape
    return HttpServer(api, max_body_bytes=s.max_body_bytes, idle_timeout_s=s.idle_timeout_s,
                      request_timeout_s=s.request_timeout_s, max_connections=s.max_connections,
                      answers_per_turn=s.answers_per_turn, queue_bound_s=api.engine.queue_bound_s,
                      listeners=2 if s.grpc_port is not None else 1, access_log=s.access_log,
                      on_refused_connection=lambda: stats.refused(CONNECTION_CAP))
