"""Feature placement plans: which tier, server and GPU holds each node's feature row
(Quiver §5.2, docs/architecture.md), plus the baselines it is compared with.

FAP plan (Quiver), nodes in descending FAP order, capacities in rows
(N_g per GPU, N_m host and N_d disk per server; G/C GPUs per NVLink clique):
  across servers  with InfiniBand the hottest S·(G/C·N_g + N_m) rows are partitioned
                  across the S servers (FAP-balanced), and so is the rest, on disk; memory
                  the partition leaves spare replicates the very hottest rows on every
                  server (R·S + (N - R) ≤ S·(G/C·N_g + N_m)); over
                  Ethernet the hottest G/C·N_g + N_m are replicated on every server and the
                  rest goes to each server's disk (partitioned only if one disk cannot
                  hold it).
  in a server     its GPU rows are partitioned across the GPUs of a clique
                  (FAP-balanced) and replicated in every clique; without NVLink a clique
                  is one GPU, so the hottest N_g rows sit on every GPU. Then host (pinned,
                  read zero-copy), then disk (memory-mapped).
Baselines with the same capacities: hash (DGL's default: hash-partitioned across servers,
each server filling its tiers in hash order), degree (PaGraph/BGL: highest-degree rows
replicated on every GPU and server), importance (AliGraph-like: 2-hop in-degree
importance; the most important 20 % of the cache replicated on every server, the rest
hash-partitioned).

A plan is a lookup table node -> (tier, server, clique, gpu, row): server -1 means every
server, clique -1 every NVLink clique of a server, gpu -1 every GPU of the clique(s) and
k the k-th GPU of a clique; row is the row in that store. Capacities always hold
(checked on construction).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridgnn.features.topology import Topology
from hybridgnn.graph.store import load_arrays

GPU, HOST, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "host", "disk")
METHODS = ("fap", "hash", "degree", "importance")
EVERY = -1
PLAN_ARRAYS = ("tier", "server", "clique", "gpu", "row")  # <name>.npy each, beside plan.json


def snake(count: int, bins: int) -> np.ndarray:
    """Bin of each of `count` items taken in descending weight, dealt back and forth
    (0,1,..,k-1,k-1,..,0,...): every bin gets a near-equal share of the weight."""
    return snake_at(np.arange(count), bins)


def snake_at(i: np.ndarray, bins: int) -> np.ndarray:
    """snake's bin of the items at positions i. Each run of `bins` items from a multiple of
    bins deals one to every bin, so item i is the (i // bins)-th its bin gets."""
    pos = i % bins
    return np.where((i // bins) % 2 == 0, pos, bins - 1 - pos).astype(np.int16)


@dataclass
class Plan:
    topology: Topology
    method: str
    row_bytes: int
    tier: np.ndarray  # int8
    server: np.ndarray  # int16; -1: replicated on every server
    clique: np.ndarray  # int16; -1: in every clique of the server (and for host/disk)
    gpu: np.ndarray  # int16; -1: on every GPU of the clique(s); k: the k-th GPU of the clique
    row: np.ndarray  # int64: row within its (tier, server, clique, gpu) store
    # what `hybridgnn place` made it for (dataset_fingerprint, fanouts, seeds), for whoever
    # serves it to check; empty in a plan saved before it was recorded
    made_for: dict = field(default_factory=dict)

    def __post_init__(self):
        self.check_arrays()
        self.check_capacities()

    def check_arrays(self) -> None:
        """ValueError unless the per-row arrays are what a plan holds: one integer entry per
        node each, tiers 0..2, servers, cliques and GPUs within the topology (or -1: every
        one) and rows >= 0. A plan read from disk is indexed with them."""
        t = self.topology
        if isinstance(self.row_bytes, bool) or not isinstance(self.row_bytes, (int, np.integer)) \
                or self.row_bytes < 1:
            raise ValueError(f"row_bytes must be a whole number >= 1, got {self.row_bytes!r}")
        arrays = {"tier": self.tier, "server": self.server, "clique": self.clique, "gpu": self.gpu, "row": self.row}
        for name, a in arrays.items():
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
                raise ValueError(f"a plan's {name} must be a 1-D integer array, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {np.shape(a)}")
        lengths = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"a plan's arrays must have one entry per node each, got lengths {lengths}")
        n = lengths["tier"]
        for name, lo, hi in (("tier", GPU, DISK), ("server", EVERY, t.servers - 1),
                             ("clique", EVERY, max(t.nvlink_cliques, 1) - 1),
                             ("gpu", EVERY, max(t.gpus_per_clique, 1) - 1)):
            a = arrays[name]
            if n and (int(a.min()) < lo or int(a.max()) > hi):
                raise ValueError(f"a plan's {name} values must lie in [{lo}, {hi}] for its topology "
                                 f"({t.describe()}), found [{int(a.min())}, {int(a.max())}]")
        if n and int(self.row.min()) < 0:
            raise ValueError(f"a plan's row values must be >= 0, found {int(self.row.min())}")

    @property
    def num_nodes(self) -> int:
        return int(self.tier.shape[0])

    def capacities(self) -> dict[str, int]:
        t, rb = self.topology, self.row_bytes
        return {"gpu": t.gpu_memory_bytes // rb if t.gpus_per_server else 0,
                "host": t.host_memory_bytes // rb, "disk": t.disk_bytes // rb}

    def check_capacities(self) -> None:
        cap = self.capacities()
        t = self.topology
        if t.gpus_per_server == 0 and bool((self.tier == GPU).any()):
            raise ValueError(f"{self.method} plan puts rows on GPUs, but the topology has none")
        every = self.server == EVERY

        def per_server(sel: np.ndarray) -> tuple[int, int]:
            """(server, rows of sel it holds: its own and every server's) for the fullest
            server: one pass over the rows, not one per server."""
            own = np.bincount(self.server[sel & ~every].astype(np.int64), minlength=t.servers)
            counts = own + int((sel & every).sum())
            s = int(np.argmax(counts))
            return s, int(counts[s])

        for tier, name in enumerate(TIER_NAMES):
            sel = self.tier == tier
            if tier == GPU:
                for c in range(t.nvlink_cliques):
                    in_c = sel & ((self.clique == c) | (self.clique == EVERY))
                    for k in range(t.gpus_per_clique):
                        s, n = per_server(in_c & ((self.gpu == k) | (self.gpu == EVERY)))
                        if n > cap["gpu"]:
                            raise ValueError(f"{self.method} plan puts {n} rows on GPU {k} of clique {c} of "
                                             f"server {s}, capacity {cap['gpu']}")
            else:
                s, n = per_server(sel)
                if n > cap[name]:
                    raise ValueError(f"{self.method} plan puts {n} rows in {name} of server {s}, capacity {cap[name]}")

    def summary(self, fap: np.ndarray) -> list[dict]:
        """Per tier: distinct nodes, FAP mass share (expected share of reads it serves),
        bytes of one copy and bytes over all copies (replication included)."""
        fap = np.asarray(fap, dtype=np.float64)
        total = fap.sum() or 1.0
        t = self.topology
        out = []
        for tier, name in enumerate(TIER_NAMES):
            sel = self.tier == tier
            copies_server = np.where(self.server[sel] == EVERY, t.servers, 1)
            copies_gpu = (np.where(self.clique[sel] == EVERY, t.nvlink_cliques, 1)
                          * np.where(self.gpu[sel] == EVERY, t.gpus_per_clique, 1) if tier == GPU else 1)
            copies = copies_server * copies_gpu
            out.append({"tier": name, "nodes": int(sel.sum()), "fap_share": float(fap[sel].sum() / total),
                        "bytes": int(sel.sum()) * self.row_bytes,
                        "bytes_all_copies": int(np.sum(copies)) * self.row_bytes})
        return out

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name in PLAN_ARRAYS:
            np.save(d / f"{name}.npy", getattr(self, name))
        (d / "plan.json").write_text(json.dumps({"method": self.method, "row_bytes": self.row_bytes,
                                                 "topology": self.topology.to_dict(),
                                                 **({"made_for": self.made_for} if self.made_for else {})},
                                                indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> Plan:
        """The plan `save` wrote to directory; ValueError (OSError for a missing file) in one
        line when it is not one."""
        d = Path(directory)
        try:
            meta = json.loads((d / "plan.json").read_text())
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
            raise ValueError(f"plan.json is not valid JSON: {exc}") from exc
        try:
            topo = Topology.from_dict({k: v for k, v in meta["topology"].items() if k != "source"}, source="plan")
            method, row_bytes = str(meta["method"]), meta["row_bytes"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"plan.json is not a `hybridgnn place` plan ({type(exc).__name__}: {exc})") from exc
        arrays = {n: load_arrays(d / f"{n}.npy") for n in PLAN_ARRAYS}
        made_for = meta.get("made_for")
        return cls(topo, method, row_bytes, **arrays, made_for=made_for if isinstance(made_for, dict) else {})


def holds_only_a_plan(directory: str | Path) -> bool:
    """Whether a directory holds a saved plan and nothing else: Plan.save's files and the
    disk-tier copies a server writes beside them (disk-server<i>-<rows>.npy and .source, and
    the hidden temporaries of a server killed while writing one)."""
    d = Path(directory)
    names = {f"{n}.npy" for n in PLAN_ARRAYS} | {"plan.json"}
    return (d / "plan.json").is_file() and all(p.name in names or p.name.removeprefix(".").startswith("disk-server")
                                               for p in d.iterdir())


def _rows_within_groups(*keys: np.ndarray) -> np.ndarray:
    """0,1,2,... in array order within each group of equal keys (a store's row numbers)."""
    n = keys[0].shape[0]
    combined = np.zeros(n, dtype=np.int64)
    for k in keys:
        k = k.astype(np.int64)
        combined = combined * (int(k.max()) - int(k.min()) + 2 if n else 1) + (k - (int(k.min()) if n else 0))
    order = np.argsort(combined, kind="stable")
    sorted_keys = combined[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_keys)) + 1] if n else np.zeros(0, np.int64)
    first = np.repeat(starts, np.diff(np.r_[starts, n])) if n else starts
    rows = np.empty(n, dtype=np.int64)
    rows[order] = np.arange(n) - first
    return rows


class _Builder:
    """Assign nodes, in a given order, to tiers/servers/GPUs under the capacities."""

    def __init__(self, num_nodes: int, topo: Topology, row_bytes: int):
        if row_bytes < 1:
            raise ValueError(f"row_bytes must be >= 1, got {row_bytes}")
        self.topo, self.row_bytes = topo, row_bytes
        self.tier = np.full(num_nodes, DISK, dtype=np.int8)
        self.server = np.full(num_nodes, EVERY, dtype=np.int16)
        self.clique = np.full(num_nodes, EVERY, dtype=np.int16)
        self.gpu = np.full(num_nodes, EVERY, dtype=np.int16)
        self.n_gpu = (topo.gpu_memory_bytes // row_bytes) if topo.gpus_per_server else 0
        self.n_host = topo.host_memory_bytes // row_bytes
        self.n_disk = topo.disk_bytes // row_bytes

    def gpu_rows(self, nodes: np.ndarray, servers: np.ndarray | int, partition_in_clique: bool = True) -> None:
        """nodes (hottest first) go to the GPU tier; within each server they are dealt across
        a clique's GPUs (or replicated on every GPU when partition_in_clique is False)."""
        self.tier[nodes] = GPU
        self.server[nodes] = servers
        self.clique[nodes] = EVERY  # replicated in every clique
        if not partition_in_clique or self.topo.gpus_per_clique <= 1:
            self.gpu[nodes] = EVERY
            return
        srv = np.broadcast_to(np.asarray(servers), nodes.shape)
        for s in np.unique(srv):
            mine = nodes[srv == s]
            self.gpu[mine] = snake(mine.size, self.topo.gpus_per_clique)

    def host_rows(self, nodes: np.ndarray, servers) -> None:
        self.tier[nodes] = HOST
        self.server[nodes] = servers
        self.clique[nodes] = EVERY
        self.gpu[nodes] = EVERY

    def disk_rows(self, nodes: np.ndarray, partition: bool = False) -> None:
        """The rest on disk: partitioned across servers when asked (a fast network reads the
        servers' disks in parallel) or when one disk cannot hold it, else replicated."""
        self.tier[nodes] = DISK
        self.clique[nodes] = EVERY
        self.gpu[nodes] = EVERY
        if nodes.size <= self.n_disk and not (partition and self.topo.servers > 1):
            self.server[nodes] = EVERY
            return
        s = self.topo.servers
        if nodes.size > s * self.n_disk:
            raise ValueError(f"{nodes.size} rows do not fit: {s} servers × {self.n_disk} rows of disk")
        self.server[nodes] = snake(nodes.size, s)

    def build(self, method: str) -> Plan:
        row = _rows_within_groups(self.tier, self.server, self.clique, self.gpu)
        return Plan(self.topo, method, self.row_bytes, self.tier, self.server, self.clique, self.gpu, row)


def _per_server_quota(b: _Builder) -> int:
    return (b.n_gpu * max(1, b.topo.gpus_per_clique) if b.topo.gpus_per_server else 0)


def fap_plan(fap: np.ndarray, topo: Topology, row_bytes: int, *, balance_links: bool = True) -> Plan:
    """Quiver's plan; with InfiniBand and memory to spare, the share of it spent on
    replicating the hottest rows is chosen (balance_links) so that the expected bytes on
    the slowest of the parallel paths (local PCIe, the network, ...) are smallest."""
    fap = np.asarray(fap, dtype=np.float64)
    order = np.argsort(-fap, kind="stable")
    probe = _Builder(order.size, topo, row_bytes)
    in_memory = _per_server_quota(probe) + probe.n_host
    if topo.servers > 1 and topo.fast_network:
        spare = topo.servers * in_memory - order.size
        most = max(0, min(in_memory, spare // (topo.servers - 1)))
        if balance_links and most > 0:
            from hybridgnn.features.simulate import expected_path_seconds

            # in exact integers: memory past int64's range in rows (a topology of 1e30 bytes)
            # made np.linspace an object array and planning a ufunc traceback
            candidates = sorted({most * i // 8 for i in range(9)})
            plans = [_fap_plan(order, topo, row_bytes, r) for r in candidates]
            return min(plans, key=lambda p: max(expected_path_seconds(p, fap).values()))
        return _fap_plan(order, topo, row_bytes, most)
    return _fap_plan(order, topo, row_bytes, in_memory)


def _fap_plan(order: np.ndarray, topo: Topology, row_bytes: int, replicate: int) -> Plan:
    """The hottest `replicate` rows on every server; with a fast network the rest of the
    memory partitioned across servers, FAP-balanced; then disk."""
    b = _Builder(order.size, topo, row_bytes)
    S, per_gpu_tier = topo.servers, _per_server_quota(b)
    in_memory = per_gpu_tier + b.n_host  # distinct rows one server holds in GPU and host memory
    replicated = order[:replicate]
    rest = order[replicated.size:]
    shared_quota = in_memory - replicated.size
    partitioned = rest[:S * shared_quota] if topo.fast_network else rest[:0]
    owner = snake(partitioned.size, S)
    # Each server's memory holds the replicated rows, then its partition, hottest first: a
    # row's place there is its index among the replicated rows, or R + its index // S among
    # the partitioned ones (snake_at). The first per_gpu_tier places are GPU rows, dealt over
    # a clique's GPUs by place, the rest host rows. One pass over the rows, not one per
    # server (4096 servers took minutes).
    nodes = np.concatenate([replicated, partitioned])
    place = np.concatenate([np.arange(replicated.size), replicated.size + np.arange(partitioned.size) // S])
    on_gpu = place < per_gpu_tier
    hot = nodes[on_gpu]
    b.tier[hot], b.clique[hot] = GPU, EVERY
    b.gpu[hot] = snake_at(place[on_gpu], topo.gpus_per_clique) if topo.gpus_per_clique > 1 else EVERY
    b.host_rows(nodes[~on_gpu], EVERY)
    b.server[partitioned] = owner
    b.disk_rows(rest[partitioned.size:], partition=topo.fast_network)
    return b.build("fap")


def hash_plan(num_nodes: int, topo: Topology, row_bytes: int, seed: int = 0) -> Plan:
    """DGL's default: each node lives on server hash(n) % S, and each server fills its GPUs
    (partitioned across all of them), host and disk in hash order; nothing replicated."""
    b = _Builder(num_nodes, topo, row_bytes)
    order = np.random.default_rng(seed).permutation(num_nodes)
    S = topo.servers
    owner = (order % S).astype(np.int16)
    gpus_total = max(1, topo.gpus_per_server)
    for s in range(S):
        mine = order[owner == s]
        n_gpu = b.n_gpu * gpus_total if topo.gpus_per_server else 0
        hot, warm = mine[:n_gpu], mine[n_gpu:n_gpu + b.n_host]
        b.tier[hot], b.server[hot] = GPU, s
        # one GPU of the server per row, none replicated
        which = np.arange(hot.size) % gpus_total
        per_clique = max(1, topo.gpus_per_clique)
        b.clique[hot] = (which // per_clique).astype(np.int16)
        b.gpu[hot] = (which % per_clique).astype(np.int16)
        b.host_rows(warm, s)
        cold = mine[hot.size + warm.size:]
        b.tier[cold], b.server[cold], b.clique[cold], b.gpu[cold] = DISK, s, EVERY, EVERY
    plan = b.build("hash")
    return plan


def degree_plan(degrees: np.ndarray, topo: Topology, row_bytes: int) -> Plan:
    """PaGraph/BGL: highest-degree rows replicated on every GPU, then host; replicated on
    every server (locality first, whatever the network)."""
    order = np.argsort(-np.asarray(degrees, dtype=np.float64), kind="stable")
    b = _Builder(order.size, topo, row_bytes)
    hot = order[:b.n_gpu]
    b.gpu_rows(hot, EVERY, partition_in_clique=False)
    warm = order[hot.size:hot.size + b.n_host]
    b.host_rows(warm, EVERY)
    b.disk_rows(order[hot.size + warm.size:])
    return b.build("degree")


def importance_plan(importance: np.ndarray, topo: Topology, row_bytes: int, replicate_share: float = 0.2) -> Plan:
    """AliGraph-like: nodes hash-partitioned across servers; each server caches the most
    important rows, the top replicate_share of its cache replicated on every server."""
    num_nodes = importance.shape[0]
    order = np.argsort(-np.asarray(importance, dtype=np.float64), kind="stable")
    b = _Builder(num_nodes, topo, row_bytes)
    S = topo.servers
    per_server = _per_server_quota(b) + b.n_host
    shared = order[:int(per_server * replicate_share)] if S > 1 else order[:0]
    rest = order[shared.size:]
    owner = (rest % S).astype(np.int16)
    per_gpu_tier = _per_server_quota(b)
    in_gpu = shared[:per_gpu_tier]
    for s in range(S):
        mine = rest[owner == s]
        gpu_free = per_gpu_tier - in_gpu.size
        host_free = b.n_host - (shared.size - in_gpu.size)
        hot, warm = mine[:gpu_free], mine[gpu_free:gpu_free + host_free]
        # the shared rows first, then this server's: one deal across the clique's GPUs
        both = np.concatenate([in_gpu, hot])
        slots = snake(both.size, max(1, topo.gpus_per_clique)) if topo.gpus_per_clique > 1 else \
            np.full(both.size, EVERY, np.int16)
        b.tier[both], b.clique[both], b.gpu[both] = GPU, EVERY, slots
        b.server[hot] = s
        b.host_rows(warm, s)
        cold = mine[hot.size + warm.size:]
        b.tier[cold], b.server[cold], b.clique[cold], b.gpu[cold] = DISK, s, EVERY, EVERY
    b.server[in_gpu] = EVERY
    b.host_rows(shared[in_gpu.size:], EVERY)
    return b.build("importance")


def two_hop_importance(indptr: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Number of 2-hop in-paths per node (A^T A^T 1): AliGraph's importance with k = 2 on a
    graph whose rows list in-neighbours."""
    import scipy.sparse as sp

    n = indptr.shape[0] - 1
    a = sp.csr_matrix((np.ones(indices.shape[0], np.float32), indices, indptr), shape=(n, n))
    ones = np.ones(n, np.float32)
    return np.asarray(a.T @ (a.T @ ones)).ravel()


def make_plan(method: str, *, fap=None, degrees=None, importance=None, num_nodes: int | None = None,
              topology: Topology, row_bytes: int) -> Plan:
    if method == "fap":
        return fap_plan(fap, topology, row_bytes)
    if method == "hash":
        return hash_plan(num_nodes if num_nodes is not None else len(fap), topology, row_bytes)
    if method == "degree":
        return degree_plan(degrees, topology, row_bytes)
    if method == "importance":
        return importance_plan(importance, topology, row_bytes)
    raise ValueError(f"placement method must be one of {METHODS}, got {method!r}")
