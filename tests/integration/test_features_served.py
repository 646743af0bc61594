"""Feature stores behind a real engine and its HTTP server on 127.0.0.1."""

import asyncio

import pytest

from hybridgnn.features.placement import (
    fap_plan,
)
from hybridgnn.features.topology import Topology


def test_server_answers_through_a_placement_plan(tiny_dataset, tiny_model, tmp_path):
    from hybridgnn.config import (
        DeviceMemoryConfig,
        PipelineConfig,
        RouterConfig,
        SamplingConfig,
        ServeConfig,
    )
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.workload.tables import WorkloadTables
    from tests.support.engine_client import body, with_client

    graph = GraphStore.open(tiny_dataset)
    row = graph.feature_dim * 4
    topo = Topology(gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=100 * row, host_memory_bytes=1000 * row)
    plan_dir = fap_plan(WorkloadTables.load_or_build(graph, (5, 3)).fap, topo, row).save(tmp_path / "plan")
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu"), router=RouterConfig(20.0),
                      gpu_memory=DeviceMemoryConfig(placement_plan=plan_dir))

    async def scenario(engine, client):
        for ids in ([1], list(range(100, 160))):
            assert (await client.post("/v2/models/hybridgnn/infer", json=body(ids))).status == 200
        text = await (await client.get("/metrics")).text()
        for tier in ("gpu", "peer_gpu", "host", "disk"):
            assert f'hybridgnn_gathered_rows_total{{pipeline="gpu",tier="{tier}"}}' in text
        meta = await (await client.get("/v2/models/hybridgnn")).json()
        assert meta["parameters"]["placement_plan"] == str(plan_dir)
        with pytest.raises(LookupError, match="fixed placement plan"):
            await engine.refresh_placement()

    asyncio.run(with_client(cfg, scenario))
