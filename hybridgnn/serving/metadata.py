"""What a server says about itself (GET /v2/models/{m}): the graph, the model, the
pipelines, the policy in force and its predictions, admission's state and the modes on."""

from __future__ import annotations

import math

from hybridgnn.models.checkpoint import model_kind


def describe_engine(engine) -> dict:
    thr = engine.router.threshold
    return {
        "num_nodes": engine.num_nodes,
        "num_edges": engine.graph.num_edges if engine.dynamic is None else engine.dynamic.num_edges,
        "feature_dim": engine.graph.feature_dim,
        "num_classes": engine.model.out_dim,
        "logits_dim": engine.model.out_dim,
        "embedding_dim": engine.embedding_dim,
        "fanouts": list(engine.cfg.sampling.fanouts),
        "model_kind": model_kind(engine.model_config),
        "model_class": engine.model_config["class"],
        "num_layers": engine.model.num_layers,
        "dataset": engine.graph.name,
        "dataset_fingerprint": engine.graph.fingerprint,
        "pipelines": list(engine.pipelines),
        "devices": {name: p.cfg.device for name, p in engine.pipelines.items()},
        "gpu_cache_rows": (getattr(engine.gpu_features.current, "cached_rows", None)
                           if engine.gpu_features is not None else 0),
        "placement_plan": str(engine.cfg.gpu_memory.placement_plan) if engine.plan is not None else None,
        "psgs_threshold": "inf" if math.isinf(thr) else thr,
        "policy": engine.policy.name if engine.policy else None,
        "max_batch_psgs": "inf" if math.isinf(engine.batcher.cfg.max_batch_psgs) else engine.batcher.cfg.max_batch_psgs,
        "predicted_seeds_per_s": engine.policy.predicted_seeds_per_s if engine.policy else None,
        "predicted_assumes": engine.control.prediction_assumes(),
        "service_stretch": engine.control.service_stretch(),
        "admission": {**engine.admission.describe(), "refused_in_flight_cap": engine.refused_in_flight_cap},
        "max_request_nodes": engine.cfg.server.max_request_nodes,
        "modes": ["sampled"] + (["precomputed"] if engine.embeddings is not None else []),
        "node_ids": engine.graph.id_map.kind if engine.graph.id_map is not None else "dense",
        "new_node_modes": (["full", "pe", "srpe"] if engine.embeddings is not None else []) + ["sampled"],
        "srpe_gamma": engine.cfg.new_nodes.gamma,
        "pe_computed_unix_s": engine.embeddings.computed_unix_s if engine.embeddings is not None else None,
        "updates_enabled": engine.dynamic is not None,
        "graph_version": engine.graph_version,
        "update_log": engine.update_log.url if engine.update_log is not None else None,
        "update_log_position": engine.graph_version if engine.update_log is not None else None,
        "update_log_lag_s": engine.follower.lag_s() if engine.follower is not None else None,
        "update_follower_error": engine.follower.failed if engine.follower is not None else None,
        "snapshot": (str(engine.resources.snapshot.path) if engine.resources.snapshot is not None else None),
        "pe_updated_unix_s": (engine.incremental.last_update_unix_s if engine.incremental is not None else None),
    }
