"""The update log's size with and without trimming, same run: one `hybridgnn serve` of the
demo takes --updates graph updates (feature rewrites of --request-updates nodes each,
--concurrency in flight), snapshotting every --snapshot-every log entries, once keeping
every entry and once with `--update-log-retain --retain`. Prints the log file's size
(with its WAL) at each quarter of the run, the entries it holds at the end, the updates/s
served, and the ratios trimmed ÷ kept.

    .venv/bin/python bench/log_retention.py                    # ~2 min on 2 cores
    .venv/bin/python bench/log_retention.py --updates 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, machine  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.updates.log import SqliteLog  # noqa: E402
from tests.support.durability import MODEL, get_json  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

TOKEN = "retention-bench-token"


def log_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.is_file())


async def drive(url: str, args, num_nodes: int, feature_dim: int, log_path: Path) -> dict:
    import aiohttp

    rng = np.random.default_rng(0)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    sizes, failed, done = [], [], 0
    marks = {args.updates * q // 4 for q in (1, 2, 3, 4)}

    def body() -> bytes:
        ids = rng.choice(num_nodes, size=args.request_updates, replace=False)
        return json.dumps({"inputs": [
            {"name": "update_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids.tolist()},
            {"name": "update_features", "datatype": "FP32", "shape": [len(ids), feature_dim],
             "data": rng.normal(size=len(ids) * feature_dim).round(4).tolist()}]}).encode()

    async def worker(session, todo: asyncio.Queue) -> None:
        nonlocal done
        while True:
            i = await todo.get()
            if i is None:
                return
            async with session.post(f"{url}/v2/models/{MODEL}/graph", data=body(), headers=headers) as r:
                if r.status != 200:
                    failed.append(f"{r.status}: {await r.text()}")
                else:
                    await r.read()
            done += 1
            if done in marks:
                sizes.append((done, log_bytes(log_path)))

    todo: asyncio.Queue = asyncio.Queue()
    for i in range(args.updates):
        todo.put_nowait(i)
    for _ in range(args.concurrency):
        todo.put_nowait(None)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(session, todo) for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    return {"updates_per_s": round(args.updates / elapsed, 1), "log_mib_at": {n: round(b / 2**20, 2) for n, b in sizes},
            "failed": len(failed), "first_failures": failed[:3]}


def run(retain: int, args, dataset: Path, model: Path, tmp: Path) -> dict:
    log_path, snaps = tmp / f"log-{retain}.sqlite", tmp / f"snapshots-{retain}"
    srv = ServerProcess(dataset, model, "--workers", "1", "--update-token", TOKEN, "--update-log", str(log_path),
                        "--snapshot-dir", str(snaps), "--snapshot-every", str(args.snapshot_every),
                        "--update-log-retain", str(retain), "--max-queue-delay-ms", "10000").wait_ready(300)
    try:
        meta = get_json(srv.url, f"/v2/models/{MODEL}")[1]["parameters"]
        out = asyncio.run(drive(srv.url, args, int(meta["num_nodes"]), int(meta["feature_dim"]), log_path))
    finally:
        srv.stop()
    log = SqliteLog(log_path, GraphStore.open(dataset).fingerprint)
    try:
        out.update(entries_held=len(log), first_position=log.first(), head=log.head(),
                   final_log_mib=round(log_bytes(log_path) / 2**20, 2))
    finally:
        log.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=6000, help="update requests sent (one log entry each, at most)")
    ap.add_argument("--request-updates", type=int, default=10, help="node feature rewrites per request")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--snapshot-every", type=int, default=500)
    ap.add_argument("--retain", type=int, default=500, help="--update-log-retain of the trimmed run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(report["machine"], flush=True)
    dataset, model = ensure_demo()
    tmp = Path(tempfile.mkdtemp(prefix="hgnn-retain-"))
    try:
        for label, retain in (("kept", 0), ("trimmed", args.retain)):
            r = report[label] = run(retain, args, dataset, model, tmp)
            print(f"{label} (--update-log-retain {retain}): {r['updates_per_s']:,} updates/s, log MiB after "
                  f"{r['log_mib_at']}, {r['entries_held']:,} entries held (positions {r['first_position']:,}.."
                  f"{r['head']:,}), failed {r['failed']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kept, trimmed = report["kept"], report["trimmed"]
    report["trimmed_over_kept"] = {
        "final_log_size": round(trimmed["final_log_mib"] / max(kept["final_log_mib"], 1e-9), 3),
        "entries_held": round(trimmed["entries_held"] / max(kept["entries_held"], 1), 3),
        "updates_per_s": round(trimmed["updates_per_s"] / max(kept["updates_per_s"], 1e-9), 3)}
    print(f"trimmed ÷ kept: log size {report['trimmed_over_kept']['final_log_size']}, entries held "
          f"{report['trimmed_over_kept']['entries_held']}, updates/s {report['trimmed_over_kept']['updates_per_s']}")
    print(f"machine: {report['machine']}")
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
