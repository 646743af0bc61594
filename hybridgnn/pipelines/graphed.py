"""A small batch's model forward as a CUDA graph replay: bucketed, padded shapes.

Why: a one-seed forward of a three-layer model is some fifty kernel launches and PyG's
Python around each layer. On a GPU those launches, not the arithmetic, set what a small
batch costs; a captured graph replays them in one call.

Shapes. A bucket is a seed count b (1, 2, 4, ... up to `max_seeds`). Its slots per hop are
the worst case the fanouts allow (hop k: b·f1·…·fk nodes and as many edges) plus one
dummy node per hop, so every sample of at most b seeds fits. A sample is laid out hop by
hop in its bucket's slots: hop k's nodes move to the start of hop k's node slots (local
ids shifted by one offset per hop), hop k's edges to the start of hop k's edge slots, and
the edge slots left over hold dummy edges from hop k's last node slot into hop k-1's (both
dummies). A real target then receives only its real edges and reads only real rows, so
its output is the unpadded sample's (up to the rounding of matrix products over more
rows); dummy rows hold whatever they held and are never read. The layout is one small
host-to-device copy of the per-hop offsets, then one kernel launch on a GPU with CuPy
(pipelines/cuda_lay_out.py; HYBRIDGNN_CUDA_LAYOUT=0 turns it off), else a few
vectorised ops (bucketize, index_copy, one copy of the dummy edges); no host waits.

Which models: built-in GraphSAGE (`capturable`). A forward that waits on the device
(GAT's and GCN's self-loop handling, data-dependent shapes) cannot be captured, and a
failed capture leaves torch's allocator in a bad state, so nothing else is tried. If a
capture fails all the same, no further one is tried in that worker (logged once). The
first replay of each bucket is compared with the eager forward of the batch that made
it; a mismatch retires the bucket. That batch is answered by the eager forward.

Captures exclude every other device call of the process (capabilities.DEVICE_GATE): the
executors make theirs inside DEVICE_GATE.work(), and a capture waits until no thread is
inside one and holds the rest out while it runs. The H200 showed why: a capture in
thread-local mode still failed while a server's other lanes were launching.

One GraphedForward per worker (its static buffers are that worker's), used by one thread
at a time on the worker's stream. On by default on a CUDA device since an H200 measured it
(a one-seed GPU-lane batch 0.68x eager) and served both lanes with it;
HYBRIDGNN_CUDA_GRAPHS=0 turns it off, HYBRIDGNN_CUDA_GRAPH_SEEDS sets max_seeds (default
64). On a CPU device the same padding and bookkeeping run with an eager "capture" (tests
inject it), which is how CI checks them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch_geometric.nn import MessagePassing, SAGEConv

from hybridgnn.capabilities import DEVICE_GATE
from hybridgnn.models.gnn import GNN
from hybridgnn.pipelines import cuda_lay_out

log = logging.getLogger(__name__)

_SENTINEL = torch.iinfo(torch.int64).max  # a bound past every local id
MAX_SLOTS = 1 << 18  # a bucket needing more node slots than this runs eagerly (its buffers and graph memory)


@dataclass(frozen=True)
class BucketShape:
    """Slots of one bucket: nodes per hop (seeds first, each with one dummy slot past the
    worst case) and edges per hop (hops 1..L)."""

    seeds: int
    nodes: tuple[int, ...]
    edges: tuple[int, ...]

    @classmethod
    def worst_case(cls, seeds: int, fanouts: Sequence[int]) -> BucketShape:
        nodes, edges, reach = [seeds + 1], [], seeds
        for f in fanouts:
            reach *= f
            nodes.append(reach + 1)
            edges.append(reach)
        return cls(seeds, tuple(nodes), tuple(edges))

    @property
    def slots(self) -> int:
        """Node slots (rows of the bucket's buffers)."""
        return sum(self.nodes)

    def fits(self, nodes_per_hop: Sequence[int], edges_per_hop: Sequence[int]) -> bool:
        """Whether a sample's counts fit, a dummy node slot left in every hop."""
        return (len(nodes_per_hop) == len(self.nodes) and len(edges_per_hop) == len(self.edges)
                and all(n < cap for n, cap in zip(nodes_per_hop, self.nodes, strict=True))
                and all(e <= cap for e, cap in zip(edges_per_hop, self.edges, strict=True)))


def bucket_seeds(seeds: int, max_seeds: int) -> int | None:
    """The bucket (a power of two) of a batch of `seeds` unique seeds, or None past max_seeds."""
    if seeds < 1 or seeds > max_seeds:
        return None
    return 1 << (seeds - 1).bit_length()


class _Bucket:
    """Static buffers of one bucket and its replay (None until captured)."""

    def __init__(self, shape: BucketShape, width: int, dtype: torch.dtype, device: torch.device):
        self.shape = shape
        self.node_starts = starts = list(accumulate(shape.nodes, initial=0))  # where each hop begins; the total
        self.edge_starts = estarts = list(accumulate(shape.edges, initial=0))
        self.x = torch.zeros((starts[-1], width), dtype=dtype, device=device)
        # Hop k's unused edge slots: its last node slot -> hop k-1's last node slot.
        dummy = torch.empty((2, estarts[-1]), dtype=torch.int64, device=device)
        for k, e in enumerate(shape.edges, start=1):
            dummy[0, estarts[k - 1]:estarts[k - 1] + e] = starts[k + 1] - 1
            dummy[1, estarts[k - 1]:estarts[k - 1] + e] = starts[k] - 1
        self.dummy_edges = dummy
        self.edge_index = dummy.clone()
        self.replay: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
        self.retired = False

    def forward(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on the static buffers, every slot counted."""
        return model(self.x, self.edge_index, list(self.shape.nodes), list(self.shape.edges), None,
                     with_embeddings=True)


def cuda_graph_capture(stream: torch.cuda.Stream | None):
    """A capture function for CUDA: records fn's kernels on `stream` (the worker's) into a
    graph; other threads may keep launching meanwhile (thread-local capture mode). A
    worker's graphs share one memory pool: they replay one at a time on its stream, and
    each replay's outputs are read before the next."""
    pool = []

    def capture(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        if not pool:
            pool.append(torch.cuda.graph_pool_handle())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool[0], capture_error_mode="thread_local")
            try:
                outs = fn()
            except BaseException:
                try:  # end the capture; its own error ("a previous error during capture") would hide fn's
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - fn's error is the one raised
                    pass
                raise
            graph.capture_end()

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()
            return outs

        return replay

    return capture


def capturable(model) -> bool:
    """Models whose forward is known to launch kernels only (no host waits): built-in
    GraphSAGE. A failed capture leaves torch's allocator (up to at least 2.11) believing a
    capture is still under way, so graphs are never tried on anything else: GAT and GCN
    synchronise (self-loop removal), and a user's own modules may."""
    return (isinstance(model, GNN) and model.spec.kind == "sage"
            and all(isinstance(m, SAGEConv) for m in model.modules() if isinstance(m, MessagePassing)))


class GraphedForward:
    """The model's forward (x, edge_index, nodes per hop, edges per hop, degrees) ->
    (rows, embeddings), whose rows begin with the seeds': replayed from a CUDA graph where
    the module docstring says it can be, else the model's own forward."""

    def __init__(self, model, fanouts: Sequence[int], device: torch.device | str, *, max_seeds: int = 64,
                 max_slots: int = MAX_SLOTS, capture: Callable | None = None,
                 stream: torch.cuda.Stream | None = None, any_model: bool = False):
        """any_model: try graphs on a model `capturable` does not know (tests of the
        padding with an eager capture)."""
        self.model = model
        self.fanouts = tuple(int(f) for f in fanouts)
        self.device = torch.device(device)
        self.max_seeds = max_seeds
        self.max_slots = max_slots
        self.layers = getattr(model, "num_layers", None)
        # Graphs need bounded samples of exactly the model's depth.
        self.usable = (max_seeds >= 1 and self.layers == len(self.fanouts) and all(f > 0 for f in self.fanouts)
                       and (any_model or capturable(model)))
        self._capture = capture if capture is not None else cuda_graph_capture(stream)
        self._buckets: dict[int, _Bucket] = {}
        self._reasons: set[str] = set()  # why buckets were retired (each logged once)
        cuda = self.device.type == "cuda"
        layers = len(self.fanouts)
        self._offsets_host = torch.zeros(4 * layers + 6, dtype=torch.int64, pin_memory=cuda)
        # empty, not zeros: a fill would run on this thread's stream, unordered with the worker's
        self._offsets = torch.empty(4 * layers + 6, dtype=torch.int64, device=self.device)
        self._layout_kernel = cuda_lay_out.available(self.device)  # one launch instead of the torch ops
        self._copied = torch.cuda.Event() if cuda else None  # the host offsets may be rewritten once set
        self._arange = torch.arange(0, dtype=torch.int64, device=self.device)
        self.replays = 0
        self.eager = 0

    def __call__(self, x: torch.Tensor, edge_index: torch.Tensor, nodes_per_hop: Sequence[int],
                 edges_per_hop: Sequence[int], degrees=None) -> tuple[torch.Tensor, torch.Tensor]:
        nodes, edges = [int(n) for n in nodes_per_hop], [int(e) for e in edges_per_hop]
        b = bucket_seeds(nodes[0], self.max_seeds) if self.usable and degrees is None and nodes else None
        bucket = self._bucket(b, x) if b is not None else None
        if bucket is None or bucket.retired or not bucket.shape.fits(nodes, edges):
            return self._eager(x, edge_index, nodes, edges, degrees)
        self._lay_out(bucket, x, edge_index, nodes, edges)
        if bucket.replay is None:
            return self._first(bucket, x, edge_index, nodes, edges)
        self.replays += 1
        return bucket.replay()

    def _eager(self, x, edge_index, nodes, edges, degrees):
        self.eager += 1
        return self.model(x, edge_index, nodes, edges, degrees, with_embeddings=True)

    def _bucket(self, b: int, x: torch.Tensor) -> _Bucket | None:
        if x.dim() != 2:
            return None
        bucket = self._buckets.get(b)
        if bucket is None:
            shape = BucketShape.worst_case(b, self.fanouts)
            if shape.slots > self.max_slots:
                return None
            bucket = self._buckets[b] = _Bucket(shape, x.shape[1], x.dtype, self.device)
        if x.dtype != bucket.x.dtype or x.shape[1] != bucket.x.shape[1]:
            return None
        return bucket

    def _lay_out(self, bucket: _Bucket, x: torch.Tensor, edge_index: torch.Tensor, nodes: list[int],
                 edges: list[int]) -> None:
        """Write a sample into the bucket's static buffers (module docstring)."""
        layers = len(edges)
        starts, estarts = bucket.node_starts, bucket.edge_starts
        real, ereal = list(accumulate(nodes, initial=0)), list(accumulate(edges, initial=0))
        if self._layout_kernel:
            plan = self._stage(cuda_lay_out.plan(nodes, edges, starts, estarts))
            try:
                cuda_lay_out.lay_out(x, edge_index, plan, layers, real[-1], bucket.x, bucket.edge_index)
                return
            except Exception as exc:  # noqa: BLE001 - it cannot run (a compiler error, say): the torch ops can
                self._layout_kernel = False
                log.warning("the one-launch bucket lay-out failed (%s: %s); this worker lays batches out with "
                            "torch ops", type(exc).__name__, str(exc)[:200])
        # Per hop: where its real nodes begin (bounds for bucketize) and how far they move;
        # the same for edges. A sentinel closes each list of bounds.
        dev = self._stage([*real[1:layers + 1], _SENTINEL] + [starts[k] - real[k] for k in range(layers + 1)]
                          + [*ereal[1:layers], _SENTINEL] + [estarts[k] - ereal[k] for k in range(layers)])
        bounds, shift = dev[:layers + 1], dev[layers + 1:2 * layers + 2]
        ebounds, eshift = dev[2 * layers + 2:3 * layers + 2], dev[3 * layers + 2:]
        total, etotal = real[-1], ereal[-1]
        rows = self._ids(max(total, etotal))
        node_rows = rows[:total]
        bucket.x.index_copy_(0, node_rows + shift[torch.bucketize(node_rows, bounds, right=True)], x[:total])
        local = edge_index[:, :etotal].contiguous()  # a view of a staging buffer is not (the split lane on CPU)
        moved = local + shift[torch.bucketize(local, bounds, right=True)]
        edge_rows = rows[:etotal]
        bucket.edge_index.copy_(bucket.dummy_edges)
        bucket.edge_index.index_copy_(1, edge_rows + eshift[torch.bucketize(edge_rows, ebounds, right=True)], moved)

    def _stage(self, values: list[int]) -> torch.Tensor:
        """values on the device, copied from the reused pinned buffer (no tensor made per batch)."""
        n = len(values)
        if self._copied is not None:
            self._copied.synchronize()  # the last batch's copy has read the host buffer
        self._offsets_host.numpy()[:n] = values
        dev = self._offsets[:n]
        dev.copy_(self._offsets_host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return dev

    def _ids(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), dtype=torch.int64, device=self.device)
        return self._arange

    def _first(self, bucket: _Bucket, x, edge_index, nodes, edges):
        """Capture a bucket on its first batch, check one replay against that batch's eager
        forward, and answer the batch eagerly."""
        want = self._eager(x, edge_index, nodes, edges, None)
        seeds = nodes[0]
        try:
            with DEVICE_GATE.capture():
                bucket.forward(self.model)  # once outside the capture: lazy initialisation, workspaces
                replay = self._capture(lambda: bucket.forward(self.model))
            got = replay()
            same = all(torch.allclose(g[:seeds].float(), w[:seeds].float(), rtol=1e-4, atol=1e-5)
                       for g, w in zip(got, want, strict=True))
        except Exception as exc:  # a forward that cannot be captured: no bucket is tried again
            self.usable = False
            self._retire(bucket, f"capture failed ({type(exc).__name__}: {str(exc)[:160]})")
            return want
        if not same:
            self._retire(bucket, "a replay differed from the eager forward")
            return want
        bucket.replay = replay
        log.info("CUDA graph captured for batches of up to %d seeds (%d node slots)", bucket.shape.seeds,
                 bucket.node_starts[-1])
        return want

    def _retire(self, bucket: _Bucket, reason: str) -> None:
        bucket.retired = True
        if reason not in self._reasons:
            self._reasons.add(reason)
            log.warning("model forward of %d-seed batches runs without a CUDA graph: %s", bucket.shape.seeds, reason)

    @property
    def captured(self) -> list[int]:
        """Buckets (seed counts) replayed from a graph."""
        return sorted(b for b, bucket in self._buckets.items() if bucket.replay is not None)  # never set if retired


def model_forward(model, fanouts: Sequence[int], device: torch.device | str,
                  stream: torch.cuda.Stream | None = None):
    """The forward a worker calls: a GraphedForward on a CUDA device (unless
    HYBRIDGNN_CUDA_GRAPHS=0), else the model's own (same signature)."""
    device = torch.device(device)
    if device.type == "cuda" and os.environ.get("HYBRIDGNN_CUDA_GRAPHS", "1") != "0":
        max_seeds = int(os.environ.get("HYBRIDGNN_CUDA_GRAPH_SEEDS", "64"))
        return GraphedForward(model, fanouts, device, max_seeds=max_seeds, stream=stream)

    def eager(x, edge_index, nodes_per_hop, edges_per_hop, degrees=None):
        return model(x, edge_index, nodes_per_hop, edges_per_hop, degrees, with_embeddings=True)

    return eager

