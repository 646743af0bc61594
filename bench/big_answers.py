"""What one client's large answers cost every other client: one-seed precomputed JSON
lookups one after another on one connection (closed loop), alone and while another
connection asks, one after another, for the largest JSON answer a request may get
(--big-ids node ids, precomputed, every output). Against this working tree's server and,
with --baseline-rev, the same defaults at an earlier git revision (before large answers
were encoded off the event loop, the big answer's encoding held the loop, and every small
request behind it waited).

The servers run at once and take turns, alone then with the big client, the order
rotating each round, so drift of the machine's speed falls on all of them alike.
Reported per server: the small requests' median p50, p99 and max latency over the rounds,
alone and beside the big client, their ratio, and the big answers served per second beside
them and alone; then
each server's p99 beside the big client ÷ the working tree's.

    .venv/bin/python bench/big_answers.py [--requests 1000] [--rounds 5] [--big-ids 8192]
    .venv/bin/python bench/big_answers.py --baseline-rev 5e5a1f0   # before/after a change
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import emit_report, machine, serve_revision  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402

MODEL = "hybridgnn"
PATH = f"/v2/models/{MODEL}/infer"


def body(ids) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
                       "parameters": {"mode": "precomputed"}}).encode()


def post(conn: http.client.HTTPConnection, data: bytes) -> int:
    """Send one request; the answer's length (its body read, not parsed)."""
    conn.request("POST", PATH, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {out[:200]!r}")
    return len(out)


class BigClient(threading.Thread):
    """Asks for the big answer again and again until stopped; counts the answers."""

    def __init__(self, port: int, data: bytes):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.data, self.answers, self.bytes = data, 0, 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.bytes += post(self.conn, self.data)
                self.answers += 1
        except BaseException as exc:  # reported by the caller
            self.error = exc


def small_turn(conn: http.client.HTTPConnection, ids: np.ndarray) -> list[float]:
    lat = []
    for node in ids.tolist():
        t0 = time.perf_counter()
        post(conn, body([node]))
        lat.append((time.perf_counter() - t0) * 1e3)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="small requests per server per setting per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--big-ids", type=int, default=8192, help="node ids of the big request (the server's "
                    "--max-request-nodes at most)")
    ap.add_argument("--big-seconds", type=float, default=5.0, help="how long the big client runs alone per round")
    ap.add_argument("--baseline-rev", help="also the defaults of this git revision")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dataset, model = ensure_demo()
    num_nodes = int(np.load(Path(dataset) / "indptr.npy", mmap_mode="r").shape[0] - 1)
    rng = np.random.default_rng(0)
    big = body(rng.integers(0, num_nodes, args.big_ids).tolist())
    setups = [("defaults", None)] + ([(f"defaults at {args.baseline_rev}", args.baseline_rev)]
                                     if args.baseline_rev else [])
    servers, rounds = {}, {}
    try:
        for label, rev in setups:
            servers[label] = serve_revision(rev, dataset, model)
            rounds[label] = []
        conns = {label: http.client.HTTPConnection("127.0.0.1", s.port, timeout=60) for label, s in servers.items()}
        big_bytes = 0
        for label, s in servers.items():  # warm: first requests page the rows in
            small_turn(conns[label], rng.integers(0, num_nodes, 200))
            big_bytes = post(conns[label], big)
        labels = list(servers)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                alone = small_turn(conns[label], rng.integers(0, num_nodes, args.requests))
                client = BigClient(servers[label].port, big)
                client.start()
                while client.answers < 1 and client.is_alive():  # it is under way
                    time.sleep(0.001)
                t0 = time.perf_counter()
                beside = small_turn(conns[label], rng.integers(0, num_nodes, args.requests))
                seconds = time.perf_counter() - t0
                answered = client.answers
                client.stopping.set()
                client.join(120)
                if client.error is not None:
                    raise RuntimeError(f"{label}: the big client failed: {client.error}")
                client = BigClient(servers[label].port, big)  # and alone: what the sharing costs it
                client.start()
                while client.answers < 1 and client.is_alive():
                    time.sleep(0.001)
                first, t0 = client.answers, time.perf_counter()
                time.sleep(args.big_seconds)
                big_alone = (client.answers - first) / (time.perf_counter() - t0)
                client.stopping.set()
                client.join(120)
                if client.error is not None:
                    raise RuntimeError(f"{label}: the big client failed: {client.error}")
                row = {"alone_p50_ms": float(np.percentile(alone, 50)), "alone_p99_ms": float(np.percentile(alone, 99)),
                       "alone_max_ms": max(alone), "beside_p50_ms": float(np.percentile(beside, 50)),
                       "beside_p99_ms": float(np.percentile(beside, 99)), "beside_max_ms": max(beside),
                       "big_answers_per_s": answered / seconds, "big_alone_answers_per_s": big_alone}
                rounds[label].append(row)
                print(f"round {r + 1} {label}: p99 alone {row['alone_p99_ms']:.2f} ms, beside the big client "
                      f"{row['beside_p99_ms']:.2f} ms (max {row['beside_max_ms']:.1f}); "
                      f"{row['big_answers_per_s']:.1f} big answers/s beside it, {big_alone:.1f} alone", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = {label: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
               for label, rs in rounds.items()}
    for v in summary.values():
        v["p99_beside_over_alone"] = round(v["beside_p99_ms"] / v["alone_p99_ms"], 2)
    ref = summary["defaults"]
    emit_report({
        "machine": machine(),
        "requests_per_round": args.requests, "rounds": args.rounds, "big_ids": args.big_ids,
        "big_answer_bytes": big_bytes,
        "servers": summary,
        "vs_defaults": {label: {k: round(v[k] / ref[k], 2) for k in ("beside_p99_ms", "beside_max_ms",
                                                                     "big_answers_per_s", "big_alone_answers_per_s")}
                        for label, v in summary.items() if label != "defaults"},
    }, args.out)


if __name__ == "__main__":
    main()
