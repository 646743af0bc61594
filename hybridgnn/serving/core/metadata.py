"""What a server says about itself (GET /v2/models/{m}): the graph, the model, the
pipelines, the policy in force and its predictions, admission's state and the modes on."""

from __future__ import annotations

import math

from hybridgnn.models.checkpoint import model_kind


def describe_engine(engine) -> dict:
    """The engine's self-description (core's own module: it may read the engine's parts)."""
    r, side, control, follower = engine._resources, engine._side, engine._control, engine._follower
    thr = engine._router.threshold
    max_psgs = engine._batcher.cfg.max_batch_psgs
    policy = control.policy
    return {
        "num_nodes": engine.num_nodes,
        "num_edges": r.graph.num_edges if r.dynamic is None else r.dynamic.num_edges,
        "feature_dim": r.graph.feature_dim,
        "num_classes": r.model.out_dim,
        "logits_dim": r.model.out_dim,
        "embedding_dim": engine.embedding_dim,
        "fanouts": list(engine.cfg.sampling.fanouts),
        "model_kind": model_kind(r.model_config),
        "model_class": r.model_config["class"],
        "num_layers": r.model.num_layers,
        "dataset": r.graph.name,
        "dataset_fingerprint": r.graph.fingerprint,
        "pipelines": list(engine._pipelines),
        "devices": {name: p.cfg.device for name, p in engine._pipelines.items()},
        # split: the CPU pipeline samples and the GPU gathers and computes (Quiver's CPU lane)
        "cpu_lane": "split" if engine.cfg.cpu_pipeline.split else "model",
        "gpu_cache_rows": (getattr(r.gpu_features.current, "cached_rows", None) if r.gpu_features is not None else 0),
        "placement_plan": str(engine.cfg.gpu_memory.placement_plan) if r.plan is not None else None,
        "psgs_threshold": "inf" if math.isinf(thr) else thr,
        "policy": policy.name if policy else None,
        "max_batch_psgs": "inf" if math.isinf(max_psgs) else max_psgs,
        "predicted_seeds_per_s": policy.predicted_seeds_per_s if policy else None,
        "predicted_assumes": control.prediction_assumes(),
        "service_stretch": control.service_stretch(),
        "admission": {**engine._admission.describe(), "refused_in_flight_cap": engine._refused_in_flight_cap},
        "max_request_nodes": engine.cfg.server.max_request_nodes,
        "modes": ["sampled"] + (["precomputed"] if side.embeddings is not None else []),
        "node_ids": r.graph.id_map.kind if r.graph.id_map is not None else "dense",
        "new_node_modes": (["full", "pe", "srpe"] if side.embeddings is not None else []) + ["sampled"],
        "srpe_gamma": engine.cfg.new_nodes.gamma,
        "pe_computed_unix_s": side.embeddings.computed_unix_s if side.embeddings is not None else None,
        "updates_enabled": r.dynamic is not None,
        "graph_version": engine.graph_version,
        "update_log": r.update_log.url if r.update_log is not None else None,
        "update_log_position": engine.graph_version if r.update_log is not None else None,
        "update_log_lag_s": follower.lag_s() if follower is not None else None,
        "update_follower_error": follower.failed if follower is not None else None,
        "snapshot": str(r.snapshot.path) if r.snapshot is not None else None,
        "pe_updated_unix_s": r.incremental.last_update_unix_s if r.incremental is not None else None,
    }
