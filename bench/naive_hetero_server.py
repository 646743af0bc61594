"""The naive baseline for bench/hetero_pairs.py: a PyG server that runs the model's full
forward over the whole heterogeneous graph for every request, then scores its pairs.

aiohttp on uvloop, one request at a time (the forward runs inline); the model is the
saved one (hybridgnn's HeteroGNN holds the same PyG convolutions and weights), so the
answers are exact and the work per request is what a first version would do.

    .venv/bin/python bench/naive_hetero_server.py --dataset D --model M --port 8001
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridgnn.graph.hetero import HeteroGraphStore  # noqa: E402
from hybridgnn.models.hetero_checkpoint import load_hetero_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--torch-threads", type=int, default=1, help="intra-op threads for the forward")
    args, _ = ap.parse_known_args()  # the flags bench/hetero_pairs.py gives `hybridgnn serve` too
    torch.set_num_threads(args.torch_threads)
    graph = HeteroGraphStore.open(args.dataset)
    model = load_hetero_model(args.model, json.loads((args.model / "config.json").read_text()))
    x = {t: torch.from_numpy(np.array(n.features)) for t, n in graph.nodes.items()}
    edges = {e: torch.from_numpy(np.stack([np.asarray(d.indices, np.int64),
                                           np.repeat(np.arange(d.indptr.shape[0] - 1), np.diff(d.indptr))]))
             for e, d in graph.edges.items()}

    async def infer(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        inputs = {t["name"]: torch.tensor(t["data"]) for t in body["inputs"]}
        p = body["parameters"]
        with torch.inference_mode():
            z = model(x, edges)
            scores = (z[p["src_type"]][inputs["src_ids"]] * z[p["dst_type"]][inputs["dst_ids"]]).sum(-1)
        return web.json_response({"model_name": "hybridgnn", "outputs": [
            {"name": "scores", "datatype": "FP32", "shape": [len(scores)], "data": scores.tolist()}]})

    async def ready(request):
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_post("/v2/models/hybridgnn/infer", infer)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
