"""Placement simulator: the gather time of each batch under a plan, a topology and link
figures (docs/architecture.md). A GPU gathers a batch's rows by one-sided reads from every place
that holds them at once, so the batch waits for its slowest path (Quiver §5.2: the
tail decides the latency); each path costs latency + bytes / bandwidth.

The requester is GPU 0 of clique 0 of server 0 (plans treat GPUs and servers alike, so
any other gives the same distribution). Where each row is read from:
  hbm         GPU tier, on this GPU (own copy or replicated)
  nvlink      GPU tier, another GPU of this clique
  pcie        GPU tier in another clique of this server, or the host tier of this server
  disk        disk tier of this server
  network     any tier of another server (InfiniBand or Ethernet); a remote disk row
              pays the slower of the network and that disk
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridgnn.features.placement import DISK, EVERY, GPU, HOST, Plan

PATHS = ("hbm", "nvlink", "pcie", "disk", "network", "remote_disk")


def classify(plan: Plan, ids: np.ndarray) -> np.ndarray:
    """Path index (into PATHS) for each id, for the requester GPU 0 / clique 0 / server 0."""
    tier, server = plan.tier[ids], plan.server[ids]
    clique, gpu = plan.clique[ids], plan.gpu[ids]
    here = (server == EVERY) | (server == 0)
    own_clique = (clique == EVERY) | (clique == 0)
    own_gpu = (gpu == EVERY) | (gpu == 0)
    path = np.full(ids.shape[0], PATHS.index("network"), dtype=np.int8)
    path[here & (tier == GPU) & own_clique & own_gpu] = PATHS.index("hbm")
    path[here & (tier == GPU) & own_clique & ~own_gpu] = PATHS.index("nvlink")
    path[here & (tier == GPU) & ~own_clique] = PATHS.index("pcie")
    path[here & (tier == HOST)] = PATHS.index("pcie")
    path[here & (tier == DISK)] = PATHS.index("disk")
    path[~here & (tier == DISK)] = PATHS.index("remote_disk")
    return path


def expected_path_seconds(plan: Plan, fap: np.ndarray) -> dict[str, float]:
    """Bandwidth time per path of one expected request's reads (FAP = expected reads of
    each row per request), without sampling: how loaded each parallel path is."""
    topo = plan.topology
    net = topo.network if topo.network != "none" else "ethernet"
    mass = np.bincount(classify(plan, np.arange(plan.num_nodes)), weights=np.asarray(fap, np.float64),
                       minlength=len(PATHS)) * plan.row_bytes
    gbps = {p: topo.link(p).bandwidth_gbps for p in ("hbm", "nvlink", "pcie", "disk")}
    gbps["network"] = topo.link(net).bandwidth_gbps
    # a remote disk row pays the slower of the network and that disk, as simulate() charges it
    gbps["remote_disk"] = min(gbps["network"], gbps["disk"])
    return {p: float(mass[i] / (gbps[p] * 1e9)) for i, p in enumerate(PATHS)}


@dataclass
class SimResult:
    method: str
    seconds: np.ndarray  # per batch
    path_share: dict[str, float]  # share of all rows read over each path

    def quantile_ms(self, q: float) -> float:
        return float(np.quantile(self.seconds, q) * 1e3)

    def to_dict(self) -> dict:
        return {"method": self.method, "p50_ms": round(self.quantile_ms(0.5), 4),
                "p99_ms": round(self.quantile_ms(0.99), 4), "mean_ms": round(float(self.seconds.mean()) * 1e3, 4),
                "path_share": {k: round(v, 4) for k, v in self.path_share.items()}}


def simulate(plan: Plan, batches: list[np.ndarray]) -> SimResult:
    """Gather time per batch (each batch: the unique node ids whose features it reads)."""
    topo = plan.topology
    net = topo.network if topo.network != "none" else "ethernet"
    links = {"hbm": topo.link("hbm"), "nvlink": topo.link("nvlink"), "pcie": topo.link("pcie"),
             "disk": topo.link("disk"), "network": topo.link(net)}
    totals = np.zeros(len(PATHS))
    seconds = np.empty(len(batches))
    for b, ids in enumerate(batches):
        counts = np.bincount(classify(plan, ids), minlength=len(PATHS)).astype(np.float64)
        totals += counts
        nbytes = counts * plan.row_bytes
        worst = 0.0
        for i, name in enumerate(PATHS):
            if counts[i] == 0:
                continue
            if name == "remote_disk":
                t = max(links["network"].seconds(nbytes[i]), links["disk"].seconds(nbytes[i]))
            else:
                t = links[name].seconds(nbytes[i])
            worst = max(worst, t)
        seconds[b] = worst
    share = totals / max(totals.sum(), 1.0)
    return SimResult(plan.method, seconds, {p: float(s) for p, s in zip(PATHS, share, strict=True)})


def sample_batches(graph, fanouts, p0: np.ndarray, *, batch_size: int, count: int, seed: int = 0) -> list[np.ndarray]:
    """Unique node ids of `count` sampled batches whose seeds follow p0."""
    from hybridgnn.sampling.cpu import CPUSampler

    rng = np.random.default_rng(seed)
    sampler = CPUSampler(graph, fanouts, seed=seed)
    cdf = np.cumsum(np.asarray(p0, dtype=np.float64))
    cdf /= cdf[-1]
    draw = lambda: np.minimum(np.searchsorted(cdf, rng.random(batch_size), side="right"), cdf.size - 1)  # noqa: E731
    return [sampler.sample(draw()).node_ids for _ in range(count)]
