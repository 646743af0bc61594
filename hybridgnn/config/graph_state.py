"""Configuration of the graph's state beyond the stored dataset: new-node requests, graph
updates (their log, snapshots and trimming) and serving a partitioned graph. Frozen
dataclasses, each checked in __post_init__ (see hybridgnn.config)."""

from __future__ import annotations

from pathlib import Path

from hybridgnn.config.settings import config_class, setting


@config_class
class NewNodeConfig:
    """New-node requests: the mode used when a request names none, and SRPE's default
    recompute budget γ (share of the query nodes' direct neighbours recomputed)."""

    default_mode: str = setting("srpe", "mode of new-node requests that name none", flag="--new-node-mode",
                                choices=("full", "pe", "srpe"))
    # (not "default share": a help that says "default" gets no "(default: 0.1)" from --help)
    gamma: float = setting(0.1, "share of the query nodes' direct neighbours that SRPE recomputes for a request "
                           "that gives no gamma", flag="--srpe-gamma")
    policy: str = "ratio"

    def __post_init__(self):
        if self.default_mode not in ("full", "pe", "srpe"):
            raise ValueError(f"default_mode must be full, pe or srpe, got {self.default_mode!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be within [0, 1], got {self.gamma}")
        if self.policy not in ("ratio", "random", "degree"):
            raise ValueError(f"policy must be ratio, random or degree, got {self.policy!r}")


@config_class
class UpdateConfig:
    """Graph updates over HTTP (POST /v2/models/{m}/graph). Disabled unless a token is set;
    requests must carry "Authorization: Bearer <token>"."""

    token: str | None = None
    max_batch_updates: int = setting(1000, "queued update requests are merged and applied together up to this "
                                     "many updates", flag="--update-batch")
    max_request_updates: int = 100_000
    compact_patched_entries: int = 1_000_000  # fold patches into the base CSR beyond this many
    propagation: str = setting("auto", "auto: deltas for sum/mean/GCN/GIN layers, recompute for max/attention; "
                               "recompute: recompute every affected node (slower)", flag="--update-propagation",
                               choices=("auto", "recompute"))
    log: str | None = setting(None, "with --update-token: the ordered log every update is appended to (durably, "
                              "before it is acknowledged) and every replica applies: sqlite:///<path> or a path "
                              "(default <dataset>/updates.sqlite; replicas on one machine may share it), "
                              "redis://host:port/<stream> (replicas on several machines), or off (in memory only: "
                              "lost on restart)", flag="--update-log")
    snapshot_dir: Path | None = setting(None, "where snapshots of the updated graph and embeddings go (default "
                                        "<dataset>/snapshots); a replica starts from the newest and replays the "
                                        "log after it")
    snapshot_every: int = setting(1000, "write a snapshot every this many log entries (0: never)")
    snapshot_keep: int = setting(2, "snapshots kept per log and model (older ones are removed)")
    log_retain: int = setting(0, "trim the update log: drop the entries every kept snapshot covers, keeping at "
                              "least this many of the newest (0: keep every entry). A replica whose newest "
                              "snapshot is older than the log's first entry is refused at start",
                              flag="--update-log-retain")
    max_catch_up_s: float = setting(1.0, "an infer request with parameters.min_graph_version waits at most this "
                                    "long for this replica to apply that version, else 503 + Retry-After (a "
                                    "balancer retries elsewhere)", flag="--max-catch-up-ms", scale=1000.0)

    def __post_init__(self):
        if self.token is not None and len(self.token) < 8:
            raise ValueError("the update token must be at least 8 characters")
        if self.token is not None and not _sendable(self.token):
            # Else the server started and refused every update 401: a client sends the token in
            # an HTTP header, which carries no control or non-ASCII characters as themselves and
            # drops blanks around a value (a secret file's trailing newline, read into the variable).
            raise ValueError("the update token must be printable ASCII (a client sends it in an HTTP header) "
                             "without blanks around it")
        for name, least in (("max_batch_updates", 1), ("max_request_updates", 1), ("compact_patched_entries", 1),
                            ("snapshot_every", 0), ("snapshot_keep", 1), ("log_retain", 0), ("max_catch_up_s", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.propagation not in ("auto", "recompute"):
            raise ValueError(f"propagation must be auto or recompute, got {self.propagation!r}")
        if self.log_retain and not self.snapshot_every:
            raise ValueError("log_retain trims what snapshots cover: it needs snapshot_every > 0")
        if self.log_retain and self.log == "off":
            raise ValueError("an in-memory update log (--update-log off) keeps only what is not yet applied: drop "
                             "log_retain")

    @property
    def enabled(self) -> bool:
        return self.token is not None


@config_class
class PartitionConfig:
    """Serving a partitioned graph (`serve --partitions N`): N partition ranks each hold one
    part of the graph, features and precomputed embeddings and answer every request
    together (computation graph parallelism). 0: off (one process holds everything)."""

    partitions: int = setting(0, "serve the graph split over this many partition ranks started on this machine "
                              "(each holds one part; requests are computed by all of them, exactly); 0: off")
    method: str = setting("auto", "how the graph is split: auto (METIS when pymetis is installed, else ranges), "
                          "metis or ranges", flag="--partition", choices=("auto", "metis", "ranges"))
    ranks: str | None = setting(None, "instead of starting ranks here: rank 0's address (host:port) of ranks "
                                "started elsewhere (`hybridgnn rank` under torchrun); --partitions then gives "
                                "their number")
    timeout_s: float = setting(60.0, "how long a rank waits for the others in one step before the group is "
                               "restarted (a rank that hangs)", flag="--partition-timeout-s")
    device: str = setting("cpu", "where partition ranks exchange data: cpu (gloo) or cuda (NCCL, one GPU per "
                          "rank, by local rank)", flag="--partition-device", choices=("cpu", "cuda"))
    heartbeat_s: float = 1.0  # rank 0 checks every rank this often when idle
    restart_backoff_s: float = 1.0  # first wait before the group restarts (doubles, to 30 s)

    def __post_init__(self):
        if self.partitions < 0:
            raise ValueError(f"--partitions must be >= 0, got {self.partitions}")
        if self.ranks is not None and self.partitions < 1:
            raise ValueError("--ranks needs --partitions N (the number of ranks started there)")
        if self.method not in ("auto", "metis", "ranges"):
            raise ValueError(f"--partition must be auto, metis or ranges, got {self.method!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--partition-device must be cpu or cuda, got {self.device!r}")
        if self.timeout_s <= 0 or self.heartbeat_s <= 0 or self.restart_backoff_s <= 0:
            raise ValueError("partition timeouts must be > 0")

    @property
    def enabled(self) -> bool:
        return self.partitions > 0


def _sendable(token: str) -> bool:
    """Whether an Authorization header can carry `token` as it is: printable ASCII, with
    no blank at either end."""
    return token.isascii() and token.isprintable() and token == token.strip()
