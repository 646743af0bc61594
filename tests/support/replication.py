"""Replicated graph updates, as tests and benchmarks drive them: a real redis-server on a
loopback port, every replica's served embeddings, and an independent offline rebuild of
the final graph (replayed from the log, then precomputed in full) to compare them with."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from tests.support.durability import MODEL, get_json, post_json
from tests.support.server import free_port


class RedisServer:
    """redis-server with an append-only file fsynced on every write (what an update log
    needs), on 127.0.0.1, in its own directory."""

    def __init__(self, workdir: Path, binary: str | None = None, extra_args: tuple[str, ...] = ()):
        self.extra_args = tuple(extra_args)  # more redis-server options
        self.binary = binary or shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{stream}"

    def start(self, timeout_s: float = 30.0) -> RedisServer:
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes", *self.extra_args],
            stdout=open(self.workdir / "redis.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start:\n{(self.workdir / 'redis.log').read_text()}")
                time.sleep(0.05)  # poll interval; bounded by the deadline
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def served_logits(url: str, node_ids: np.ndarray, chunk: int = 256) -> np.ndarray:
    """The precomputed (kept fresh) logits a replica serves for node_ids, as float32."""
    rows = []
    for start in range(0, len(node_ids), chunk):
        ids = [int(i) for i in node_ids[start:start + chunk]]
        status, out = post_json(url, f"/v2/models/{MODEL}/infer", {
            "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
            "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]})
        if status != 200:
            raise RuntimeError(f"{url} answered {status}: {out}")
        [logits] = [o for o in out["outputs"] if o["name"] == "logits"]
        rows.append(np.asarray(logits["data"], np.float32).reshape(logits["shape"]))
    return np.concatenate(rows)


def wait_for_version(url: str, version: int, timeout_s: float = 60.0) -> dict:
    """A replica's metadata parameters once it has applied `version`."""
    deadline = time.monotonic() + timeout_s
    meta: dict = {}
    while True:
        try:
            status, meta = get_json(url, f"/v2/models/{MODEL}")
        except OSError as exc:  # not listening yet (a replica being started again)
            status, meta = 0, {"error": str(exc)}
        if status == 200 and int(meta["parameters"]["graph_version"]) >= version:
            return meta["parameters"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not reach graph version {version}: {meta}")
        time.sleep(0.05)  # poll interval; bounded by the deadline


def offline_rebuild(dataset: Path, model_dir: Path, log_url: str, workdir: Path,
                    snapshot_dir: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(alive node ids, their logits) of the final graph, computed independently of any
    server: the log applied to the stored dataset (graph only), written as a new dataset
    and precomputed layer by layer from scratch. snapshot_dir: start from the graph of the
    newest snapshot of the log there (whichever model wrote it), as a trimmed log needs."""
    from hybridgnn.config import UpdateConfig
    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.dynamic import DynamicGraph
    from hybridgnn.graph.store import GraphStore, write_dataset
    from hybridgnn.models.checkpoint import load_checkpoint
    from hybridgnn.types import ServingStats
    from hybridgnn.updates.follower import Follower
    from hybridgnn.updates.log import open_update_log

    base = GraphStore.open(dataset)
    dyn = DynamicGraph(base)
    log = open_update_log(log_url, dataset, base.fingerprint)
    position = 0
    if snapshot_dir is not None:
        from hybridgnn.updates.snapshot import Snapshots

        snap = Snapshots(snapshot_dir, base_fingerprint=base.fingerprint, model_fingerprint="-", log_id=log.log_id,
                         every=0).latest_graph(at_least=0)
        dyn.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)
        position = snap.position
    try:
        Follower(log, dyn, None, ServingStats(), UpdateConfig(token="offline-rebuild"), position=position).catch_up()
    finally:
        log.close()
    n = dyn.num_nodes
    indptr, indices = dyn.to_csr()
    rebuilt = write_dataset(Path(workdir) / "rebuilt", indptr=indptr, indices=indices,
                            features=dyn.features(np.arange(n)))
    model = load_checkpoint(model_dir)[0]
    store = precompute(GraphStore.open(rebuilt), model, Path(workdir) / "model", progress=False)
    alive = np.flatnonzero(dyn.alive[:n])
    return alive, np.asarray(store.final[alive], np.float32)
