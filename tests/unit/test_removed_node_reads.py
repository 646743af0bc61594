"""A precomputed lookup that found its nodes alive when it was decoded, then waited for
an update batch that removed one of them, is a 404 like any read of a removed node: not
the zero rows the removal leaves behind."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from hybridgnn.config import SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.serving.http.api import Api
from hybridgnn.serving.http.reply import Reply, Request
from tests.support.engine_api import run_api


def _lookup_body(ids) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}],
                       "parameters": {"mode": "precomputed"}}).encode()


def test_a_lookup_that_waited_for_an_update_removing_its_node_is_a_404(tiny_dataset, tiny_model_pe, tmp_path):
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)),
                      updates=UpdateConfig(token="12345678", log=str(tmp_path / "updates.sqlite")))
    node = 7

    async def scenario(api: Api, engine):
        inc = engine._side.incremental
        lock = inc.graph.lock
        assert lock.try_read()  # another reader holds the graph: the update below waits for it
        update = asyncio.ensure_future(asyncio.to_thread(inc.apply, UpdateBatch(remove_nodes=np.array([node]))))
        while not lock._writers_waiting:
            await asyncio.sleep(0.001)
        # Decoded while the node is alive; the lookup then queues behind the waiting update.
        endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
        reply = endpoint(Request(params, {}, _lookup_body([node, 3])))
        await asyncio.sleep(0.05)
        lock.release_read()
        await update
        return reply if isinstance(reply, Reply) else await reply

    reply = run_api(cfg, scenario)
    assert reply.status == 404, (reply.status, reply.body[:200])
    assert b"node 7 was removed" in reply.body


def test_a_sampled_inference_that_waited_for_an_update_removing_its_node_is_a_404(tiny_dataset, tiny_model_pe,
                                                                                    tmp_path):
    """The same for a sampled inference: its batch reads the graph after the removal, and
    the request is answered as a read of a removed node, not as an isolated node's rows;
    the other request of the batch is answered."""
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model_pe, sampling=SamplingConfig((5, 3)),
                      updates=UpdateConfig(token="12345678", log=str(tmp_path / "updates.sqlite")))
    node = 7

    def body(ids) -> bytes:
        return json.dumps({"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}],
                           "parameters": {"mode": "sampled"}}).encode()

    async def scenario(api: Api, engine):
        inc = engine._side.incremental
        lock = inc.graph.lock
        assert lock.try_read()
        update = asyncio.ensure_future(asyncio.to_thread(inc.apply, UpdateBatch(remove_nodes=np.array([node]))))
        while not lock._writers_waiting:
            await asyncio.sleep(0.001)
        endpoint, params = api.route("POST", "/v2/models/hybridgnn/infer")
        replies = [endpoint(Request(params, {}, body(ids))) for ids in ([3, node], [4, 5])]
        await asyncio.sleep(0.05)
        lock.release_read()
        await update
        return [r if isinstance(r, Reply) else await r for r in replies]

    removed, other = run_api(cfg, scenario)
    assert removed.status == 404, (removed.status, removed.body[:200])
    assert b"node 7 was removed" in removed.body
    assert other.status == 200, (other.status, other.body[:200])
