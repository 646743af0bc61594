"""Where feature rows can live and how fast each place is reached (Quiver §5.2, docs/architecture.md).

A Topology is S identical servers, each with G GPUs in C NVLink cliques (G/C GPUs per
clique; C = G: no NVLink), GPU, host and disk capacities in bytes, and the links between
them with bandwidth (GB/s) and latency (µs). It is detected from this machine
(torch.cuda device count, memory and peer access; NUMA nodes from /sys; host memory from
/proc/meminfo) or read from a JSON or YAML file, so plans for machines we do not have can
be made and checked:

    servers: 2
    gpus_per_server: 4
    nvlink_cliques: 2            # GPUs per clique = 4 / 2
    gpu_memory_bytes: 80G
    host_memory_bytes: 512G
    disk_bytes: 4T
    network: infiniband          # infiniband | ethernet | none
    links:                       # optional overrides of DEFAULT_LINKS
      infiniband: {bandwidth_gbps: 25, latency_us: 3}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridgnn.config import parse_bytes
from hybridgnn.errors import brief

# GB/s and µs per one-sided read path; a request's gather waits for its slowest path.
DEFAULT_LINKS = {
    "hbm": {"bandwidth_gbps": 1500.0, "latency_us": 1.0},  # the requesting GPU's own memory
    "nvlink": {"bandwidth_gbps": 200.0, "latency_us": 2.0},  # a peer GPU in the same clique
    "pcie": {"bandwidth_gbps": 20.0, "latency_us": 5.0},  # pinned host memory (zero-copy) or a GPU outside the clique
    "infiniband": {"bandwidth_gbps": 23.0, "latency_us": 4.0},  # another server (RDMA, 200 Gb/s)
    "ethernet": {"bandwidth_gbps": 1.1, "latency_us": 60.0},  # another server (10 Gb/s)
    "disk": {"bandwidth_gbps": 3.0, "latency_us": 90.0},  # memory-mapped NVMe, page cache cold
}
NETWORKS = ("infiniband", "ethernet", "none")
# Plans hold a server, clique and GPU number per row as int16, and make and check a plan
# with a pass over the rows per server and per GPU: a topology of a billion servers never
# finished. These bounds are past any machine or cluster a plan is made for.
MAX_SERVERS = 4096
MAX_GPUS_PER_SERVER = 256
# A topology file is a few hundred bytes; one past this is not one (it was read whole
# into memory, then parsed, however large).
MAX_TOPOLOGY_BYTES = 1 << 20


def _finite(value: int | float) -> bool:
    """Whether a number is finite as a float (an int past float's range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float
    latency_us: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class Topology:
    servers: int = 1
    gpus_per_server: int = 0
    nvlink_cliques: int = 0  # cliques per server; == gpus_per_server (or 0 GPUs) means no NVLink
    gpu_memory_bytes: int = 0  # per GPU, for feature rows
    host_memory_bytes: int = 0  # per server, for feature rows
    disk_bytes: int = 1 << 60  # per server
    network: str = "none"
    numa_nodes: int = 1
    links: dict = field(default_factory=dict)
    source: str = "file"

    def __post_init__(self):
        if not 1 <= self.servers <= MAX_SERVERS:
            raise ValueError(f"servers must be within [1, {MAX_SERVERS}], got {self.servers}")
        if self.gpus_per_server > MAX_GPUS_PER_SERVER:
            raise ValueError(f"gpus_per_server must be at most {MAX_GPUS_PER_SERVER}, got {self.gpus_per_server}")
        if self.numa_nodes < 1:
            raise ValueError(f"numa_nodes must be >= 1, got {self.numa_nodes}")
        if self.gpus_per_server < 0:
            raise ValueError(f"gpus_per_server must be >= 0, got {self.gpus_per_server}")
        if self.gpus_per_server and not (1 <= self.nvlink_cliques <= self.gpus_per_server
                                         and self.gpus_per_server % self.nvlink_cliques == 0):
            raise ValueError(f"nvlink_cliques must divide gpus_per_server ({self.gpus_per_server}), "
                             f"got {self.nvlink_cliques}")
        if min(self.gpu_memory_bytes, self.host_memory_bytes, self.disk_bytes) < 0:
            raise ValueError("capacities must be >= 0")
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, got {brief(self.network)}")
        if self.servers > 1 and self.network == "none":
            raise ValueError("several servers need a network: infiniband or ethernet")
        unknown = set(self.links) - set(DEFAULT_LINKS)
        if unknown:
            raise ValueError(f"unknown links {brief(sorted(map(str, unknown)))}; known: {sorted(DEFAULT_LINKS)}")
        for name, spec in self.links.items():
            if not isinstance(spec, dict) or set(spec) - {"bandwidth_gbps", "latency_us"}:
                raise ValueError(f"link {name} must be a mapping of bandwidth_gbps and latency_us, got {brief(spec)}")
            for key, value in spec.items():
                # an int past float's range (10**400 in JSON) made math.isfinite an OverflowError
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value)
                        or value < 0 or (key == "bandwidth_gbps" and value == 0)):
                    raise ValueError(f"link {name} {key} must be a finite number "
                                     f"{'> 0' if key == 'bandwidth_gbps' else '>= 0'}, got {brief(value)}")

    @property
    def gpus_per_clique(self) -> int:
        return self.gpus_per_server // self.nvlink_cliques if self.gpus_per_server else 0

    @property
    def has_nvlink(self) -> bool:
        return self.gpus_per_clique > 1

    @property
    def fast_network(self) -> bool:
        return self.network == "infiniband"

    def link(self, name: str) -> Link:
        spec = dict(DEFAULT_LINKS[name])
        spec.update(self.links.get(name, {}))
        return Link(float(spec["bandwidth_gbps"]), float(spec["latency_us"]))

    def describe(self) -> str:
        gpus = (f"{self.gpus_per_server} GPUs ({'NVLink cliques of ' + str(self.gpus_per_clique) if self.has_nvlink else 'no NVLink'})"
                if self.gpus_per_server else "no GPU")
        net = f", {self.network}" if self.servers > 1 else ""
        return f"{self.servers} server{'s' if self.servers > 1 else ''} × {gpus}{net}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "file") -> Topology:
        if not isinstance(data, dict):
            raise ValueError("a topology file must hold a mapping of fields")
        known = {f for f in cls.__dataclass_fields__ if f != "source"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown topology fields {brief(sorted(map(str, unknown)))}; known: {sorted(known)}")
        values = dict(data)
        for key in ("servers", "gpus_per_server", "nvlink_cliques", "numa_nodes"):
            if key in values and type(values[key]) is not int:
                raise ValueError(f"topology field {key} must be a whole number, got {brief(values[key])}")
        for key, kind in (("network", str), ("links", dict)):
            if key in values and not isinstance(values[key], kind):
                raise ValueError(f"topology field {key} must be a {'string' if kind is str else 'mapping'}, "
                                 f"got {brief(values[key])}")
        for key in ("gpu_memory_bytes", "host_memory_bytes", "disk_bytes"):
            if key in values:
                # bool is an int to Python (`true` would be one byte); a list or a mapping was
                # str()-ed whole (a YAML alias bomb expanded to gigabytes)
                if isinstance(values[key], bool) or not isinstance(values[key], (int, float, str)):
                    raise ValueError(f"topology field {key} must be a size (bytes, or text such as 16G), "
                                     f"got {brief(values[key])}")
                values[key] = parse_bytes(values[key] if isinstance(values[key], int) else str(values[key]))
        if "nvlink_cliques" not in values and values.get("gpus_per_server"):
            values["nvlink_cliques"] = values["gpus_per_server"]  # default: no NVLink
        return cls(**values, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no topology file at {path}")
        try:
            size = path.stat().st_size
            if size > MAX_TOPOLOGY_BYTES:
                raise ValueError(f"topology {path} holds {size:,} bytes, past the {MAX_TOPOLOGY_BYTES:,} a topology "
                                 "file may hold (it lists a few fields)")
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read topology {path}: {exc}") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError("YAML topology files need pyyaml (pip install pyyaml), or write JSON") from None
            try:
                data = yaml.safe_load(text)
            except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: an int of 4300+ digits
                raise ValueError(f"topology {path} is not valid YAML: {exc}") from exc
        else:
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, or an int of 4300+ digits
                raise ValueError(f"topology {path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, source=str(path))


def detect(reserve_fraction: float = 0.5) -> Topology:
    """This machine: GPUs and the memory free on them (times reserve_fraction, leaving the
    rest for the model and sampling), NVLink cliques from peer access, NUMA nodes, and
    available host memory (same fraction)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_bytes, cliques = 0, gpus
    if gpus:
        gpu_bytes = int(min(torch.cuda.mem_get_info(i)[0] for i in range(gpus)) * reserve_fraction)
        cliques = len(peer_cliques(gpus, torch.cuda.can_device_access_peer))
    return Topology(servers=1, gpus_per_server=gpus, nvlink_cliques=cliques, gpu_memory_bytes=gpu_bytes,
                    host_memory_bytes=int(available_host_bytes() * reserve_fraction), network="none",
                    numa_nodes=numa_node_count(), source="detected")


def peer_cliques(gpus: int, can_access) -> list[list[int]]:
    """Groups of GPUs that all reach each other directly (peer access, i.e. NVLink or a
    shared PCIe switch): greedy, in device order. Unequal groups are cut to the smallest
    size, since plans assume identical cliques."""
    groups: list[list[int]] = []
    for d in range(gpus):
        for g in groups:
            if all(can_access(d, o) and can_access(o, d) for o in g):
                g.append(d)
                break
        else:
            groups.append([d])
    size = min(len(g) for g in groups) if groups else 0

    def all_peers(ids: list[int]) -> bool:
        return all(can_access(a, b) for a in ids for b in ids if a != b)

    # plans number a clique's GPUs consecutively (GPU g in clique g // size): every such
    # range must be a real clique, or rows are dealt over GPUs that are not peers
    while size > 1 and (gpus % size or not all(all_peers(list(range(i, i + size))) for i in range(0, gpus, size))):
        size -= 1
    return [list(range(i, i + size)) for i in range(0, gpus, size)] if size else []


def numa_node_count() -> int:
    try:
        return max(1, sum(1 for n in os.listdir("/sys/devices/system/node") if n.startswith("node")
                          and n[4:].isdigit()))
    except OSError:
        return 1


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
