"""Process lifecycle: start the engine and HTTP server, drain on SIGTERM/SIGINT, exit 0.

SIGHUP rebuilds the GPU feature cache from the seeds requested so far (no request is
dropped). On a stop signal the server first reports ready=503 (and, for unready_delay_s, still
serves, so balancers polling readiness move away before anything is refused); then it
keeps listening while admitted requests finish; new requests get 503 with Retry-After and every response
carries "Connection: close". Once drained (or after drain_timeout_s) and a short grace
(shutdown_grace_s), the listener closes and the workers end.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from hybridgnn.capabilities import (
    freeze_startup_heap,
    keep_off_cores,
    raise_open_file_limit,
    run_async,
)
from hybridgnn.config import ServeConfig
from hybridgnn.serving.engine import Engine
from hybridgnn.serving.http.api import Api
from hybridgnn.serving.http.protocol import HttpServer
from hybridgnn.serving.repository import Models, Repository, open_repository
from hybridgnn.types import ServingStats

log = logging.getLogger("hybridgnn.serve")


async def serve(cfg: ServeConfig, *, stats: ServingStats | None = None, on_ready=None) -> int:
    repository = None
    if cfg.model_repository is not None:  # every version the repository chooses, over one graph
        repository = await open_repository(cfg, stats)
        target = repository
    else:
        target = Engine(cfg, stats)
        await target.start()

    def engines() -> list[Engine]:  # a repository's change as versions load and unload
        return repository.models.engines() if repository is not None else [target]

    engine = engines()[0]  # server-wide state (seed counts) and the log line

    async def stop_engines() -> None:
        if repository is not None:
            await repository.stop()
        for e in engines():
            await e.stop()

    try:
        close_http = await _start_http(target, cfg)
    except OSError as exc:  # port taken, address not local, no permission: say so, no traceback
        log.error("cannot listen on %s:%d: %s", cfg.server.host, cfg.server.port, exc.strerror or exc)
        await stop_engines()
        return 2
    grpc_frontend = None
    if cfg.server.grpc_port is not None:
        try:
            grpc_frontend = await _start_grpc(target, cfg)
        except ImportError as exc:
            log.error("--grpc-port needs grpcio and protobuf (pip install grpcio protobuf): %s", exc)
            await close_http()
            await stop_engines()
            return 2
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen for gRPC on %s:%d: %s", cfg.server.host, cfg.server.grpc_port, exc)
            await close_http()
            await stop_engines()
            return 2
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background: set[asyncio.Task] = set()

    def refresh() -> None:  # SIGHUP: rebuild the GPU feature cache from the seeds seen so far
        task = loop.create_task(_refresh_placement(engine))
        background.add(task)
        task.add_done_callback(background.discard)

    loop.add_signal_handler(signal.SIGHUP, refresh)
    saver = loop.create_task(_save_seed_log(engine, cfg)) if cfg.server.seed_log is not None else None
    addr = f"http://{cfg.server.host}:{cfg.server.port}"
    served = (", ".join(f"{n} v{v}" for n, v, _ in repository.models.items()) if repository is not None
              else repr(cfg.server.model_name))
    log.info("serving %s on %s (%d nodes, fanouts %s, %d CPU workers)", served, addr,
             engine.graph.num_nodes, list(engine.cfg.sampling.fanouts), cfg.cpu_pipeline.workers)
    if on_ready is not None:
        on_ready(engine)
    await stop.wait()
    if repository is not None:
        repository.begin_shutdown()  # no more loads; answers say Connection: close
    for e in engines():
        e.mark_unready()
    if cfg.server.unready_delay_s > 0:
        log.info("stop signal: not ready; serving %.1fs more before draining", cfg.server.unready_delay_s)
        await asyncio.sleep(cfg.server.unready_delay_s)
    log.info("draining %d pending requests", sum(e.pending for e in engines()))
    drained = all(await asyncio.gather(*(e.drain(cfg.server.drain_timeout_s) for e in engines())))
    # Keep listening a moment: clients on keep-alive connections get a 503 with
    # "Connection: close" instead of a reset, and the balancer sees ready=503.
    await asyncio.sleep(cfg.server.shutdown_grace_s)
    await close_http()
    if grpc_frontend is not None:
        await grpc_frontend.stop(cfg.server.shutdown_grace_s)
    if saver is not None:
        saver.cancel()
        await asyncio.gather(saver, return_exceptions=True)
        engine.placement.save_seed_log(cfg.server.seed_log)
    for task in list(background):
        await asyncio.gather(task, return_exceptions=True)
    await stop_engines()
    log.info("stopped (%s)", "drained" if drained else "drain timed out")
    return 0 if drained else 1


def http_server(engine: Engine | Models | Repository, cfg: ServeConfig) -> HttpServer:
    """The HTTP server carrying the API of an engine (or a repository's engines), with
    the configured limits."""
    s = cfg.server
    api = Api(engine)
    return HttpServer(api, max_body_bytes=s.max_body_bytes, idle_timeout_s=s.idle_timeout_s,
                      request_timeout_s=s.request_timeout_s, max_connections=s.max_connections,
                      retry_after_s=s.retry_after_s, answers_per_turn=s.answers_per_turn,
                      queue_bound_s=api.engine.admission.bound_s)


async def _start_http(engine: Engine | Models | Repository, cfg: ServeConfig):
    """Start the HTTP server on the engine; returns the coroutine function that closes it
    (in-flight answers go out, idle keep-alive connections do not hold the process)."""
    http = http_server(engine, cfg)
    await http.start(cfg.server.host, cfg.server.port)
    return lambda: http.close(cfg.server.shutdown_grace_s + 1)


async def _start_grpc(engine: Engine | Models | Repository, cfg: ServeConfig):
    """The KServe v2 gRPC service on the same engine and event loop (grpcio imported only
    when asked for)."""
    from hybridgnn.serving.grpc.service import GrpcFrontend

    frontend = GrpcFrontend(Api(engine))
    port = await frontend.start(cfg.server.host, cfg.server.grpc_port)
    log.info("serving KServe v2 gRPC on %s:%d", cfg.server.host, port)
    return frontend


async def _refresh_placement(engine: Engine) -> None:
    try:
        await engine.placement.refresh()
    except LookupError as exc:
        log.warning("SIGHUP: placement not refreshed: %s", exc)
    except Exception:
        log.exception("SIGHUP: placement refresh failed; the current cache stays")


async def _save_seed_log(engine: Engine, cfg: ServeConfig) -> None:
    while True:
        await asyncio.sleep(cfg.server.seed_log_interval_s)
        try:
            await asyncio.to_thread(engine.placement.save_seed_log, cfg.server.seed_log)
        except OSError as exc:
            log.warning("could not write the seed log %s: %s", cfg.server.seed_log, exc)


def run(cfg: ServeConfig, stats: ServingStats | None = None) -> int:
    """Serve until SIGTERM/SIGINT; `stats` receives what happens (telemetry's Telemetry
    exports it as Prometheus metrics)."""
    raise_open_file_limit()
    workers_on = cfg.cpu_pipeline.cpus
    if workers_on:
        kept = keep_off_cores(workers_on)
        if kept is None:
            log.warning("--worker-cpus %s leaves no other core for the event loop: it shares them with the workers",
                        ",".join(map(str, workers_on)))
        else:
            log.info("event loop and server threads on cores %s; CPU worker processes on %s", sorted(kept),
                     list(workers_on))
    return run_async(serve(cfg, stats=stats))
