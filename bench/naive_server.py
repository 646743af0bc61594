"""The naive baseline for bench/serve_throughput.py: one request at a time, no batching.

Same HTTP stack (aiohttp on uvloop), codec, sampler, feature store and model as
`hybridgnn serve`, but the handler runs sample → gather → model inline, so the event
loop does nothing else until the request is answered: the server a first version would be.

    .venv/bin/python bench/naive_server.py --dataset D --model M --port 8001
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridgnn.capabilities import freeze_startup_heap  # noqa: E402
from hybridgnn.errors import ServingError  # noqa: E402
from hybridgnn.features.store import HostFeatureStore  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import load_checkpoint  # noqa: E402
from hybridgnn.pipelines.executor import BatchExecutor  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402
from hybridgnn.serving.http.codec import HEADER_LENGTH  # noqa: E402
from tests.support.v2_codec import decode_infer_request, encode_infer_response  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads for the inline model (more lets one request use more cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    graph = GraphStore.open(args.dataset)
    model, cfg = load_checkpoint(args.model)
    executor = BatchExecutor(CPUSampler(graph, tuple(cfg["fanouts"])), HostFeatureStore(graph.features), model)

    async def infer(request: web.Request) -> web.Response:
        try:
            req = decode_infer_request(await request.read(), request.headers.get(HEADER_LENGTH),
                                       max_nodes=8192, num_nodes=graph.num_nodes)
        except ServingError as exc:
            return web.json_response({"error": exc.message}, status=exc.status)
        result = executor.run(req.node_ids)
        body, headers = encode_infer_response("hybridgnn", req.request_id, {
            "logits": result.logits, "embeddings": result.embeddings,
            "predictions": result.predictions}, req.outputs)
        return web.Response(body=body, headers=headers)

    async def ready(request):
        return web.json_response({"ready": True})

    async def metadata(request):
        return web.json_response({"name": "hybridgnn", "parameters": {"num_nodes": graph.num_nodes}})

    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2/models/hybridgnn", metadata)
    app.router.add_post("/v2/models/hybridgnn/infer", infer)

    async def freeze(app):  # the same start-up treatment as `hybridgnn serve`
        freeze_startup_heap()

    app.on_startup.append(freeze)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
