"""`hybridgnn bench`: open-loop (Poisson) load against a running server."""

from __future__ import annotations

from hybridgnn.cli.flags import DefaultsHelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="open-loop load generator against a server URL",
                       description="Sends requests at Poisson arrival times and reports achieved throughput and "
                                   "latency percentiles measured from the scheduled arrival (no coordinated "
                                   "omission). With --slo-ms, searches for the highest rate within that p99.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server (or balancer) to load")
    p.add_argument("--model", default="hybridgnn", help="model name in the request path")
    p.add_argument("--rate", type=float, default=200.0, help="offered requests per second")
    p.add_argument("--duration-s", type=float, default=10.0, help="seconds of load")
    p.add_argument("--nodes-per-request", type=int, default=1, help="node ids per request")
    p.add_argument("--node-type", default=None,
                   help="a heterogeneous model: the node type of the ids sent (parameters.node_type)")
    p.add_argument("--json-body", action="store_true", help="send JSON instead of the binary tensor extension")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http",
                   help="grpc: KServe v2 over gRPC to --grpc-target (the model's size still comes from --url)")
    p.add_argument("--grpc-target", default="127.0.0.1:8001", help="host:port of the server's --grpc-port")
    p.add_argument("--slo-ms", type=float, default=None, help="find the highest rate with p99 within this")
    p.add_argument("--seed", type=int, default=0, help="random seed of the arrival times and the node ids sent")
    p.set_defaults(run=run)


# Requests one run may schedule (its arrival times and ids are arrays of this length)
MAX_REQUESTS = 10**8


def check_flags(args) -> None:
    """Flags that cannot work, refused in one line before any request is sent: --slo-ms nan
    or 0 searched for minutes and found nothing (nan was printed as the SLO, invalid JSON),
    --rate nan said "cannot convert float NaN to integer" and --rate inf was a traceback."""
    import math
    from urllib.parse import urlsplit

    from hybridgnn.errors import ConfigError

    # '127.0.0.1:8000' was "NonHttpUrlClientError: 127.0.0.1:8000/v2/..."; the REST load is
    # plain HTTP (https:// was sent in clear to port 80); under grpc --url only gives the metadata
    url = urlsplit(args.url)
    if url.scheme not in (("http", "https") if args.protocol == "grpc" else ("http",)) or not url.hostname:
        raise ConfigError(f"--url must be a plain http:// URL such as http://127.0.0.1:8000, got {args.url!r}")
    for flag, value in (("--rate", args.rate), ("--duration-s", args.duration_s), ("--slo-ms", args.slo_ms)):
        if value is not None and not 0 < value < math.inf:
            raise ConfigError(f"{flag} must be a positive, finite number, got {value}")
    if args.rate * args.duration_s > MAX_REQUESTS:
        raise ConfigError(f"--rate x --duration-s schedules more than {MAX_REQUESTS:,} requests "
                          f"({args.rate} x {args.duration_s})")
    if args.nodes_per_request < 1:
        raise ConfigError(f"--nodes-per-request must be at least 1, got {args.nodes_per_request}")


def run(args) -> int:
    import asyncio

    import aiohttp

    from hybridgnn.errors import ConfigError

    check_flags(args)
    try:
        return _run(args)
    except BrokenPipeError:  # the report's reader closed stdout (`| head`): main ends quietly, 141
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        # a server that is down or a model it does not serve: one line, exit 2
        raise ConfigError(f"cannot load {args.url} model {args.model!r}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split()) or 'no answer'}") from exc


def _run(args) -> int:
    """The report (JSON) on stdout; the search's progress, one line per trial, on stderr.
    SIGINT (Ctrl-C) or SIGTERM ends the load early: the report then covers what was
    measured until then and says so (interrupted), a line on stderr says it too, and the
    command exits 128 + the signal's number (130, 143)."""
    import functools
    import sys

    from hybridgnn.bench.loadgen import run_load
    from hybridgnn.bench.report import strict_json
    from hybridgnn.bench.search import find_max_rate
    from hybridgnn.bench.stopping import exit_code, stop_signals
    from hybridgnn.capabilities import raise_open_file_limit, run_async

    raise_open_file_limit()
    grpc = args.grpc_target if args.protocol == "grpc" else None

    async def measure() -> dict:
        async with stop_signals() as stop:
            if args.slo_ms is not None:
                rate, res = await find_max_rate(
                    args.url, args.model, slo_ms=args.slo_ms, duration_s=args.duration_s,
                    nodes_per_request=args.nodes_per_request, start_rate=args.rate, binary=not args.json_body,
                    grpc_target=grpc, node_type=args.node_type, seed=args.seed,
                    log=functools.partial(print, file=sys.stderr), stop=stop)
                return search_report(rate, res, args.slo_ms, stop.result() if stop.done() else None)
            res = await run_load(args.url, args.model, rate=args.rate, duration_s=args.duration_s,
                                 nodes_per_request=args.nodes_per_request, binary=not args.json_body,
                                 seed=args.seed, grpc_target=grpc, node_type=args.node_type, stop=stop)
            return res.to_dict()

    report = run_async(measure())
    print(strict_json(report))
    if report["interrupted"]:
        sys.stdout.flush()  # the report first, then the line that says it is partial
        print(interrupted_line(report), file=sys.stderr)
    return exit_code(report["interrupted"])


def search_report(rate: float, res, slo_ms: float, interrupted: str | None) -> dict:
    """`bench --slo-ms`'s report: the highest rate that held and its trial's result;
    interrupted: the signal that ended the search early (the rate is then the highest
    that held before it), else None."""
    return {"max_rate_within_slo": rate, "slo_ms": slo_ms, "result": res.to_dict() if res else None,
            "interrupted": interrupted}


def interrupted_line(report: dict) -> str:
    """The stderr line of a report a signal cut short (a run's or a search's)."""
    said = "terminated" if report["interrupted"] == "SIGTERM" else "interrupted"
    if "max_rate_within_slo" in report:
        return (f"hybridgnn bench: {said} ({report['interrupted']}): the search ended early; "
                f"max_rate_within_slo is the highest rate that held before it")
    return (f"hybridgnn bench: {said} ({report['interrupted']}) after {report['duration_s']:.1f} s: a partial "
            f"report of the {report['sent']} requests sent ({report['unanswered']} still unanswered)")
