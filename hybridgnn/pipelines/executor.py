"""Runs one batch on one device: sample → gather → model, timing each stage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridgnn.capabilities import DEVICE_GATE
from hybridgnn.features.store import FeatureStore
from hybridgnn.graph.degrees import NodeDegrees
from hybridgnn.models.gnn import GNN
from hybridgnn.sampling.base import Sampler
from hybridgnn.types import BatchResult, StageTimings


class BatchExecutor:
    """Owns a sampler (per-worker scratch); shares the feature store and model."""

    def __init__(self, sampler: Sampler, features: FeatureStore, model: GNN, device: str = "cpu",
                 read_lock=contextlib.nullcontext, degrees: NodeDegrees | None = None,
                 alive: Callable[[], np.ndarray] | None = None):
        self.sampler = sampler
        # Whole-graph degrees for degree-normalised models (GCN), read with the sample.
        self.degrees = degrees if model.gcn_normalised else None
        self.features = features
        self.model = model
        self.device = torch.device(device)
        # the model on a GPU (--cpu-compute-device cuda): its device work never runs while
        # another thread's CUDA graph capture records
        self.gated = self.device.type != "cpu"
        # Sample and gather see one version of a changing graph (DynamicGraph.lock.read).
        self.read_lock = read_lock
        # A changing graph's alive mask, read in that version: a request checked when it
        # arrived may have waited for the update that removed its node.
        self.alive = alive

    def run(self, seeds: np.ndarray, timings: StageTimings | None = None) -> BatchResult:
        if self.gated:
            with DEVICE_GATE.work():
                return self._run(seeds, timings)
        return self._run(seeds, timings)

    def _run(self, seeds: np.ndarray, timings: StageTimings | None) -> BatchResult:
        t = timings if timings is not None else StageTimings()
        with self.read_lock():
            removed = None
            if self.alive is not None:
                removed = ~self.alive()[seeds]
                removed = removed if removed.any() else None
            t0 = time.perf_counter()
            sub = self.sampler.sample(seeds)
            t1 = time.perf_counter()
            x, tiers = self.features.gather_counted(sub.node_ids)
            x = x.to(self.device, non_blocking=True)
            degrees = self.degrees.tensors(sub.node_ids, self.device) if self.degrees is not None else None
            t2 = time.perf_counter()
        with torch.inference_mode():
            out, hidden = self.model(x, sub.edge_index_tensor(self.device), sub.num_sampled_nodes,
                                     sub.num_sampled_edges, degrees, with_embeddings=True)
            rows = torch.from_numpy(sub.seed_index).to(self.device)
            out, hidden = out[rows], hidden[rows]
            pred = out.argmax(dim=1).cpu().numpy()
            logits, emb = out.float().cpu().numpy(), hidden.float().cpu().numpy()
        t3 = time.perf_counter()
        t.sample_s, t.gather_s, t.compute_s = t1 - t0, t2 - t1, t3 - t2
        return BatchResult(logits=logits, embeddings=emb, predictions=pred.astype(np.int64, copy=False), timings=t,
                           sampled_edges=sub.num_edges, gathered_rows=tiers, removed=removed)
