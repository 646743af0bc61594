"""The Python part of a refused request, current code against a baseline revision in the
same run: how much event-loop time the server spends in Python to parse, route, refuse and
encode an inference it refuses, without the socket (read and write syscalls, which add
about as much again; see docs/performance.md#what-a-refusal-costs).

Why it matters: under overload most requests are refused, and on one event loop the
cost of a refusal against that of an answer sets the goodput left at a multiple of
capacity (refusing three quarters of 4x capacity takes 3 x (refusal / answer) of the loop).

Each revision runs in its own process (the baseline from a git worktree, as
bench/common.py's serve_revision does): an engine over the demo graph and model, started,
and 64 of the HTTP server's connection objects with a transport that drops what is
written. Each connection is fed the same one-seed KServe inference request, round-robin:
- standing_queue: the front end's queue stands and the request waited past its target
  (the refusal under sustained overload);
- queue_delay: admission refuses it (Admission.check; with the bound at 1 ns, the wait
  in the front end alone passes it);
- not_found: a request for an unknown path (the parse, route and 404 alone).
--rounds alternates current and baseline; the figure is the median per kind.

    .venv/bin/python bench/refusal_cost.py [--requests 20000] [--rounds 3] [--baseline-rev 4221218]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    machine,
    model_for_revision,
    progress,
    revision_env,
    strict_json,
)
from hybridgnn.demo import ensure_demo  # noqa: E402

KINDS = ("standing_queue", "queue_delay", "not_found")

PROBE = r'''
import asyncio, json, sys, time
from pathlib import Path
from hybridgnn.config import AdmissionConfig, ServeConfig
try:  # the serving layout by role
    from hybridgnn.serving.core.engine import Engine
    from hybridgnn.serving.http.api import Api
    from hybridgnn.serving.http.protocol import Connection
    from hybridgnn.serving.http.server import HttpServer
except ImportError:  # revisions before it
    from hybridgnn.serving.engine import Engine
    from hybridgnn.serving.http.api import Api
    from hybridgnn.serving.http.protocol import HttpServer, _Connection as Connection
from hybridgnn.telemetry.metrics import Telemetry

dataset, model, requests = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


class DroppingTransport:
    def write(self, data): pass
    def pause_reading(self): pass
    def resume_reading(self): pass
    def can_write_eof(self): return True
    def write_eof(self): pass
    def close(self): pass
    def get_extra_info(self, *args): return None


body = b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":[7]}]}'
infer = (b"POST /v2/models/hybridgnn/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n" % len(body)) + body
missing = infer.replace(b"/v2/models/hybridgnn/infer", b"/v2/no/such/path")


async def main():
    # A bound of 1 ns, which any wait passes: at 1 µs a request parsed and routed within the
    # microsecond was admitted (an empty lane takes one), and its connection, never answered
    # while this loop does not yield, held back every later request sent on it.
    cfg = ServeConfig(dataset_dir=dataset, model_dir=model, admission=AdmissionConfig(max_queue_delay_s=1e-9))
    engine = Engine(cfg, Telemetry(model=cfg.server.model_name))
    await engine.start()
    server = HttpServer(Api(engine), max_body_bytes=1 << 20, queue_bound_s=1e-9)
    conns = [Connection(server) for _ in range(64)]
    for conn in conns:
        conn.connection_made(DroppingTransport())
    out = {}
    for kind, wire, standing in (("standing_queue", infer, True), ("queue_delay", infer, False),
                                 ("not_found", missing, False)):
        server.turns.standing = standing
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(requests):
                conns[i & 63].data_received(wire)
                server.turns.used = 0  # one turn per request: no connection waits for a later one
            best = min(best, (time.perf_counter() - t0) / requests)
        out[kind] = round(best * 1e6, 2)
    refused = engine.metadata()["admission"]
    out["refused_standing_queue"], out["refused_by_delay"] = refused["refused_standing_queue"], refused["refused_by_delay"]
    await engine.stop()
    print(json.dumps(out), flush=True)  # the probe runs baseline revisions too: no bench imports


asyncio.run(main())
'''


def measure(rev: str | None, dataset: Path, model: Path, requests: int) -> dict:
    cwd, env = revision_env(rev)
    done = subprocess.run([sys.executable, "-c", PROBE, str(dataset), str(model_for_revision(rev, model)),
                           str(requests)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed for {rev or 'the working tree'}:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # every standing_queue and queue_delay request must have been refused, or the figure is not a refusal's
    wanted = 3 * requests
    if out["refused_standing_queue"] < wanted or out["refused_by_delay"] < 2 * wanted:
        raise RuntimeError(f"not every request was refused: {out}")
    out["server"] = "current" if rev is None else f"baseline {rev}"
    progress(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000, help="requests per kind and timing (best of 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating current/baseline pairs")
    ap.add_argument("--baseline-rev", default="4221218", help="git revision of the baseline")
    args = ap.parse_args()
    dataset, model = ensure_demo()
    runs = {"current": [], "baseline": []}
    for _ in range(args.rounds):
        runs["current"].append(measure(None, dataset, model, args.requests))
        runs["baseline"].append(measure(args.baseline_rev, dataset, model, args.requests))
    median = {side: {k: statistics.median(r[k] for r in rs) for k in KINDS} for side, rs in runs.items()}
    print(strict_json({
        "machine": machine(), "baseline_rev": args.baseline_rev, "requests": args.requests, "runs": runs,
        "us_per_request": median,
        "baseline_over_current": {k: round(median["baseline"][k] / median["current"][k], 2) for k in KINDS},
    }))


if __name__ == "__main__":
    main()
