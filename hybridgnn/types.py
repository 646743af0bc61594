"""Contracts passed between stages.

Plain dataclasses of numpy arrays / tensors; no stage reaches into another's internals.
Importing this module loads no torch (annotations only name it): the scheduler and the
--adapt helper process use these contracts and never touch a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

EdgeType = tuple[str, str, str]  # (source node type, relation, target node type), as PyG names them


class _SubgraphSize:
    """Sizes both subgraph layouts report the same way."""

    @property
    def num_nodes(self) -> int:
        return int(self.node_ids.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])


@dataclass
class SampledSubgraph(_SubgraphSize):
    """A K-hop sample around a set of seeds, in PyG's layout.

    node_ids holds unique global ids, the (deduplicated) seeds first, then the nodes first
    reached at hop 1, hop 2, ... ; num_sampled_nodes[k] counts the nodes of hop k (k=0: seeds).
    edge_index is local: edge_index[0] = source (the sampled neighbour), edge_index[1] =
    target (the node that aggregates), ordered by hop; num_sampled_edges[k-1] counts hop k's.
    seed_index maps each requested seed (duplicates allowed) to its local row.
    """

    node_ids: np.ndarray
    edge_index: np.ndarray
    num_sampled_nodes: np.ndarray
    num_sampled_edges: np.ndarray
    seed_index: np.ndarray

    def edge_index_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        import torch

        return torch.from_numpy(self.edge_index).to(device, non_blocking=True)


@dataclass
class TensorSubgraph(_SubgraphSize):
    """SampledSubgraph's fields as tensors on one device (counts stay on the host: the
    model's per-layer trimming needs them as Python ints). host_seed_index: seed_index on
    the host as well, where the sampler had it there (seeds from a request), so results
    can be put in the request's order without a gather on the device."""

    node_ids: torch.Tensor
    edge_index: torch.Tensor
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]
    seed_index: torch.Tensor
    host_seed_index: np.ndarray | None = None

    def edge_index_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return self.edge_index.to(device, non_blocking=True)

    def to_numpy(self) -> SampledSubgraph:
        return SampledSubgraph(
            node_ids=self.node_ids.cpu().numpy(), edge_index=self.edge_index.cpu().numpy(),
            num_sampled_nodes=np.asarray(self.num_sampled_nodes, dtype=np.int64),
            num_sampled_edges=np.asarray(self.num_sampled_edges, dtype=np.int64),
            seed_index=self.seed_index.cpu().numpy())


@dataclass
class TypedSampledSubgraph:
    """A K-hop sample of a heterogeneous graph, in PyG's HeteroData layout.

    Per node type t: node_ids[t] holds unique ids of type t, t's (deduplicated) seeds
    first, then the nodes first reached at hop 1, 2, ...; num_sampled_nodes[t][k] counts
    hop k's. Per edge type e = (s, rel, t): edge_index[e] is local, row 0 indexing
    node_ids[s] (the sampled neighbour) and row 1 node_ids[t] (the node that
    aggregates), ordered by hop; num_sampled_edges[e][k-1] counts hop k's. seed_index[t]
    maps each requested seed of type t (duplicates allowed) to its local row.
    """

    node_ids: dict[str, np.ndarray]
    edge_index: dict[EdgeType, np.ndarray]
    num_sampled_nodes: dict[str, np.ndarray]
    num_sampled_edges: dict[EdgeType, np.ndarray]
    seed_index: dict[str, np.ndarray]

    @property
    def num_nodes(self) -> int:
        return sum(int(v.shape[0]) for v in self.node_ids.values())



@dataclass
class TypedQuery:
    """One validated request to a heterogeneous model. kind "node": the outputs of
    src_ids (node type src_type); "pair": the score of each (src_ids[i], dst_ids[i]);
    "topk": for each src id, the k best of the candidates dst_ids (dst_type) by score
    (whole_type: the candidates are every node of dst_type, dst_ids = 0..n-1). Ids are
    internal (0..n-1 of their type)."""

    kind: str
    src_type: str
    src_ids: np.ndarray
    dst_type: str | None = None
    dst_ids: np.ndarray | None = None
    k: int = 0
    whole_type: bool = False

    def seeds(self) -> list[tuple[str, np.ndarray]]:
        """The nodes whose outputs the answer reads, by type (both ends for scores)."""
        if self.kind == "node":
            return [(self.src_type, self.src_ids)]
        return [(self.src_type, self.src_ids), (self.dst_type, self.dst_ids)]


@dataclass
class TypedNewNodes:
    """A validated new-node request to a heterogeneous model: q query nodes of node_type
    (features [q, F]) and, per edge type, local edges [2, m] (query node j is
    num_nodes(node_type) + j; reverse edge types already added), evaluated from the
    precomputed embeddings in `mode` (full, pe, srpe with gamma and policy). With k > 0
    the answer also ranks every node of dst_type by the link decoder's score."""

    node_type: str
    features: np.ndarray
    edges: dict[EdgeType, np.ndarray]
    mode: str = "srpe"
    gamma: float = 0.1
    policy: str = "ratio"
    dst_type: str | None = None
    k: int = 0


@dataclass
class TypedResult:
    """A heterogeneous request's answer: the outputs its kind has (others None), with the
    pipeline that produced them and the batch's stage times."""

    pipeline: str
    timings: StageTimings
    logits: np.ndarray | None = None  # node: the model's output rows
    embeddings: np.ndarray | None = None  # node: the last layer's rows (what a head reads)
    predictions: np.ndarray | None = None  # node: argmax of logits
    scores: np.ndarray | None = None  # pair: float32 [n]
    topk_index: np.ndarray | None = None  # topk: positions among the candidates [n, k] (best first)
    topk_scores: np.ndarray | None = None  # topk: float32 [n, k]
    @property
    def num_edges(self) -> int:
        return sum(int(v.shape[1]) for v in self.edge_index.values())


@dataclass
class StageTimings:
    """Seconds one batch spent in each pipeline stage."""

    queue_wait_s: float = 0.0
    sample_s: float = 0.0
    gather_s: float = 0.0
    compute_s: float = 0.0


@dataclass
class InferenceRequest:
    """One admitted request: its seeds and what to call with its answer.

    on_done(result, None) or on_done(None, error) is called exactly once, on the event
    loop, when the request is answered (by the engine, or by the batcher at shutdown)."""

    node_ids: np.ndarray
    on_done: Callable[[RequestResult | None, BaseException | None], None]
    arrival_s: float
    psgs: float = 0.0  # summed PSGS of its seeds (filled when the batcher bounds batch PSGS)
    predicted_wait_s: float = 0.0  # admission's model prediction of its wait (calibrated against the real one)
    waited_s: float = 0.0  # what it waited in the front end before arrival_s (its turn of the loop)


@dataclass
class Batch:
    """Requests merged by the batcher; seeds are their node ids concatenated in order."""

    requests: list[InferenceRequest]
    seeds: np.ndarray
    offsets: np.ndarray  # request r owns seeds[offsets[r]:offsets[r+1]]
    psgs: float
    closed_s: float
    submitted_s: float = 0.0

    @property
    def num_seeds(self) -> int:
        return int(self.seeds.shape[0])


@dataclass(frozen=True)
class RoutePlan:
    """The router's decision for one batch; pipelines execute it, the router never runs it."""

    pipeline: str
    batch_psgs: float
    reason: str  # "threshold" | "only" | "spill" | "fallback"


@dataclass
class BatchResult:
    """Per-seed outputs of one batch, row-aligned with Batch.seeds."""

    logits: np.ndarray  # float32 [n, out_dim]: the model's output
    predictions: np.ndarray  # int64 [n]: argmax of the logits
    timings: StageTimings = field(default_factory=StageTimings)
    sampled_edges: int = 0
    gathered_rows: dict[str, int] = field(default_factory=dict)  # feature tier -> rows read from it
    embeddings: np.ndarray | None = None  # float32 [n, hidden]: what the model's head reads
    # bool [n]: seeds a graph update had removed when the batch read the graph (None: none
    # were); their requests are answered as a read of a removed node, not with these rows
    removed: np.ndarray | None = None


@dataclass(frozen=True)
class QueueLoad:
    """A pipeline's load as the router sees it."""

    depth: int  # batches queued or running
    workers: int
    # a split CPU lane's batches handed to the GPU and not yet done: work on the device the
    # GPU lane uses, which the router counts as the GPU's
    on_device: int = 0


@dataclass
class RequestResult:
    """One request's answer rows, the pipeline that produced them and its stage times."""

    logits: np.ndarray  # the model's output
    embeddings: np.ndarray  # what the model's head reads (hidden representation)
    predictions: np.ndarray
    pipeline: str
    timings: StageTimings


@dataclass
class UpdateStats:
    """One applied batch of graph updates, as the update applier reports it."""

    seconds: float  # the whole apply
    propagate_s: float | None  # embedding propagation (None: no embeddings kept fresh)
    affected_nodes: int
    counts: dict[str, int]  # updates by kind (add_edges, remove_nodes, ...)


@dataclass(frozen=True)
class EngineSnapshot:
    """An engine's state at one moment, as it publishes it (telemetry reads this, never
    the engine's internals): requests in flight and their cap, readiness, each pipeline's
    queued batches, the routing threshold and batch-PSGS bound in force, the policy's
    name, and graph-update progress (all 0 when updates are off)."""

    pending: int
    pending_capacity: int
    ready: bool
    queue_depths: dict[str, int]
    psgs_threshold: float
    max_batch_psgs: float
    policy: str
    graph_version: int = 0
    update_log_head: int = 0
    update_log_lag_s: float = 0.0
    update_follower_failing: bool = False
    update_staleness_s: float = 0.0
    graph_patched_entries: int = 0


class ServingStats:
    """What the serving engine, its API and update applier report as things happen: plain
    calls with plain values. This base records nothing; telemetry/ implements it as
    Prometheus series and reads the state it mirrors (pending, ready, queue depths, the
    policy's threshold) from the engine by callback, so nothing is kept in step by hand."""

    def watch(self, source: Callable[[], EngineSnapshot], pipelines: tuple[str, ...]) -> None:
        """Start mirroring an engine's state: `source()` is its snapshot now (called once,
        when the engine is built; pipelines: the names its snapshots report)."""

    def unwatch(self, source: Callable[[], EngineSnapshot]) -> None:
        """Stop mirroring that engine (a model version unloaded)."""

    def ready_from(self, ready: Callable[[], bool]) -> None:
        """Report readiness as `ready()` says (the serving API's own), not as every watched
        engine's snapshot does."""

    def forget_model(self, name: str, version: str) -> None:
        """Drop what is kept of a model version that is no longer served."""

    def for_model(self, name: str, version: str) -> ServingStats:
        """The stats of one model version of a repository (labelled with it, where kept)."""
        return self

    def batch_done(self, pipeline: str, timings: StageTimings, num_seeds: int, num_requests: int, psgs: float,
                   sampled_edges: int, gathered_rows: dict[str, int] | None) -> None:
        """A batch finished on `pipeline`."""

    def stage(self, stage: str, pipeline: str, seconds: float) -> None:
        """One request spent `seconds` in `stage` (batching, respond, total)."""

    def routed(self, pipeline: str, reason: str) -> None:
        """A batch went to `pipeline` because of `reason` (threshold, only, spill, fallback)."""

    def batch_failed(self, pipeline: str) -> None:
        """A batch failed on `pipeline`."""

    def refused(self, reason: str, count: int = 1) -> None:
        """`count` requests were refused before admission (overload, draining, behind, or
        grpc_call_cap: gRPC calls past the cap on those in flight; connection_cap: HTTP
        connections past --max-connections). A count of 0 makes the
        reason's series, at zero."""

    def answered(self, status: int, seeds: int = 0) -> None:
        """An inference request was answered with `status` (and `seeds` rows on success)."""

    def answered_elsewhere(self, pipeline: str, seconds: np.ndarray, respond_s: np.ndarray, seeds: int) -> None:
        """len(seconds) inference requests were answered 200 by a front-end process itself
        (precomputed lookups): stage total `seconds` and respond `respond_s` each, `seeds`
        rows in all; counted as answered() and stage() count the engine's own."""

    def policy_in_force(self, name: str, changed: bool) -> None:
        """The policy `name` is in force (changed: moved there by --adapt)."""

    def placement_refreshed(self) -> None:
        """The GPU feature cache was rebuilt from the counted requests."""

    def updates_applied(self, stats: UpdateStats) -> None:
        """A batch of graph updates was applied."""

    def updates_rejected(self) -> None:
        """A batch of graph updates was rejected whole."""

    def compacted(self) -> None:
        """The dynamic graph's patches were folded into its base CSR."""

    def frontends(self, source: Callable[[], dict[int, dict]]) -> None:
        """Mirror the server's front-end processes: source() maps each one's index to its
        last report (pid, connections, requests, cpu_s, rss_bytes, up, restarts), read at
        scrape time."""

    def exposition(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        return b"", "text/plain; version=0.0.4; charset=utf-8"


class PartitionRanks(Protocol):
    """The partition ranks a partitioned engine sends its requests to (serving/partitions.py
    implements it). start() brings them up and returns their description; call() runs one
    request on every rank and returns rank 0's answer (head, [logits, embeddings]),
    blocking, one at a time; it raises ServiceUnavailable while the group is down."""

    world: int
    info: dict
    up: bool
    why_down: str
    restarts: int
    generation: int  # groups formed so far (a call naming an older one is refused)
    prepare: Callable | None  # (call, hello) before each group formed serves (the update replay)

    def start(self) -> dict: ...

    def call(self, name: str, head: dict, arrays: tuple[np.ndarray, ...], *,
             generation: int | None = None) -> tuple[dict, list[np.ndarray]]: ...

    def close(self) -> None: ...

    def stalled_s(self) -> float:
        """How long the call on the ranks now (not an update's, which may run long) has
        waited for its answer; 0 when none waits."""
        ...
