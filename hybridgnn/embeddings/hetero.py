"""Layer-wise full-graph inference of a HeteroGNN (DGI per node type): layer by layer,
every target type in batches of rows, each batch reading its rows' in-edges of every edge
type into that type and the previous layer's rows of the source types.

Equals the model's forward over the whole graph (a test checks it to 1e-5): every
convolution takes the (all sources, batch targets) pair, so nothing depends on which
other rows share the batch. Memory: two layers' rows of every type.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridgnn.graph.csr import gather_rows
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.models.hetero import HeteroGNN


def _block(edge, lo: int, hi: int) -> torch.Tensor:
    """The in-edges of target rows [lo, hi) of one edge type as (global source, local
    target) pairs, vectorised over the CSR."""
    rows = np.arange(lo, hi)
    lens, sources = gather_rows(np.asarray(edge.indptr), np.asarray(edge.indices), rows)
    targets = np.repeat(np.arange(hi - lo), lens)
    return torch.from_numpy(np.stack([sources.astype(np.int64), targets]))


def hetero_layerwise(model: HeteroGNN, graph: HeteroGraphStore, *, batch_size: int = 16384,
                     progress: bool = False) -> dict[str, np.ndarray]:
    """Every node's output per node type (after the heads), float32 arrays [N_t, out_t]."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    missing = [t for t in model.node_types if t not in graph.nodes]
    if missing or [tuple(e) for e in model.edge_types if e not in graph.edges]:
        raise ValueError(f"the model's types do not match the graph's: model {model.node_types} / "
                         f"{model.edge_types}, graph {graph.node_types} / {graph.edge_types}")
    x = {t: torch.from_numpy(np.asarray(n.features)) for t, n in graph.nodes.items()}
    total = model.num_layers * sum(graph.num_nodes(t) for t in graph.node_types)
    bar = tqdm(total=total, unit="rows", desc="hetero layer-wise", disable=not progress)
    with torch.inference_mode():
        for i in range(model.num_layers):
            into = {t: [e for e in model.layer_edges[i] if e[2] == t] for t in graph.node_types}
            nxt = {}
            for t, edge_types in into.items():
                n = graph.num_nodes(t)
                if not edge_types:
                    bar.update(n)
                    continue  # a type no edge type of this layer reaches has no output (as in PyG)
                parts = []
                for lo in range(0, n, batch_size):
                    hi = min(n, lo + batch_size)
                    blocks = {e: _block(graph.edges[e], lo, hi) for e in edge_types}
                    parts.append(model.layer(i, x, blocks, x_dst={t: x[t][lo:hi]})[t])
                    bar.update(hi - lo)
                nxt[t] = torch.cat(parts) if parts else torch.empty(0)
            x = nxt
        out = model.head(x)
    bar.close()
    return {t: v.float().numpy() for t, v in out.items()}
