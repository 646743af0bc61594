"""A stateful property test of graph updates: random sequences of valid and invalid
update requests (one or several per log entry), snapshots, compaction and restarts, over
the in-process applier checks, update log (SQLite), follower and incremental embeddings.

After every step:
1. the graph equals a plain model of it (edge set, features, removed nodes, names), each
   request was accepted or refused as that model says, and the served embeddings equal a
   full forward pass of the model over the current graph (every layer equals a from-scratch
   recompute);
2. a refused update left graph, features, embeddings, aggregates, id map and log
   byte-identical;
3. a replica following the same log, and one restarted from the newest snapshot plus the
   log after it, equal the live one exactly (graph, embeddings, aggregates, names, version,
   idempotency keys).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE

from hybridgnn.config import UpdateConfig
from hybridgnn.embeddings.incremental import IncrementalEmbeddings, computed_layers
from hybridgnn.errors import Conflict, ServingError
from hybridgnn.graph import journal
from hybridgnn.graph.dynamic import DynamicGraph
from hybridgnn.graph.idmap import IdMap
from hybridgnn.graph.store import GraphStore
from hybridgnn.serving.core.updates import UpdateApplier
from hybridgnn.types import ServingStats
from hybridgnn.updates.log import SqliteLog
from hybridgnn.updates.requests import (
    MAX_FEATURE_MAGNITUDE,
    LoggedRequest,
    encode_entry,
)
from hybridgnn.updates.snapshot import Snapshots
from tests.support.graphs import make_graph, update_body
from tests.support.updates import follower_for
from tests.support.v2_codec import decode_update_request

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")
stateful = pytest.importorskip("hypothesis.stateful")

F = 3
N0 = 9
MAX_REQUEST_UPDATES = 14
BASE_EDGES = [(0, 1), (1, 0), (2, 1), (3, 2), (4, 4), (5, 3), (0, 5), (6, 0), (6, 2), (1, 7), (7, 7), (2, 6)]
CASES = {"sage-mean, named nodes": ("sage-mean", True), "gcn": ("gcn", False), "gin, named nodes": ("gin", True),
         "gat": ("gat", False), "sage-sum with jumping knowledge": ("sage-jk", False)}
MODELS = {
    "sage-mean": lambda: GraphSAGE(F, 5, 2, out_channels=4, aggr="mean"),
    "gcn": lambda: GCN(F, 5, 2, out_channels=4),
    "gin": lambda: GIN(F, 5, 2, out_channels=4),
    "gat": lambda: GAT(F, 4, 2, out_channels=4, heads=2),
    "sage-jk": lambda: GraphSAGE(F, 5, 2, out_channels=4, aggr="sum", jk="cat"),
}


class InjectedFault(RuntimeError):
    pass


class Refused(Exception):
    """What the plain model of the graph says happens to a request: it is refused."""


# --- the plain model of the graph -------------------------------------------------------
@dataclass
class Model:
    edges: set[tuple[int, int]]  # (src, dst): dst reads src
    feats: list[np.ndarray]
    alive: list[bool]
    names: list[str] | None  # named datasets: every node's name, removed ones included
    version: int = 0

    @property
    def n(self) -> int:
        return len(self.alive)

    def copy(self) -> Model:
        return Model(set(self.edges), list(self.feats), list(self.alive),
                     None if self.names is None else list(self.names), self.version)


@dataclass
class Req:
    """A request in internal ids (-k: its own k-th new node), as the client means it."""

    add_edges: list[tuple[int, int]] = field(default_factory=list)
    remove_edges: list[tuple[int, int]] = field(default_factory=list)
    add_feats: list[list[float]] = field(default_factory=list)
    remove_nodes: list[int] = field(default_factory=list)
    update_ids: list[int] = field(default_factory=list)
    update_feats: list[list[float]] = field(default_factory=list)
    new_names: list[str] = field(default_factory=list)  # named datasets
    raw: dict | None = None  # inputs as sent, when a defect made them unlike the fields


def expect_build(inputs: dict[str, np.ndarray], names: dict[str, int] | None, limit: int | None) -> Req:
    """The request the inputs mean against a graph whose names are `names` (None: ids are
    integers), or Refused: what updates.requests.build_request decides, written plainly."""
    def feats(name):
        a = inputs.get(name)
        if a is None:
            return []
        if a.ndim != 2 or a.shape[1] != F:
            raise Refused(f"{name} width")
        if not np.isfinite(a).all() or (a.size and np.abs(a).max() > MAX_FEATURE_MAGNITUDE):
            raise Refused(f"{name} values")
        return a.tolist()

    r = Req(add_feats=feats("add_node_features"), update_feats=feats("update_features"))
    a = len(r.add_feats)
    ids = {}
    if names is None:
        if "add_node_ids" in inputs or any(v.dtype.kind == "U" for v in inputs.values()):
            raise Refused("names on a dataset without a map")
        for k in ("add_edges", "remove_edges", "remove_nodes", "update_ids"):
            ids[k] = inputs[k].tolist() if k in inputs else []
    else:
        for k in ("add_edges", "remove_edges", "remove_nodes", "update_ids", "add_node_ids"):
            if k in inputs and inputs[k].dtype.kind != "U":
                raise Refused("integer ids on a named dataset")
        new = inputs["add_node_ids"].tolist() if "add_node_ids" in inputs else []
        if len(new) != a or len(set(new)) != len(new) or any(x in names for x in new):
            raise Refused("add_node_ids")
        r.new_names = new

        def internal(x, may_be_new):
            if x in names:
                return names[x]
            if may_be_new and x in new:
                return -(new.index(x) + 1)
            raise Refused(f"unknown node {x}")

        for k in ("add_edges", "remove_edges", "remove_nodes", "update_ids"):
            v = inputs[k].tolist() if k in inputs else []
            new_ok = k in ("add_edges", "update_ids")
            ids[k] = [[internal(x, new_ok) for x in p] for p in v] if k.endswith("edges") else \
                [internal(x, new_ok) for x in v]
    r.add_edges = [tuple(p) for p in ids["add_edges"]]
    r.remove_edges = [tuple(p) for p in ids["remove_edges"]]
    r.remove_nodes, r.update_ids = ids["remove_nodes"], ids["update_ids"]
    if len(r.update_ids) != len(r.update_feats):
        raise Refused("update rows")
    if any(x < -a for p in r.add_edges for x in p) or any(x < -a for x in r.update_ids):
        raise Refused("negative id past the new nodes")
    if any(x < 0 for p in r.remove_edges for x in p) or any(x < 0 for x in r.remove_nodes):
        raise Refused("negative id to remove")
    count = len(r.add_edges) + len(r.remove_edges) + a + len(r.remove_nodes) + len(r.update_ids)
    if count == 0:
        raise Refused("empty")
    if limit is not None and count > limit:
        raise Refused("too large")
    return r


def expect_apply(r: Req, g: Model) -> tuple[Model, list[int]]:
    """The graph after request r applies to g alone, and its new nodes' ids; or Refused
    (graph.dynamic.check_batch, written plainly)."""
    n, a = g.n, len(r.add_feats)

    def res(x):
        return n - x - 1 if x < 0 else x

    add = [(res(s), res(d)) for s, d in r.add_edges]
    upd = [res(x) for x in r.update_ids]
    rm_edges, rm_nodes = list(r.remove_edges), list(r.remove_nodes)

    def ok(x, allow_new):
        return 0 <= x < (n + a if allow_new else n) and (x >= n or g.alive[x])

    if not all(ok(x, False) for x in rm_nodes) or len(set(rm_nodes)) != len(rm_nodes):
        raise Refused("remove_nodes")
    if not all(ok(x, True) for p in add for x in p) or not all(ok(x, False) for p in rm_edges for x in p):
        raise Refused("edge ends")
    if not all(ok(x, True) for x in upd) or len(set(upd)) != len(upd):
        raise Refused("update_ids")
    if g.names is not None and (len(set(r.new_names)) != len(r.new_names) or set(r.new_names) & set(g.names)):
        raise Refused("add_node_ids named twice, or already")
    gone = set(rm_nodes)
    if any(x in gone for p in add + rm_edges for x in p) or any(x in gone for x in upd):
        raise Refused("names a removed node")
    if len(set(add)) != len(add) or len(set(rm_edges)) != len(rm_edges):
        raise Refused("edge twice")
    if any(e not in g.edges for e in rm_edges) or any(e in g.edges for e in add) or set(add) & set(rm_edges):
        raise Refused("edge presence")
    out = g.copy()
    for v in rm_nodes:
        out.alive[v] = False
        out.edges = {e for e in out.edges if v not in e}
    out.alive += [True] * a
    out.feats += [np.asarray(f, np.float32) for f in r.add_feats]
    if out.names is not None:
        out.names += list(r.new_names)
    out.edges -= set(rm_edges)
    out.edges |= set(add)
    for v, f in zip(upd, r.update_feats, strict=True):
        out.feats[v] = np.asarray(f, np.float32)
    out.version += 1
    return out, list(range(n, n + a))


def merge(reqs: list[Req], n: int) -> Req:
    """Requests as one batch (updates.requests.to_batch) on a graph of n nodes: each one's
    new nodes after the ones before it; Refused when one names a node a later one adds."""
    out, offset = Req(), 0

    def shift(x):
        return x - offset if x < 0 else x

    for r in reqs:
        if any(x >= n + offset + len(r.add_feats) for x in [*(x for p in r.add_edges for x in p), *r.update_ids]):
            raise Refused("names a node a later request adds")
        out.add_edges += [(shift(s), shift(d)) for s, d in r.add_edges]
        out.update_ids += [shift(x) for x in r.update_ids]
        out.remove_edges += r.remove_edges
        out.remove_nodes += r.remove_nodes
        out.add_feats += r.add_feats
        out.update_feats += r.update_feats
        out.new_names += r.new_names
        offset += len(r.add_feats)
    return out


def inputs_of(r: Req, g: Model) -> dict[str, np.ndarray]:
    """The decoded tensors a client sends for r (names on a named dataset)."""
    if r.raw is not None:
        return r.raw

    def name(x):
        if g.names is None:
            return x
        return r.new_names[-x - 1] if x < 0 else g.names[x]

    out = {}
    if r.add_feats:
        out["add_node_features"] = np.array(r.add_feats, np.float32).reshape(-1, F)
        if g.names is not None:
            out["add_node_ids"] = np.array(r.new_names)
    for key, v in (("add_edges", r.add_edges), ("remove_edges", r.remove_edges)):
        if v:
            out[key] = np.array([[name(s), name(d)] for s, d in v]).reshape(len(v), 2)
    for key, v in (("remove_nodes", r.remove_nodes), ("update_ids", r.update_ids)):
        if v:
            out[key] = np.array([name(x) for x in v])
    if r.update_ids:
        out["update_features"] = np.array(r.update_feats, np.float32).reshape(-1, F)
    return {k: (v.astype(np.int64) if v.dtype.kind in "iu" else v) for k, v in out.items()}


def body_of(inputs: dict[str, np.ndarray]) -> bytes:
    def dt(a):
        return "BYTES" if a.dtype.kind == "U" else "FP32" if a.dtype.kind == "f" else "INT64"

    return update_body(*[(k, v, dt(v)) for k, v in inputs.items()])


# --- strategies over the plain model -----------------------------------------------------
small = st.floats(-2, 2, allow_nan=False, width=32)
values = st.one_of(small, small, small, st.sampled_from([1e9, -1e9, 3e5, 0.0]))


def rows(draw, k):
    return [[draw(values) for _ in range(F)] for _ in range(k)]


@st.composite
def valid_requests(draw, g: Model, counter) -> Req:
    alive = [v for v in range(g.n) if g.alive[v]]
    r = Req()
    if len(alive) > 4 and draw(st.integers(0, 3)) == 0:
        r.remove_nodes = draw(st.lists(st.sampled_from(alive), min_size=1, max_size=2, unique=True))
    live = [v for v in alive if v not in r.remove_nodes]
    existing = sorted(e for e in g.edges if e[0] in live and e[1] in live)
    if existing:
        r.remove_edges = draw(st.lists(st.sampled_from(existing), max_size=3, unique=True))
    a = draw(st.integers(0, 2))
    r.add_feats = rows(draw, a)
    r.new_names = [f"new{next(counter)}" for _ in range(a)] if g.names is not None else []
    ends = live + [-k for k in range(1, a + 1)]
    if ends:
        pair = st.tuples(st.sampled_from(ends), st.sampled_from(ends))
        r.add_edges = [p for p in draw(st.lists(pair, max_size=4, unique=True))
                       if p not in g.edges and p not in r.remove_edges]
    if ends:
        r.update_ids = draw(st.lists(st.sampled_from(ends), max_size=2, unique=True))
    r.update_feats = rows(draw, len(r.update_ids))
    if not (r.add_edges or r.remove_edges or a or r.remove_nodes or r.update_ids):
        r.update_ids, r.update_feats = (live[:1], rows(draw, 1)) if live else ([], [])
        if not live:
            r.add_feats = rows(draw, 1)
            r.new_names = [f"new{next(counter)}"] if g.names is not None else []
    return r


DEFECTS = ("removed node", "out of range", "duplicate edge", "edge twice", "absent edge", "added and removed",
           "bad width", "nan", "huge", "too many", "remove twice", "empty", "existing name", "name twice",
           "wrong id kind", "update rows")


@st.composite
def defective_requests(draw, g: Model, counter) -> tuple[str, Req]:
    """A request with one defect (it may still be valid by chance: the plain model judges)."""
    r = draw(valid_requests(g, counter))
    kind = draw(st.sampled_from(DEFECTS))
    dead = [v for v in range(g.n) if not g.alive[v]]
    alive = [v for v in range(g.n) if g.alive[v] and v not in r.remove_nodes]
    if kind == "removed node" and dead:
        v = draw(st.sampled_from(dead))
        where = draw(st.sampled_from(["remove_nodes", "add_edges", "update_ids", "remove_edges"]))
        if where == "remove_nodes":
            r.remove_nodes = r.remove_nodes + [v]
        elif where == "update_ids" and v not in r.update_ids:
            r.update_ids, r.update_feats = r.update_ids + [v], r.update_feats + rows(draw, 1)
        elif where == "add_edges" and alive:
            r.add_edges = r.add_edges + [(v, alive[0])]
        elif where == "remove_edges" and alive:
            r.remove_edges = r.remove_edges + [(alive[0], v)]
    elif kind == "out of range":
        v = draw(st.sampled_from([g.n + len(r.add_feats), g.n + 5, -len(r.add_feats) - 1, 10**12]))
        if g.names is not None:
            r.raw = inputs_of(r, g)
            r.raw["update_ids"] = np.array(list(r.raw.get("update_ids", [])) + ["nobody"])
            r.raw["update_features"] = np.concatenate([r.raw.get("update_features", np.zeros((0, F), np.float32)),
                                                       np.zeros((1, F), np.float32)])
        elif alive:
            r.add_edges = r.add_edges + [(alive[0], v)]
    elif kind == "duplicate edge":
        present = sorted(e for e in g.edges if g.alive[e[0]] and g.alive[e[1]])
        if present:
            r.add_edges = r.add_edges + [draw(st.sampled_from(present))]
    elif kind == "edge twice" and r.add_edges:
        r.add_edges = r.add_edges + r.add_edges[:1]
    elif kind == "edge twice" and r.remove_edges:
        r.remove_edges = r.remove_edges + r.remove_edges[:1]
    elif kind == "absent edge" and len(alive) > 1:
        e = (draw(st.sampled_from(alive)), draw(st.sampled_from(alive)))
        if e not in g.edges and e not in r.add_edges:
            r.remove_edges = r.remove_edges + [e]
    elif kind == "added and removed" and r.remove_edges:
        r.add_edges = r.add_edges + r.remove_edges[:1]
    elif kind in ("bad width", "nan", "huge", "wrong id kind", "update rows", "empty"):
        r.raw = inputs_of(r, g)
        target = draw(st.sampled_from([k for k in ("add_node_features", "update_features") if k in r.raw]
                                      or ["add_node_features"]))
        if kind == "bad width":
            r.raw[target] = np.zeros((len(r.raw.get(target, [])) or 1, F + 1), np.float32)
        elif kind in ("nan", "huge") and target in r.raw and len(r.raw[target]):
            r.raw[target] = r.raw[target].copy()
            r.raw[target][0, draw(st.integers(0, F - 1))] = np.nan if kind == "nan" else 2e9
        elif kind == "wrong id kind" and alive:
            r.raw["remove_nodes"] = (np.array([alive[0]], np.int64) if g.names is not None
                                     else np.array([f"n{alive[0]}"]))
        elif kind == "update rows" and "update_ids" in r.raw:
            r.raw["update_features"] = r.raw["update_features"][:-1]
        elif kind == "empty":
            r.raw = {"remove_nodes": np.zeros(0, np.int64)}
    elif kind == "too many" and len(alive) > 1:
        r.add_feats = r.add_feats + rows(draw, MAX_REQUEST_UPDATES)
        if g.names is not None:
            r.new_names = r.new_names + [f"new{next(counter)}" for _ in range(MAX_REQUEST_UPDATES)]
    elif kind == "remove twice" and r.remove_nodes:
        r.remove_nodes = r.remove_nodes + r.remove_nodes[:1]
    elif kind == "existing name" and g.names is not None and r.new_names:
        r.new_names = [draw(st.sampled_from(g.names))] + r.new_names[1:]
    elif kind == "name twice" and g.names is not None and len(r.new_names) > 1:
        r.new_names = [r.new_names[0]] * len(r.new_names)
    return kind, r


# --- the system under test ----------------------------------------------------------------
CFG = UpdateConfig(token="12345678", max_request_updates=MAX_REQUEST_UPDATES, compact_patched_entries=40,
                   snapshot_every=3, snapshot_keep=2, log_retain=2)


class Replica:
    """One replica: its graph, embeddings, follower of the shared SQLite log."""

    def __init__(self, base_dir: Path, names: bool, model, layers, root: Path, log_id: str | None = None,
                 from_snapshot: bool = False):
        base = GraphStore.open(base_dir)
        if names:
            base.id_map = IdMap.build(np.array([f"n{i}" for i in range(N0)]))[0]
        self.dyn = DynamicGraph(base)
        self.log = SqliteLog(root / "updates.sqlite", base.fingerprint)
        self.snaps = Snapshots(root / "snaps", base_fingerprint=base.fingerprint, model_fingerprint="m",
                               log_id=self.log.log_id, every=CFG.snapshot_every, keep=CFG.snapshot_keep)
        snap = self.snaps.latest(with_embeddings=True) if from_snapshot else None
        position, keys, output, aggregates = 0, None, None, None
        if snap is not None:
            self.dyn.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)
            if snap.added_ids is not None:
                base.id_map.extend(np.asarray(snap.added_ids))
            layers, output, aggregates = snap.layers, snap.output, snap.aggregates
            position, keys = snap.position, snap.keys
        self.inc = IncrementalEmbeddings(self.dyn, model, layers, output=output, aggregates=aggregates)
        self.follower = follower_for(self.dyn, self.inc, self.log, cfg=CFG, position=position, keys=keys,
                                     snapshots=self.snaps)
        self.applier = UpdateApplier(CFG, self.follower, self.dyn, ServingStats())
        self.follower.catch_up()
        self.run_jobs()

    def run_jobs(self) -> None:
        """What the follower's background task does between entries: compaction, snapshots."""
        job, self.follower._job = self.follower._job, None
        if job is not None:
            job()

    def step(self) -> dict[int, list]:
        done = dict(self.follower.step(block_s=0))
        self.run_jobs()
        return done

    def offer(self, inputs: dict[str, np.ndarray], key: str | None):
        """A client's request through decode, the applier's checks and the log, as the
        server takes it; the answer, or the ServingError it gets."""
        body = body_of(inputs)
        digest = hashlib.sha256(body).hexdigest() if key is not None else None
        try:
            pending = decode_update_request(body, None, feature_dim=F, max_updates=CFG.max_request_updates,
                                            id_map=self.dyn.base.id_map)
            pending.logged.idempotency_key, pending.logged.body_sha256 = key, digest
            if key is not None:
                replay = self.applier._replay(key, digest)
                if replay is not None:
                    return replay
            [err] = self.applier._refusals([pending])
        except ServingError as exc:
            return exc
        if err is not None:
            return err
        position = self.log.append(encode_entry([pending.logged]))
        return self.step()[position][0]

    def state(self) -> list:
        """Everything a reader, the next batch or a restart can see, as bytes."""
        d, i = self.dyn, self.inc
        n = d.num_nodes
        ids = np.arange(n)
        id_map = d.base.id_map
        return [n, d.version, d.updates_applied, *(a.tobytes() for a in d.to_csr()),
                *(a.tobytes() for a in d.rev.to_csr()), d.features(ids).tobytes(), d.alive[:n].tobytes(),
                d.self_loop[:n].tobytes(), d.in_degree(ids).tobytes(), *(a.tobytes() for a in i.layers),
                *(a.tobytes() for a in i.aggregates if a is not None),
                b"" if i.output is None else i.output.tobytes(),
                None if id_map is None else (len(id_map), id_map.to_external(ids).tobytes()),
                self.follower.applied, json.dumps(list(self.follower.keys.items())),
                [(e.position, e.body) for e in self.log.read(self.log.first() - 1, 10**6)]]

    def close(self) -> None:
        self.log.close()


def served_state(r: Replica) -> list:
    """What must agree across replicas: state() less the log and follower bookkeeping, and
    only the first num_nodes rows (capacity differs with a replica's history)."""
    d, i = r.dyn, r.inc
    n = d.num_nodes
    ids = np.arange(n)
    id_map = d.base.id_map
    return [n, d.version, *(a.tobytes() for a in d.to_csr()), d.features(ids).tobytes(),
            d.alive[:n].tobytes(), d.self_loop[:n].tobytes(), *(a[:n].tobytes() for a in i.layers),
            *(a[:n].tobytes() for a in i.aggregates if a is not None),
            b"" if i.output is None else i.output[:n].tobytes(),
            None if id_map is None else id_map.to_external(ids).tolist(),
            r.follower.applied, json.dumps(list(r.follower.keys.items()))]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)) if want.size else 0.0


class UpdatesMachine(stateful.RuleBasedStateMachine):
    base_dir: Path
    tmp_root: Path
    setups: dict  # case -> (model, its layers on the base graph, whether nodes are named)

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(dir=self.tmp_root))
        self.live = self.follower_replica = None
        self.counter = iter(range(10**9))
        self.answers: dict[str, tuple[dict, dict]] = {}  # key -> (inputs, answer)

    @stateful.initialize(case=st.sampled_from(sorted(CASES)))
    def start(self, case):
        hypothesis.event(case)
        self.torch_model, self.initial_layers, self.names = self.setups[case]
        self.live = self._replica()
        self.follower_replica = self._replica()
        feats = np.asarray(GraphStore.open(self.base_dir).features)
        self.g = Model(set(BASE_EDGES), [feats[v].copy() for v in range(N0)], [True] * N0,
                       [f"n{i}" for i in range(N0)] if self.names else None)

    def _replica(self, from_snapshot: bool = False) -> Replica:
        return Replica(self.base_dir, self.names, self.torch_model, self.initial_layers, self.root,
                       from_snapshot=from_snapshot)

    def teardown(self):
        for r in (self.live, self.follower_replica):
            if r is not None:
                r.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- what each entry should do ---------------------------------------------------------
    def _names_index(self):
        return None if self.g.names is None else {x: v for v, x in enumerate(self.g.names)}

    def _expect_entry(self, inputs_list, limit=None):
        """Outcomes the plain model predicts for one log entry: each request built against
        the graph before the entry, then applied in order (the follower merges them, and
        falls back to one at a time, which must come to the same)."""
        names, built = self._names_index(), []
        for inputs in inputs_list:
            try:
                built.append(expect_build(inputs, names, limit))
            except Refused as exc:
                built.append(exc)
        todo = [r for r in built if isinstance(r, Req)]
        g0, outcomes = self.g, []
        for r in built:
            try:
                if isinstance(r, Refused):
                    raise r
                self.g, new = expect_apply(r, self.g)
                outcomes.append(new)
            except Refused as exc:
                outcomes.append(exc)
        if len(todo) > 1:
            try:
                merged, _ = expect_apply(merge(todo, g0.n), g0)
            except Refused:
                pass
            else:  # one batch: one version, and the same graph as one request after another
                assert all(isinstance(o, list) for o, r in zip(outcomes, built, strict=True) if isinstance(r, Req))
                assert (merged.edges, merged.alive, merged.names) == (self.g.edges, self.g.alive, self.g.names)
                assert all((a == b).all() for a, b in zip(merged.feats, self.g.feats, strict=True))
                self.g = merged
        return outcomes

    def _check_outcome(self, got, want):
        if isinstance(want, Refused):
            assert isinstance(got, ServingError) and 400 <= got.status < 500, (want, got)
        else:
            assert isinstance(got, dict), (want, got)
            ids = want if self.g.names is None else [self.g.names[v] for v in want]
            assert got["new_node_ids"] == ids

    # --- rules ------------------------------------------------------------------------------
    @stateful.rule(data=st.data(), keyed=st.booleans())
    def valid_update(self, data, keyed):
        r = data.draw(valid_requests(self.g, self.counter))
        inputs = inputs_of(r, self.g)
        key = f"k{next(self.counter)}" if keyed else None
        [want] = self._expect_entry([inputs], CFG.max_request_updates)
        got = self.live.offer(inputs, key)
        self._check_outcome(got, want)
        if key is not None and isinstance(got, dict):
            self.answers[key] = (inputs, got)

    @stateful.rule(data=st.data())
    def defective_update(self, data):
        kind, r = data.draw(defective_requests(self.g, self.counter))
        hypothesis.event(kind)
        inputs = inputs_of(r, self.g)
        before, g = self.live.state(), self.g
        [want] = self._expect_entry([inputs], CFG.max_request_updates)
        got = self.live.offer(inputs, None)
        self._check_outcome(got, want)
        if isinstance(want, Refused):
            assert self.live.state() == before, f"a refused update ({kind}: {want}) changed the state"
            # The follower, handed it in a log entry (as another replica's applier might log
            # it), refuses it too, changing nothing but its position.
            self.g = g
            [want] = self._expect_entry([inputs])
            position = self.live.log.append(encode_entry([LoggedRequest(inputs)]))
            got = self.live.step()[position][0]
            self._check_outcome(got, want)
            if isinstance(want, Refused):
                after = self.live.state()
                assert after[:-3] == before[:-3] and after[-3] == position and after[-2] == before[-2]

    def _log_entry(self, data, k: int):
        """(the outcomes expected, the log position) of an entry of k requests drawn against
        the graph now, valid or defective, appended to the log; None when they cannot be one
        entry (feature rows of two widths: no applier logs such an entry)."""
        g0 = self.g
        reqs = [data.draw(st.one_of(valid_requests(g0, self.counter),
                                    defective_requests(g0, self.counter).map(lambda x: x[1])))
                for _ in range(k)]
        inputs_list = [inputs_of(r, g0) for r in reqs]
        try:
            body = encode_entry([LoggedRequest(i) for i in inputs_list])
        except ValueError:
            return None
        return self._expect_entry(inputs_list), self.live.log.append(body)

    @stateful.rule(data=st.data(), k=st.integers(2, 3))
    def entry_of_several(self, data, k):
        """Requests merged into one entry (the applier's batching), each drawn against the
        graph before the entry: they may conflict with one another, or be defective."""
        logged = self._log_entry(data, k)
        if logged is None:
            return
        want, position = logged
        for got, w in zip(self.live.step()[position], want, strict=True):
            self._check_outcome(got, w)

    @stateful.rule(data=st.data(), k=st.integers(1, 3), at=st.integers(0, 30))
    def entry_that_fails_part_way(self, data, k, at):
        """An entry whose apply fails for a reason of this replica (memory, a bug) at one of
        its steps: what was applied of it stays applied, the failed request left nothing, and
        the next step resumes the entry there, applying nothing twice."""
        logged = self._log_entry(data, k)
        if logged is None:
            return
        want, position = logged
        calls = iter(range(10**6))

        def fail(step):
            if next(calls) == at:
                raise InjectedFault(step)

        journal.FAULT = fail
        try:
            done = self.live.step()  # fewer steps than `at`: it applied whole
        except InjectedFault:
            hypothesis.event("an entry failed part way")
            assert self.live.follower.applied == position - 1
            done = None
            self.embeddings_equal_a_full_recompute()  # what applied of it is whole, the rest rolled back
        finally:
            journal.FAULT = None
        if done is None:
            done = self.live.step()
        for got, w in zip(done[position], want, strict=True):
            self._check_outcome(got, w)

    @stateful.precondition(lambda self: bool(self.answers))
    @stateful.rule(data=st.data(), same=st.booleans())
    def retry_with_key(self, data, same):
        key = data.draw(st.sampled_from(sorted(self.answers)))
        inputs, answer = self.answers[key]
        alive = [v for v in range(self.g.n) if self.g.alive[v]]
        if not same and alive:  # another update under the same key
            v = alive[0] if self.g.names is None else self.g.names[alive[0]]
            inputs = {"update_ids": np.array([v]), "update_features": np.full((1, F), 0.5, np.float32)}
        before = self.live.state()
        got = self.live.offer(inputs, key)
        if same or not alive:
            assert isinstance(got, dict) and got.get("replayed") and got["new_node_ids"] == answer["new_node_ids"]
        else:
            assert isinstance(got, Conflict) and got.status == 409
        assert self.live.state() == before

    @stateful.rule()
    def compact(self):
        before = served_state(self.live)
        assert self.live.dyn.compact()
        assert served_state(self.live) == before

    @stateful.rule()
    def snapshot(self):
        f = self.live.follower
        self.live.snaps.write(self.live.snaps.capture(f.applied, self.live.dyn, self.live.inc, f.keys))
        f.trim_log()

    @stateful.rule(from_snapshot=st.booleans())
    def restart(self, from_snapshot):
        """A new process: the newest snapshot (or the dataset, while the log holds every
        entry) plus the log after it."""
        if not from_snapshot and self.live.log.first() > 1:
            from_snapshot = True
        fresh = self._replica(from_snapshot=from_snapshot)
        assert served_state(fresh) == served_state(self.live)
        self.live.close()
        self.live = fresh

    # --- invariants ---------------------------------------------------------------------------
    @stateful.invariant()
    def graph_matches_the_plain_model(self):
        d, g = self.live.dyn, self.g
        assert d.num_nodes == g.n and d.version == g.version
        indptr, indices = d.to_csr()
        dst = np.repeat(np.arange(g.n), np.diff(indptr))
        assert set(zip(indices.tolist(), dst.tolist(), strict=True)) == g.edges
        np.testing.assert_array_equal(d.features(np.arange(g.n)), np.stack(g.feats))
        assert d.alive[:g.n].tolist() == g.alive
        if g.names is not None:
            assert d.base.id_map.to_external(np.arange(g.n)).tolist() == g.names

    @stateful.invariant()
    def embeddings_equal_a_full_recompute(self):
        d, inc = self.live.dyn, self.live.inc
        n = d.num_nodes
        alive = d.alive[:n]
        ref = computed_layers(d, self.torch_model)
        for layer, (got, want) in enumerate(zip(inc.layers, ref, strict=True)):
            err = relative_error(got[:n][alive], want[alive])
            assert err <= 1e-4, f"layer {layer + 1}: relative error {err:.2e}"
        indptr, indices = d.to_csr()
        ei = torch.from_numpy(np.stack([indices.astype(np.int64), np.repeat(np.arange(n), np.diff(indptr))]))
        with torch.inference_mode():
            full = self.torch_model(torch.from_numpy(d.features(np.arange(n))), ei).numpy()
        err = relative_error(inc.final[:n][alive], full[alive])
        assert err <= 1e-4, f"served rows: relative error {err:.2e} against a full forward pass"

    @stateful.invariant()
    def a_replica_following_the_log_is_the_same(self):
        self.follower_replica.step()
        assert served_state(self.follower_replica) == served_state(self.live)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("statefuzz") / "base"
    make_graph(path, [(d, s) for s, d in BASE_EDGES], N0, feature_dim=F, seed=4)  # make_graph: (row, neighbour)
    return path


def test_random_update_sequences_keep_every_invariant(base_dir, tmp_path):
    """Each example draws one model (and whether nodes are named) of CASES. To search
    longer: STATEFUZZ_EXAMPLES=500 STATEFUZZ_RANDOM=1 (a new seed each run)."""
    setups = {}
    for case, (name, named) in CASES.items():
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        setups[case] = (model, computed_layers(DynamicGraph(GraphStore.open(base_dir)), model), named)
    machine = type("GraphUpdates", (UpdatesMachine,), {"base_dir": base_dir, "tmp_root": tmp_path, "setups": setups})
    stateful.run_state_machine_as_test(machine, settings=hypothesis.settings(
        max_examples=int(os.environ.get("STATEFUZZ_EXAMPLES", 25)), stateful_step_count=12, deadline=None,
        derandomize=os.environ.get("STATEFUZZ_RANDOM") is None, suppress_health_check=list(hypothesis.HealthCheck)))
