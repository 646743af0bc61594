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
from hybridgnn.serving.core.engine import Engine
from hybridgnn.serving.server import start_engines, start_server
from hybridgnn.types import ServingStats

log = logging.getLogger("hybridgnn.serve")


class Terminated(KeyboardInterrupt):
    """SIGTERM while the server starts, before its own handler drains it: the start ends as a
    Ctrl-C's does (every child started is closed), and the command exits 143 (128 + SIGTERM)."""
    exit_code = 143


def _terminated(signum, frame) -> None:
    raise Terminated("SIGTERM while the server started")


async def serve(cfg: ServeConfig, *, stats: ServingStats | None = None, on_ready=None) -> int:
    service = await start_engines(cfg, stats)
    # The engines' heap (graph, model, torch) is most of what start-up leaves: frozen before
    # anything listens, its one long collection never stalls a request.
    freeze_startup_heap()
    # Every signal we handle is ours before anything listens: a client may see the server
    # ready (one front end up) while the others still start, and signal it then (SIGHUP's
    # default action would kill the server).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background: set[asyncio.Task] = set()
    engine = service.models.engines()[0]  # server-wide state (seed counts: one over every model) and the log line

    def refresh() -> None:  # SIGHUP: rebuild the GPU feature cache from the seeds seen so far
        task = loop.create_task(_refresh_placement(engine))
        background.add(task)
        task.add_done_callback(background.discard)

    loop.add_signal_handler(signal.SIGHUP, refresh)
    try:
        server = await start_server(cfg, service=service)
    except (ImportError, RuntimeError, OSError) as exc:
        await asyncio.gather(*background, return_exceptions=True)  # a refresh asked for meanwhile ends first
        if isinstance(exc, ImportError):
            log.error("--grpc-port needs grpcio and protobuf (pip install grpcio protobuf): %s", exc)
        elif isinstance(exc, OSError):  # port taken, address not local, no permission: one line
            log.error("cannot listen on %s (HTTP %d, gRPC %s): %s", cfg.server.host, cfg.server.port,
                      cfg.server.grpc_port, getattr(exc, "strerror", None) or exc)
        else:  # a front-end process that cannot start (its own log lines say why)
            log.error("%s", exc)
        return 2
    if server.grpc_port is not None:
        log.info("serving KServe v2 gRPC on %s:%d", cfg.server.host, server.grpc_port)
    freeze_startup_heap()  # what start_server added (short: the engines' heap is frozen already)
    saver = loop.create_task(_save_seed_log(engine, cfg)) if cfg.server.seed_log is not None else None
    workers, frontends = cfg.cpu_pipeline.workers, server.frontends
    log.info("serving %s on http://%s:%d (%d nodes, fanouts %s, %d CPU worker%s, %s)", server.describe(),
             cfg.server.host, server.port, engine.num_nodes, engine.metadata()["fanouts"], workers,
             "" if workers == 1 else "s", "HTTP in this process" if frontends is None else
             f"{frontends.count} front-end process" + ("" if frontends.count == 1 else "es"))
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    server.begin_shutdown()
    if cfg.server.unready_delay_s > 0:
        log.info("stop signal: not ready; serving %.1fs more before draining", cfg.server.unready_delay_s)
        await asyncio.sleep(cfg.server.unready_delay_s)
    drained = await server.drain()
    # Keep listening a moment: clients on keep-alive connections get a 503 with
    # "Connection: close" instead of a reset, and the balancer sees ready=503.
    await asyncio.sleep(cfg.server.shutdown_grace_s)
    if saver is not None:
        saver.cancel()
        await asyncio.gather(saver, return_exceptions=True)
        # off the loop: a large graph's log takes seconds, and front ends would take the
        # silence for a hung engine
        await asyncio.to_thread(engine.save_seed_log, cfg.server.seed_log)
    await asyncio.gather(*background, return_exceptions=True)
    await server.close()
    log.info("stopped (%s)", "drained" if drained else "drain timed out")
    return 0 if drained else 1


async def _refresh_placement(engine: Engine) -> None:
    try:
        await engine.refresh_placement()
    except LookupError as exc:
        log.warning("SIGHUP: placement not refreshed: %s", exc)
    except Exception:
        log.exception("SIGHUP: placement refresh failed; the current cache stays")


async def _save_seed_log(engine: Engine, cfg: ServeConfig) -> None:
    while True:
        await asyncio.sleep(cfg.server.seed_log_interval_s)
        try:
            await asyncio.to_thread(engine.save_seed_log, cfg.server.seed_log)
        except OSError as exc:
            log.warning("could not write the seed log %s: %s", cfg.server.seed_log, exc)


def run(cfg: ServeConfig, stats: ServingStats | None = None) -> int:
    """Serve until SIGTERM/SIGINT; `stats` receives what happens (telemetry's Telemetry
    exports it as Prometheus metrics)."""
    raise_open_file_limit()
    # Until serve() listens for it on the loop, a SIGTERM (a pod deleted while it starts)
    # killed the process outright: worker processes still starting were left running for
    # as long as their start took, and no line said why the server ended.
    signal.signal(signal.SIGTERM, _terminated)
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
