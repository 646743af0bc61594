"""A new-node request in a mode that needs stored embeddings, on a server without them,
is a 409 that names the mode and the one mode that works without them (sampled)."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from hybridgnn.errors import Conflict
from hybridgnn.serving.core.graph_requests import GraphRequests


def test_new_nodes_without_embeddings_names_the_mode_and_sampled():
    r = SimpleNamespace(graph=None, model=None, embeddings=None, new_nodes=None, dynamic=None, incremental=None)
    requests = GraphRequests(SimpleNamespace(cfg=None), r)
    with pytest.raises(Conflict) as info:
        asyncio.run(requests.new_nodes_infer(np.zeros((1, 4), np.float32), np.zeros((2, 0), np.int64),
                                             mode="srpe", gamma=0.1, policy="ratio"))
    message = str(info.value)
    assert "mode 'srpe' needs precomputed embeddings" in message and "hybridgnn precompute" in message
    assert "'sampled'" in message


def test_a_new_node_request_is_admitted_with_its_size():
    """It was one unit of work whatever its query nodes and edges (scheduler/admission.py
    new_node_work)."""
    evaluator = SimpleNamespace(infer=None)
    r = SimpleNamespace(graph=None, model=None, embeddings=None, new_nodes=evaluator, dynamic=None, incremental=None)
    requests = GraphRequests(SimpleNamespace(cfg=SimpleNamespace(sampling=SimpleNamespace(fanouts=(5, 3)))), r)
    admitted = []

    async def lane(name, work, fn, *args, waited_s=0.0, **kwargs):
        admitted.append((name, work))
        raise Conflict("stopped here")

    requests.run_in_thread_lane = lane
    with pytest.raises(Conflict, match="stopped here"):
        asyncio.run(requests.new_nodes_infer(np.zeros((3, 4), np.float32), np.zeros((2, 7), np.int64),
                                             mode="full", gamma=0.1, policy="ratio"))
    assert admitted == [("new_nodes", 10.0)]
