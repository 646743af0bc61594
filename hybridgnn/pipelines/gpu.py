"""The GPU pipeline's executor: sample on the device (TorchSampler over UVA or device
memory), gather through the device feature cache, run the model, copy results back.

Each worker owns one CUDA stream (Quiver §4.3): its batches' kernels queue there, so
workers overlap on the device while the host threads wait. A small batch's model forward
is a CUDA graph replay (pipelines/graphed.py; HYBRIDGNN_CUDA_GRAPHS=0 turns it off).

The host waits twice per batch: the sampler for its counts, and the end for the results.
The gather and the model run without a wait between them; stage times come from CUDA
events (pipelines/stage_clock.py), so they measure the device work, not launch time. The
results are copied for the unique seeds only and put in the request's order on the host.
On a CPU device the same code runs on CPU tensors and streams are no-ops (how CI and
`hybridgnn profile` without a GPU exercise it).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from hybridgnn.capabilities import DEVICE_GATE
from hybridgnn.features.store import CachedFeatureStore, gather_pending
from hybridgnn.graph.degrees import DeviceNodeDegrees
from hybridgnn.models.gnn import GNN
from hybridgnn.pipelines.graphed import model_forward
from hybridgnn.pipelines.host_results import HostResults
from hybridgnn.pipelines.stage_clock import StageClock
from hybridgnn.sampling.gpu import TorchSampler
from hybridgnn.types import BatchResult, StageTimings


class DeviceExecutor:
    """One worker's executor; the sampler is its own, the feature store and model shared."""

    def __init__(self, sampler: TorchSampler, features: CachedFeatureStore, model: GNN,
                 degrees: DeviceNodeDegrees | None = None):
        self.sampler = sampler
        self.degrees = degrees if model.gcn_normalised else None
        self.features = features
        self.model = model
        self.device = sampler.device
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            self._stream_ctx = lambda: torch.cuda.stream(self.stream)
            self._sync = self.stream.synchronize
        else:
            self.stream = None
            self._stream_ctx = contextlib.nullcontext
            self._sync = lambda: None
        self._gather_clock = StageClock(self.device)
        self._results = HostResults(pinned=self.device.type == "cuda")
        # Small batches replay CUDA graphs where enabled (pipelines/graphed.py).
        self.forward = model_forward(model, sampler.fanouts, self.device, self.stream)

    def run(self, seeds: np.ndarray, timings: StageTimings | None = None) -> BatchResult:
        t = timings if timings is not None else StageTimings()
        with DEVICE_GATE.work(), self._stream_ctx(), torch.inference_mode():  # no call while a graph records
            t0 = time.perf_counter()
            sub = self.sampler.sample(torch.from_numpy(np.ascontiguousarray(seeds, dtype=np.int64)))
            self._sync()
            t1 = time.perf_counter()
            self._gather_clock.start()  # timed by events: no wait between gather and model
            x, pending_tiers = gather_pending(self.features, sub.node_ids)
            self._gather_clock.stop()
            degrees = self.degrees.tensors(sub.node_ids) if self.degrees is not None else None
            out, hidden = self.forward(x, sub.edge_index, sub.num_sampled_nodes, sub.num_sampled_edges, degrees)
            # seeds from the host: the sampler kept their index there (TensorSubgraph)
            logits, emb, prd = self._results.answer(out, hidden, sub.num_sampled_nodes[0], sub.host_seed_index,
                                                    self._sync)
            t3 = time.perf_counter()
            gather_s = min(self._gather_clock.seconds(), t3 - t1)
            tiers = pending_tiers()  # on the worker's stream, whose work is done
        t.sample_s, t.gather_s, t.compute_s = t1 - t0, gather_s, t3 - t1 - gather_s
        return BatchResult(logits=logits, embeddings=emb, predictions=prd.astype(np.int64, copy=False), timings=t,
                           sampled_edges=sub.num_edges, gathered_rows=tiers)
