"""Durable graph updates: what the log costs and whether it holds, same run.

1. Log cost (in process): the same stream of update batches (45 % edge insertions, 45 %
   deletions, 10 % feature rewrites) applied to the ogbn-arxiv-scale power-law graph
   with a 2-layer SAGE (mean) the way a served update is: appended as a log entry,
   then applied by the follower; with the SQLite log (WAL, synchronous=FULL: on disk
   before the append returns), with the in-memory log, and applied directly to the
   embeddings (no request, no log); batch 1,000 and 100; the order alternates over
   --rounds. Prints updates/s of each and the ratio durable / in-memory (the target:
   at most 10 % slower at batch 1,000).
2. Kill -9 (real processes): `hybridgnn serve --update-token` on a copy of the demo
   dataset, a client posting add-node updates one after another; at --kills random
   points (after 1..40 acknowledged updates) the server is killed with SIGKILL and
   restarted on the same log (snapshots every --snapshot-every entries, so a restart
   loads one and replays the rest; --retain N trims the log as it goes); after each restart
   every acknowledged update must be
   there and none half applied (tests/support/durability.py). Prints acknowledged
   updates, lost ones, half-applied ones, and the restart time against the log length.

    .venv/bin/python bench/durability.py                     # both parts, ~5 min on 2 cores
    .venv/bin/python bench/durability.py --parts kill --kills 10
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, ensure_graph, machine  # noqa: E402
from bench.incremental import ARXIV, ARXIV_ARGS, build_model, update_stream  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.embeddings.incremental import IncrementalEmbeddings  # noqa: E402
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute  # noqa: E402
from hybridgnn.graph.dynamic import (
    DynamicGraph,  # noqa: E402
    UpdateBatch,  # noqa: E402
)
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.updates.log import MemoryLog, SqliteLog  # noqa: E402
from hybridgnn.updates.requests import LoggedRequest, encode_entry  # noqa: E402
from tests.support.durability import UpdateStream, check_after_restart, graph_state  # noqa: E402
from tests.support.server import ServerProcess, await_ready  # noqa: E402
from tests.support.updates import follower_for  # noqa: E402

TOKEN = "durability-bench-token"


def _as_request(batch: UpdateBatch) -> LoggedRequest:
    inputs = {"add_edges": batch.add_edges, "remove_edges": batch.remove_edges, "update_ids": batch.update_ids}
    if batch.update_features is not None:
        inputs["update_features"] = batch.update_features
    return LoggedRequest(inputs)


RIPPLE_PLUS_PLUS = {"updates_per_s": 56_000, "cores": 12, "graph": "ogbn-arxiv (169k nodes, 1.17M edges)",
                    "machine": "12-core workstation, as published"}


def log_cost(args) -> dict:
    ensure_graph(ARXIV, ARXIV_ARGS)
    graph = GraphStore.open(ARXIV)
    torch.set_num_threads(args.threads)  # numba kernels and the rest run on one thread anyway
    tmp = Path(tempfile.mkdtemp(prefix="hgnn-durable-"))
    plan = [(1000, args.batches_1000), (100, args.batches_100)]
    out: dict = {"graph": {"nodes": graph.num_nodes, "edges": graph.num_edges, "feature_dim": graph.feature_dim},
                 "threads": args.threads, "ripple_plus_plus": RIPPLE_PLUS_PLUS, "aggs": {}}
    modes = ("direct", "memory", "durable")
    try:
        for agg in args.aggs.split(","):
            model = build_model(agg, graph.feature_dim)
            layers = [np.asarray(a) for a in precompute(graph, model, tmp / f"pe-{agg}", PrecomputeConfig(),
                                                        progress=False).layers]
            rounds = []
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    dyn = DynamicGraph(graph)
                    inc = IncrementalEmbeddings(dyn, model, [a.copy() for a in layers])
                    log = SqliteLog(tmp / f"log-{agg}-{r}.sqlite", graph.fingerprint) if mode == "durable" \
                        else MemoryLog()
                    follower = follower_for(dyn, inc, log)
                    rng = np.random.default_rng(1 + r)
                    row = {"round": r, "mode": mode}
                    inc.apply(update_stream(dyn, 100, rng))  # compile the kernels outside the timing
                    for size, count in plan:
                        seconds = 0.0
                        for _ in range(count):
                            batch = update_stream(dyn, size, rng)
                            t = time.perf_counter()
                            if mode == "direct":  # the embeddings' own apply: no request, no log
                                inc.apply(batch)
                            else:  # what a served update does: log the entry, the follower applies it
                                log.append(encode_entry([_as_request(batch)]))
                                [(_, [outcome])] = follower.step(limit=1, block_s=0)
                                assert isinstance(outcome, dict), outcome
                            seconds += time.perf_counter() - t
                        row[f"updates_per_s_{size}"] = size * count / seconds
                    log.close()
                    rounds.append(row)
                    print(f"  {agg} round {r} {mode:7}: " + ", ".join(
                        f"batch {s}: {row[f'updates_per_s_{s}']:,.0f} upd/s" for s, _ in plan), flush=True)
            res: dict = {"rounds": rounds}
            for size, _ in plan:
                med = {m: float(np.median([x[f"updates_per_s_{size}"] for x in rounds if x["mode"] == m]))
                       for m in modes}
                res[f"batch_{size}"] = {**{f"{m}_updates_per_s": v for m, v in med.items()},
                                        "durable_over_memory": round(med["durable"] / med["memory"], 3),
                                        "memory_over_direct": round(med["memory"] / med["direct"], 3),
                                        "durable_per_core": round(med["durable"] / args.threads)}
            out["aggs"][agg] = res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def kill_points(args) -> dict:
    dataset, model = ensure_demo()
    tmp = Path(tempfile.mkdtemp(prefix="hgnn-kill-"))
    copy = tmp / "dataset"
    shutil.copytree(dataset, copy)
    flags = ("--workers", "1", "--update-token", TOKEN, "--snapshot-every", str(args.snapshot_every),
             "--update-log-retain", str(args.retain))
    rng = random.Random(args.seed)
    acked: list[int] = []
    restarts, problems = [], []
    srv = ServerProcess(copy, model, *flags).wait_ready(300)
    base = graph_state(srv.url)
    try:
        for kill in range(args.kills):
            stream = UpdateStream(srv.url, TOKEN, base["num_nodes"], base["feature_dim"], seed=kill)
            stream.start()
            want = len(acked) + rng.randrange(1, 41)
            while len(acked) + len(stream.acked) < want and stream.is_alive():
                stream.join(0.002)
            stream.killed.set()  # what it is answered from here on is the kill's
            srv.proc.kill()
            srv.proc.wait(30)
            stream.join(30)
            acked += stream.acked
            t0 = time.perf_counter()
            srv = ServerProcess(copy, model, *flags, port=srv.port)
            await_ready(srv, "restarted server", 300)
            ready_s = time.perf_counter() - t0
            state = graph_state(srv.url)
            found = check_after_restart(srv.url, base, acked)
            problems += [f"kill {kill}: {p}" for p in found]
            restarts.append({"kill": kill, "acked_total": len(acked), "log_batches": state["graph_version"],
                             "ready_s": round(ready_s, 2), "refused": len(stream.refused)})
            print(f"  kill {kill + 1}/{args.kills}: {len(acked)} acknowledged, {state['graph_version']} batches "
                  f"in the log, restart to ready {ready_s:.2f}s, problems {len(found)}", flush=True)
    finally:
        srv.stop()
        log = (SqliteLog(copy / "updates.sqlite", GraphStore.open(copy).fingerprint)
               if (copy / "updates.sqlite").is_file() else None)
        held = (log.first(), log.head()) if log is not None else (0, 0)
        if log is not None:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  the log holds positions {held[0]}..{held[1]} at the end", flush=True)
    return {"kills": args.kills, "acknowledged": len(acked), "problems": problems, "restarts": restarts,
            "log_positions_held": list(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="cost,kill", help="cost, kill (comma-separated)")
    ap.add_argument("--rounds", type=int, default=2, help="log cost: alternating memory/durable pairs")
    ap.add_argument("--batches-1000", type=int, default=6)
    ap.add_argument("--aggs", default="mean,sum,gin", help="cost: aggregations (bench/incremental.py's models)")
    ap.add_argument("--threads", type=int, default=1, help="cost: torch threads (1: the per-core figure)")
    ap.add_argument("--batches-100", type=int, default=20)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--snapshot-every", type=int, default=250, help="kill part: the server's --snapshot-every")
    ap.add_argument("--retain", type=int, default=0,
                    help="kill part: the server's --update-log-retain (0: the log keeps every entry)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"machine": machine()}
    print(report["machine"], flush=True)
    parts = args.parts.split(",")
    if "cost" in parts:
        print(f"log cost (arxiv-scale graph, {args.threads} thread(s)):", flush=True)
        report["cost"] = cost = log_cost(args)
        rpp = RIPPLE_PLUS_PLUS["updates_per_s"] / RIPPLE_PLUS_PLUS["cores"]
        g = cost["graph"]
        print(f"graph here: {g['nodes']:,} nodes, {g['edges']:,} edges, {g['feature_dim']} features; RIPPLE++: "
              f"{RIPPLE_PLUS_PLUS['graph']}, {RIPPLE_PLUS_PLUS['updates_per_s']:,} upd/s on "
              f"{RIPPLE_PLUS_PLUS['cores']} cores = {rpp:,.0f} per core")
        for agg, res in cost["aggs"].items():
            for size in (1000, 100):
                c = res[f"batch_{size}"]
                print(f"{agg} batch {size}: durable {c['durable_updates_per_s']:,.0f} upd/s "
                      f"({c['durable_per_core']:,} per core), in memory {c['memory_updates_per_s']:,.0f}, apply alone "
                      f"{c['direct_updates_per_s']:,.0f}: durable/memory {c['durable_over_memory']}, memory/apply "
                      f"alone {c['memory_over_direct']}" + (f"; per core vs RIPPLE++ {c['durable_per_core'] / rpp:.2f}"
                                                            if size == 1000 else ""))
    if "kill" in parts:
        print(f"kill -9 at {args.kills} random points (demo dataset):", flush=True)
        k = report["kill"] = kill_points(args)
        print(f"kill -9: {k['acknowledged']} acknowledged updates over {k['kills']} kills; problems "
              f"{len(k['problems'])}" + "".join(f"\n  {p}" for p in k["problems"][:10]))
        if k["restarts"]:
            first, last = k["restarts"][0], k["restarts"][-1]
            print(f"restart to ready: {first['ready_s']}s with {first['log_batches']} logged batches, "
                  f"{last['ready_s']}s with {last['log_batches']}")
    print(f"machine: {report['machine']}")
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
