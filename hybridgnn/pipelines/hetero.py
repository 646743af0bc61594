"""A heterogeneous batch's execution: one typed sample for every query of the batch
(both ends of each pair, seeds and candidates of each top-k: the union of their
neighbourhoods), each type's feature rows gathered, the model's trimmed forward, then
each query's answer from its rows (outputs, or the link decoder's scores).

One TypedExecutor per worker thread: it owns its sampler (its id maps; a GPU worker's
sampler reads the typed CSR every worker of the device shares); the features, model and
decoder are shared read-only.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from hybridgnn.models.link import dot, scores_of
from hybridgnn.types import StageTimings, TypedQuery, TypedResult

# Pairs a user decoder scores at once in a top-k (dot products are one matrix product).
TOPK_CHUNK_PAIRS = 1 << 16
# Candidate rows a top-k scores at once (bounds the float32 copy of a float16 table).
TOPK_CHUNK_ROWS = 1 << 16


class TypedExecutor:
    def __init__(self, sampler, features: dict[str, np.ndarray], model, decoder, device: str = "cpu"):
        self.sampler = sampler
        self.features = features
        self.model = model
        self.decoder = decoder
        self.device = torch.device(device)

    def run(self, queries: list[TypedQuery], pipeline: str) -> list[TypedResult]:
        """Each query's answer, in order (one sample and one forward for all of them)."""
        t0 = time.perf_counter()
        parts: dict[str, list[np.ndarray]] = {}
        at: dict[str, int] = {}
        spans = []  # per query: [(type, start, stop)] of its seeds in the batch's per-type seeds
        for q in queries:
            span = []
            for t, ids in q.seeds():
                start = at.get(t, 0)
                parts.setdefault(t, []).append(ids)
                at[t] = start + len(ids)
                span.append((t, start, at[t]))
            spans.append(span)
        seeds = {t: np.concatenate(v) if len(v) > 1 else v[0] for t, v in parts.items()}
        sub = self.sampler.sample(seeds)
        t1 = time.perf_counter()
        dev = self.device
        x = {t: torch.from_numpy(np.take(self.features[t], ids, axis=0)).to(dev)
             for t, ids in sub.node_ids.items()}
        edges = {e: torch.from_numpy(ei).to(dev) for e, ei in sub.edge_index.items()}
        t2 = time.perf_counter()
        with torch.inference_mode():
            hidden, out = self.model.forward_sampled(x, edges, sub.num_sampled_nodes, sub.num_sampled_edges)
            local = {t: torch.from_numpy(sub.seed_index[t]).to(dev) for t in seeds}
            rows = {t: (hidden[t][local[t]], out[t][local[t]]) for t in seeds}
            answers = [self._answer(q, span, rows) for q, span in zip(queries, spans, strict=True)]
        t3 = time.perf_counter()
        timings = StageTimings(sample_s=t1 - t0, gather_s=t2 - t1, compute_s=t3 - t2)
        return [TypedResult(pipeline, timings, **a) for a in answers]

    def _answer(self, q: TypedQuery, span, rows) -> dict:
        (s, lo, hi), *rest = span
        src = rows[s][0][lo:hi], rows[s][1][lo:hi]
        if q.kind == "node":
            return answer_query(q, self.decoder, src, None)
        d, dlo, dhi = rest[0]
        return answer_query(q, self.decoder, src, rows[d][1][dlo:dhi])


class PrecomputedExecutor:
    """Typed queries answered from precomputed rows (embeddings/hetero.py): no sampling and
    no model, a gather of the rows the query names (for a top-k over a whole node type,
    that type's every output row) and the link decoder. Thread-safe (reads only)."""

    def __init__(self, store, decoder):
        self.decoder = decoder
        with warnings.catch_warnings():  # read-only memory-mapped rows, read only
            warnings.simplefilter("ignore", UserWarning)
            self._out = {t: torch.from_numpy(np.asarray(a)) for t, a in store.output.items()}
            self._last = {t: torch.from_numpy(np.asarray(store.last(t))) for t in store.output}

    def run(self, query: TypedQuery, with_embeddings: bool = True) -> TypedResult:
        t0 = time.perf_counter()
        src = torch.from_numpy(query.src_ids)
        z_src = self._out[query.src_type][src].float()
        h_src = self._last[query.src_type][src].float() if with_embeddings and query.kind == "node" else z_src
        z_dst = None
        if query.kind != "node":
            every = self._out[query.dst_type]
            # a whole type's rows stay as stored (top_k converts a chunk at a time)
            z_dst = every if query.whole_type else every[torch.from_numpy(query.dst_ids)].float()
        t1 = time.perf_counter()
        with torch.inference_mode():
            answer = answer_query(query, self.decoder, (h_src, z_src), z_dst)
        timings = StageTimings(gather_s=t1 - t0, compute_s=time.perf_counter() - t1)
        return TypedResult("precomputed", timings, **answer)

    def new_node_outputs(self, node_type: str, hidden: np.ndarray, logits: np.ndarray, dst_type: str | None,
                         k: int) -> dict:
        """Outputs of new nodes computed elsewhere (hidden rows and logits), and with k the
        top-k of every node of dst_type by the decoder's score against their logits."""
        none = np.zeros(0, np.int64)
        rows = torch.from_numpy(hidden), torch.from_numpy(logits)
        with torch.inference_mode():
            out = answer_query(TypedQuery("node", node_type, none), self.decoder, rows, None)
            if k:
                whole = TypedQuery("topk", node_type, none, dst_type, none, k, whole_type=True)
                out.update(answer_query(whole, self.decoder, rows, self._out[dst_type]))
        return out


def answer_query(q: TypedQuery, decoder, src: tuple[torch.Tensor, torch.Tensor], z_dst: torch.Tensor | None) -> dict:
    """One query's outputs from its rows: src = (last layer's rows, outputs) of its source
    ids; z_dst the outputs of its destinations or candidates (pairs and top-k)."""
    h_src, z_src = src
    if q.kind == "node":
        logits = z_src.float()
        return {"logits": _np(logits), "embeddings": _np(h_src.float()),
                "predictions": _np(logits.argmax(1)) if logits.shape[1] else np.zeros(len(logits), np.int64)}
    if q.kind == "pair":
        return {"scores": _np(scores_of(decoder, z_src, z_dst))}
    best, where = top_k(decoder, z_src, z_dst, q.k)
    return {"topk_index": _np(where), "topk_scores": _np(best)}


def top_k(decoder, z_src: torch.Tensor, z_dst: torch.Tensor, k: int,
          chunk_rows: int = TOPK_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, candidate positions) of each source's k best candidates, best first, over
    the candidates in chunks of rows: a float16 table of a whole node type is converted
    a chunk at a time, and the scores held are [n, k + chunk], never [n, every candidate]."""
    m = z_dst.shape[0]
    k = min(k, m)
    vals = idx = None
    for lo in range(0, m, max(chunk_rows, k)):
        block = z_dst[lo:lo + max(chunk_rows, k)].float()
        scores = all_pairs(decoder, z_src, block)
        v, i = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        i = i + lo
        if vals is not None:
            v, pick = torch.topk(torch.cat([vals, v], 1), k, dim=1)
            i = torch.gather(torch.cat([idx, i], 1), 1, pick)
        vals, idx = v, i
    return vals, idx


def all_pairs(decoder, z_src: torch.Tensor, z_dst: torch.Tensor) -> torch.Tensor:
    """Scores [n, m] of every (source, candidate)."""
    if decoder is dot:
        return (z_src.float() @ z_dst.float().t())
    n, m = z_src.shape[0], z_dst.shape[0]
    out = torch.empty((n, m), dtype=torch.float32, device=z_src.device)
    rows_per_chunk = max(1, TOPK_CHUNK_PAIRS // max(1, m))
    for lo in range(0, n, rows_per_chunk):
        block = z_src[lo:lo + rows_per_chunk]
        b = block.shape[0]
        out[lo:lo + b] = scores_of(decoder, block.repeat_interleave(m, 0), z_dst.repeat(b, 1)).view(b, m)
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
