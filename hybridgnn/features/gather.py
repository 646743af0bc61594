"""A feature store laid out by a placement plan, for one server and one requesting device
(docs/architecture.md): given node ids, one [n, F] tensor on that device.

Stores, built once from the dataset's feature matrix and the plan:
  gpu:k   rows the plan puts on GPU k of this server's clique(s) (device memory of that
          GPU); the requesting GPU reads its own with index_select and a peer's with an
          index_select on the peer followed by a device-to-device copy (over NVLink where
          the GPUs are peers; no host staging)
  host    rows in pinned host memory, read by the requesting GPU zero-copy over UVA
  disk    rows in a memory-mapped file beside the plan, read through the page cache
  remote  rows another server owns: this build has no RDMA transport, so they are read
          from the local dataset copy (every replica has one) and counted as remote
Ids are sorted within each store before reading, for locality. On a CPU device every
store is a CPU tensor (how CI runs it, and how the CPU pipeline uses a plan).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from hybridgnn.features.placement import DISK, EVERY, GPU, HOST, Plan
from hybridgnn.graph.host import host_tensor

log = logging.getLogger(__name__)


class TieredFeatureStore:
    def __init__(self, features: np.ndarray, plan: Plan, *, device: str | torch.device = "cpu", server: int = 0,
                 gpu: int = 0, plan_dir: str | Path | None = None, host_view=None, gpu_tiers: bool = True):
        """gpu: the requesting GPU's index in this server (its clique is gpu // per-clique,
        its slot gpu % per-clique). host_view(array) -> device-readable tensor over pinned
        memory (graph/uva.py) for CUDA; None reads host rows as CPU tensors. gpu_tiers=False
        (a CPU pipeline): rows the plan puts on GPUs are read from the dataset in host memory."""
        source = getattr(features, "filename", None)  # a memory-mapped dataset's file, for the disk tier's copy
        features = np.asarray(features)
        if plan.num_nodes != features.shape[0]:
            raise ValueError(f"plan covers {plan.num_nodes} nodes, the dataset has {features.shape[0]}")
        topo = plan.topology
        if not 0 <= server < topo.servers:
            raise ValueError(f"server must be within [0, {topo.servers}), got {server}")
        self.device = torch.device(device)
        self.feature_dim = int(features.shape[1])
        self.plan = plan
        per_clique = max(1, topo.gpus_per_clique)
        here = (plan.server == server) | (plan.server == EVERY)
        self.names: list[str] = []
        self.stores: list[torch.Tensor] = []
        code = np.full(plan.num_nodes, -1, dtype=np.int16)
        local_row = np.zeros(plan.num_nodes, dtype=np.int64)
        table = host_tensor(features)

        self._keep: list[np.ndarray] = []  # host buffers the device reads over UVA

        def add(name: str, mask: np.ndarray, tensor_for) -> None:
            nodes = np.flatnonzero(mask)
            if nodes.size == 0:
                return
            nodes = nodes[np.lexsort((nodes, plan.row[nodes]))]  # the store's rows, in plan order
            code[nodes] = len(self.stores)
            local_row[nodes] = np.arange(nodes.size)
            self.names.append(name)
            self.stores.append(tensor_for(nodes))

        def pinned(ids: np.ndarray) -> torch.Tensor:
            rows = np.ascontiguousarray(features[ids])
            if host_view is None:
                return torch.from_numpy(rows)
            self._keep.append(rows)
            return host_view(rows)

        def add_table(name: str, mask: np.ndarray) -> None:
            """Rows read straight from the dataset matrix (no copy): row = node id."""
            if not mask.any():
                return
            code[mask] = len(self.stores)
            local_row[mask] = np.flatnonzero(mask)
            self.names.append(name)
            self.stores.append(table)

        on_gpu = here & (plan.tier == GPU)
        cuda = self.device.type == "cuda"
        if not gpu_tiers:  # a CPU pipeline reads GPU- and host-tier rows in place
            add_table("host", on_gpu | (here & (plan.tier == HOST)))
            on_gpu = np.zeros_like(on_gpu)
        per_gpu, taken = [], np.zeros_like(on_gpu)
        # own GPU first, then its clique's peers (NVLink), then other cliques': a row every
        # clique holds is read over NVLink, never from a GPU outside the clique
        for g in sorted(range(topo.gpus_per_server), key=lambda g: (g != gpu, g // per_clique != gpu // per_clique)):
            c, k = g // per_clique, g % per_clique
            mine = on_gpu & ((plan.clique == c) | (plan.clique == EVERY)) & ((plan.gpu == k) | (plan.gpu == EVERY))
            per_gpu.append((g, mine & ~taken))
            taken |= mine
        if cuda and on_gpu.any():  # before any copy: a GPU this machine lacks was a CUDA traceback at start
            visible = torch.cuda.device_count()
            missing = [g for g, mine in per_gpu if g >= visible and mine.any()]
            if missing:
                raise ValueError(f"the placement plan puts feature rows on GPU {missing[0]} of "
                                 f"{topo.gpus_per_server} per server; this machine has {visible}: make the plan "
                                 "with this machine's topology")
        for g, mine in per_gpu:
            target = torch.device("cuda", g) if cuda else self.device
            add("gpu" if g == gpu else f"peer{g}", mine,
                lambda ids, t=target: torch.index_select(table, 0, torch.from_numpy(ids)).to(t))
        add("host", here & (plan.tier == HOST) & (code < 0), pinned)
        add("disk", here & (plan.tier == DISK), lambda ids: self._disk_rows(features, ids, plan_dir, server, source))
        add_table("remote", code < 0)  # owned by another server: read from the local dataset copy
        self.code = torch.from_numpy(code).to(self.device)
        self.local_row = torch.from_numpy(local_row).to(self.device)
        self.bytes_by_store = {n: int(t.numel() * t.element_size()) for n, t in zip(self.names, self.stores, strict=True)
                               if t is not table}  # the dataset matrix itself is no copy

    @staticmethod
    def _disk_rows(features: np.ndarray, ids: np.ndarray, plan_dir, server: int, source=None) -> torch.Tensor:
        """The disk tier as a memory-mapped .npy beside the plan, named by which rows it holds
        in which order. It is written again (to a file of its own, then renamed over the old
        one) unless it loads as those rows' shape and dtype, was copied from this dataset
        file as it is now (device, inode, size, mtime; kept beside it in a .source file) and
        a spread sample of its rows equals the dataset's: a dataset rewritten under a plan
        kept elsewhere was served its old rows, and a damaged copy was a traceback. (A copy
        that passes the sample but cannot be written again, in a read-only directory, is
        served with a warning.)"""
        if plan_dir is None:
            return host_tensor(features)[torch.from_numpy(ids)]
        import hashlib
        import json

        from hybridgnn.capabilities import file_identity, write_replacing

        digest = hashlib.sha256(ids.tobytes()).hexdigest()[:12]  # which rows, in which order
        path = Path(plan_dir) / f"disk-server{server}-{digest}.npy"
        stamp = path.with_suffix(".source")
        try:
            identity = json.dumps(file_identity(source)) if source is not None else None
        except OSError:
            identity = None
        checked = _disk_copy(path, features, ids)
        if checked is not None and identity is not None:
            try:
                stamped = stamp.read_text() == identity
            except OSError:
                stamped = False
        if checked is not None and (identity is None or stamped):
            return host_tensor(checked)

        def write(tmp: Path) -> None:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=features.dtype, shape=(ids.size, features.shape[1]))
            for lo in range(0, ids.size, 1 << 16):
                out[lo:lo + (1 << 16)] = features[ids[lo:lo + (1 << 16)]]
            out.flush()
            del out

        try:
            stamp.unlink(missing_ok=True)  # never a new copy beside an old stamp
            write_replacing(path, write)
            if identity is not None:
                write_replacing(stamp, lambda tmp: tmp.write_text(identity))
        except OSError as exc:
            if checked is None:
                raise
            # a read-only plan directory whose copy predates its stamp: served as before
            log.warning("disk tier %s cannot be written again (%s); its sampled rows match the dataset's, so it "
                        "is served as it is", path, exc)
            return host_tensor(checked)
        return host_tensor(np.load(path, mmap_mode="r", allow_pickle=False))

    def gather_counted(self, node_ids) -> tuple[torch.Tensor, dict[str, int]]:
        ids = torch.as_tensor(node_ids, dtype=torch.int64)
        dev_ids = ids.to(self.device, non_blocking=True)
        code = self.code[dev_ids]
        rows = self.local_row[dev_ids]
        out = torch.empty((ids.shape[0], self.feature_dim), dtype=self.stores[0].dtype if self.stores else
                          torch.float32, device=self.device)
        counts = {}
        for s, (name, store) in enumerate(zip(self.names, self.stores, strict=True)):
            pos = torch.nonzero(code == s).squeeze(1)
            if pos.numel() == 0:
                continue
            want, order = torch.sort(rows[pos])
            where = pos[order]
            values = torch.index_select(store, 0, want.to(store.device))
            out[where] = values.to(self.device, non_blocking=True)
            tier = "peer_gpu" if name.startswith("peer") else name
            counts[tier] = counts.get(tier, 0) + int(pos.numel())
        return out, counts

    def gather(self, node_ids) -> torch.Tensor:
        return self.gather_counted(node_ids)[0]

    def rows_by_tier(self, node_ids) -> dict[str, int]:
        return self.gather_counted(node_ids)[1]


_DISK_SAMPLE_ROWS = 1024


def _disk_copy(path: Path, features: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
    """The disk tier's copy at path, memory-mapped, or None when it is missing, does not
    load, is not [len(ids), F] of the dataset's dtype, or differs from the dataset's rows
    at up to 1024 positions spread over it (bytes compared: NaN rows match themselves)."""
    try:
        copy = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if copy.shape != (ids.size, features.shape[1]) or copy.dtype != features.dtype:
        return None
    pos = np.unique(np.linspace(0, ids.size - 1, min(ids.size, _DISK_SAMPLE_ROWS)).astype(np.int64))
    if np.ascontiguousarray(copy[pos]).tobytes() != np.ascontiguousarray(features[ids[pos]]).tobytes():
        return None
    return copy
