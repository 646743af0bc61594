"""Model repository and gRPC figures, same run, on the demo graph and model.

1. gRPC against REST (binary tensor extension): the highest Poisson rate each protocol
   sustains with p99 within --slo-ms and nothing refused or failed, at 1 and 64 seeds
   per request, against the same server (`hybridgnn serve --grpc-port`), with
   `hybridgnn bench`'s load generator (`--protocol grpc` sends raw tensor contents over
   one HTTP/2 channel). Prints seeds/s of each and gRPC/REST.
2. Memory of a second model over the same graph: resident memory of a server whose
   repository holds one model, then two (the second: other weights, its own
   embeddings); the difference against the dataset's and the model's sizes on disk.
3. Reload: a server serving version 1 under Poisson load (--reload-rate requests/s, 1
   seed each); version 2 (other weights, embeddings precomputed when it loads) is copied
   into the repository; the repository poll finds it, loads it in the background and
   switches. Prints the time from the copy to the switch, failed requests, and p99
   before, during and after the reload.

    .venv/bin/python bench/repository.py            # ~6 min on 2 cores
    .venv/bin/python bench/repository.py --parts reload --reload-rate 200
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, machine  # noqa: E402
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.bench.search import find_max_rate  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.durability import get_json, post_json  # noqa: E402
from tests.support.server import ServerProcess, free_port  # noqa: E402

MODEL = "hybridgnn"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def du_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def other_model(dataset: Path, like: Path, out: Path, seed: int) -> Path:
    """A model of the same shape with other weights, saved, with its embeddings."""
    import torch

    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import load_checkpoint, save_model

    model, cfg = load_checkpoint(like)
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_model(model, out, fanouts=cfg.get("fanouts"))
    precompute(GraphStore.open(dataset), model, out, progress=False)
    return out


def protocols(args, dataset: Path, model: Path) -> dict:
    out = {}
    for seeds in (1, 64):
        for proto in ("http", "grpc"):
            # A fresh server per search: connections an overloaded trial left open must
            # not count against the next search's connection limit.
            gport = free_port()
            srv = ServerProcess(dataset, model, "--grpc-port", str(gport)).wait_ready(300)
            try:
                print(f"  {proto}, {seeds} seeds per request:", flush=True)
                rate, res = asyncio.run(find_max_rate(
                    srv.url, MODEL, slo_ms=args.slo_ms, duration_s=args.duration_s, nodes_per_request=seeds,
                    start_rate=args.start_rate / seeds, grpc_target=f"127.0.0.1:{gport}" if proto == "grpc" else None,
                    log=lambda line: print(line, flush=True)))
            finally:
                srv.stop()
            out[f"{proto}_{seeds}"] = {"rate": rate, "seeds_per_s": res.seeds_per_s if res else 0.0,
                                       "result": res.to_dict() if res else None}
        g, h = out[f"grpc_{seeds}"]["seeds_per_s"], out[f"http_{seeds}"]["seeds_per_s"]
        out[f"grpc_over_http_{seeds}"] = round(g / h, 3) if h else None
    return out


def memory(args, dataset: Path, model: Path, tmp: Path) -> dict:
    repo = tmp / "repo-memory"
    shutil.copytree(model, repo / "first" / "1")
    rows = []
    for count in (1, 2):
        if count == 2:
            other_model(dataset, model, repo / "second" / "1", seed=11)
        srv = ServerProcess(dataset, None, "--model-repository", str(repo), "--workers", "1").wait_ready(300)
        try:
            everyone = list(range(50_000))
            for name in ["first", "second"][:count]:  # every embedding row read once: resident
                for start in range(0, len(everyone), 8192):
                    ids = everyone[start:start + 8192]
                    post_json(srv.url, f"/v2/models/{name}/infer", {
                        "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
                        "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}, timeout_s=120)
            time.sleep(1.0)  # let allocation settle before reading RSS
            rows.append(rss_mib(srv.proc.pid))
        finally:
            srv.stop()
    second_disk = du_mib(repo / "second" / "1")
    return {"rss_one_model_mib": round(rows[0], 1), "rss_two_models_mib": round(rows[1], 1),
            "second_model_mib": round(rows[1] - rows[0], 1), "dataset_on_disk_mib": round(du_mib(dataset), 1),
            "second_model_on_disk_mib": round(second_disk, 1)}


async def _reload_run(args, srv: ServerProcess, repo: Path, v2: Path) -> dict:
    events = {}

    async def drop_and_watch() -> None:
        await asyncio.sleep(args.reload_at_s)
        tmp = repo / "m" / ".incoming-2"
        shutil.copytree(v2, tmp)
        events["copied"] = time.perf_counter()
        tmp.rename(repo / "m" / "2")
        while True:
            status, meta = await asyncio.to_thread(get_json, srv.url, "/v2/models/m")
            if status == 200 and meta.get("versions") == ["2"]:
                events["switched"] = time.perf_counter()
                return
            await asyncio.sleep(0.05)

    start = time.perf_counter()
    watcher = asyncio.ensure_future(drop_and_watch())
    res = await run_load(srv.url, "m", rate=args.reload_rate, duration_s=args.reload_duration_s, num_nodes=50_000,
                         keep_latencies=True)
    await watcher
    lat = np.asarray(res.latencies_ms)
    t = start + np.asarray(res.arrivals_s)  # each request's scheduled arrival
    windows = {"before": t < events["copied"], "during": (t >= events["copied"]) & (t < events["switched"]),
               "after": t >= events["switched"]}
    out = {"reload_s": round(events["switched"] - events["copied"], 2), "sent": res.sent, "ok": res.ok,
           "failed": res.sent - res.ok}
    for name, mask in windows.items():
        ok = lat[mask][np.isfinite(lat[mask])]
        out[f"p99_{name}_ms"] = round(float(np.percentile(ok, 99)), 2) if ok.size else None
        out[f"n_{name}"] = int(mask.sum())
    return out


def reload(args, dataset: Path, model: Path, tmp: Path) -> dict:
    repo = tmp / "repo-reload"
    shutil.copytree(model, repo / "m" / "1")
    v2 = tmp / "v2"
    other_model(dataset, model, v2, seed=5)
    shutil.rmtree(v2 / "embeddings")  # precomputed when it loads, as a model dropped in without them
    srv = ServerProcess(dataset, None, "--model-repository", str(repo), "--repository-poll-s", "0.2").wait_ready(300)
    try:
        return asyncio.run(_reload_run(args, srv, repo, v2))
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="protocols,memory,reload")
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--duration-s", type=float, default=3.0, help="protocols: seconds per trial rate")
    ap.add_argument("--start-rate", type=float, default=2000.0, help="protocols: seeds/s the search starts from")
    ap.add_argument("--reload-rate", type=float, default=300.0)
    ap.add_argument("--reload-duration-s", type=float, default=20.0)
    ap.add_argument("--reload-at-s", type=float, default=4.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(report["machine"], flush=True)
    dataset, model = ensure_demo()
    tmp = Path(tempfile.mkdtemp(prefix="hgnn-repo-"))
    parts = args.parts.split(",")
    try:
        if "protocols" in parts:
            print(f"gRPC against REST, highest rate within p99 {args.slo_ms:g} ms:", flush=True)
            p = report["protocols"] = protocols(args, dataset, model)
            for seeds in (1, 64):
                print(f"{seeds} seeds/request: REST {p[f'http_{seeds}']['seeds_per_s']:,.0f} seeds/s, gRPC "
                      f"{p[f'grpc_{seeds}']['seeds_per_s']:,.0f}: gRPC/REST {p[f'grpc_over_http_{seeds}']}", flush=True)
        if "memory" in parts:
            m = report["memory"] = memory(args, dataset, model, tmp)
            print(f"memory: one model {m['rss_one_model_mib']} MiB, two {m['rss_two_models_mib']} MiB: the second "
                  f"costs {m['second_model_mib']} MiB (its directory: {m['second_model_on_disk_mib']} MiB; the "
                  f"dataset: {m['dataset_on_disk_mib']} MiB)", flush=True)
        if "reload" in parts:
            r = report["reload"] = reload(args, dataset, model, tmp)
            print(f"reload under {args.reload_rate:g} req/s: switched {r['reload_s']} s after the copy (precompute "
                  f"included); {r['failed']} of {r['sent']} requests failed; p99 before {r['p99_before_ms']} ms, "
                  f"during {r['p99_during_ms']} ms, after "
                  + (f"{r['p99_after_ms']} ms" if r["p99_after_ms"] is not None
                     else "none (the switch came after the load ended: raise --reload-duration-s)"), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"machine: {report['machine']}")
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
