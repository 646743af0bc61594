"""Precomputed lookups answered in a front-end process, from the engine's own embedding
files mapped read-only (the page cache holds them once for every process).

A lookup is a gather of a few stored rows: no batch, no model, no admission lane (the
engine answers it inline too). Sent to the engine, it costs a hop there and back, two
process wake-ups, on the engine's one event loop. Answered where it was parsed, it costs
neither, and front ends add lookup throughput with every core.

What holds:
- Only what the engine would answer the same way is answered here: a single-model server
  (no repository), a graph that takes no updates (its stored rows never change), node ids
  0..n-1 (no id map), mode precomputed, no parameter but mode and binary_data_output, at
  most LOCAL_MAX_IDS ids, the `embeddings` output only where stored rows hold it, not
  draining, not waited past the admission bound. Everything else goes to the engine,
  errors included (its answer and its counts are the reference).
- A request answered here is decoded by the engine's own decode_infer and answered with
  the engine's rows, so its answer is the engine's answer byte for byte. The files are
  the engine's own (device, inode, size and modification time checked when they are
  mapped): rows rewritten since, by a precompute, are never answered from here.
- It is counted by the engine: the front end keeps each answer's seconds and rows and
  sends them to the engine (LocalAnswers.take, as wire.encode_local frames), which adds them to its
  statistics and telemetry (V2Service.count_local); at most a report period late, and
  never late for a scrape or a statistics request, which flush every front end first.

Imports no torch: the front end imports this module.
"""

from __future__ import annotations

import time
from array import array

import numpy as np

from hybridgnn.capabilities import file_identity
from hybridgnn.serving.v2.inference import decode_infer
from hybridgnn.serving.v2.tensors import INPUT_NAME, OUTPUT_NAMES, request_id
from hybridgnn.serving.v2.types import InferAnswer, InferInput

LOCAL_MAX_IDS = 1024  # a gather of this many rows stays within tens of µs of the front end's loop
QUICK_MAX_IDS = 64  # the quick lane's checks are a Python loop over the ids
_PARAMETERS = frozenset({"mode", "binary_data_output"})
_QUICK_KEYS = frozenset({"inputs", "parameters", "outputs", "id"})
_QUICK_TENSOR_KEYS = frozenset({"name", "datatype", "shape", "data"})
_PRECOMPUTED = {"mode": "precomputed"}


def lookup_specs(service) -> list[dict]:
    """What front ends need to answer `service`'s precomputed lookups themselves (their
    SETUP carries it): one entry per engine that offers it (Engine.local_lookup_spec), with
    the model name; none on a model repository (versions load and unload while the server
    runs)."""
    if getattr(service, "repository", None) is not None:
        return []
    specs = []
    for name, _, engine in service.models.items():
        spec_of = getattr(engine, "local_lookup_spec", None)
        spec = spec_of() if spec_of is not None else None
        if spec is not None:
            specs.append({**spec, "model": name})
    return specs


_NO_EMBEDDINGS = np.empty((1, 0), np.float32)  # one row's embeddings when none were asked for (never written)
_NO_EMBEDDINGS.flags.writeable = False


class _Rows:
    """An answer's rows under the names InferRequest.answer_outputs reads (predictions
    computed only when asked for)."""

    __slots__ = ("logits", "embeddings")

    def __init__(self, logits: np.ndarray, embeddings: np.ndarray):
        self.logits = logits
        self.embeddings = embeddings

    @property
    def predictions(self) -> np.ndarray:
        return self.logits.argmax(axis=1).astype(np.int64)


class _Table:
    """One model version's stored rows, mapped read-only."""

    def __init__(self, spec: dict):
        self.model = spec["model"]
        self.version = spec["version"]
        for path, identity in (spec.get("files") or {}).items():
            if file_identity(path) != identity:
                raise ValueError(f"{path} is not the file the engine serves (rewritten since it started)")
        self.final = np.load(spec["final"], mmap_mode="r")
        self.hidden = np.load(spec["hidden"], mmap_mode="r") if spec.get("hidden") else None
        self.num_nodes = int(spec["num_nodes"])
        self.feature_dim = spec.get("feature_dim")
        self.max_nodes = int(spec["max_nodes"])
        default = spec.get("default_outputs")
        self.default_outputs = tuple(default) if default is not None else None
        self.default_mode = spec.get("default_mode", "sampled")
        # What a request naming no outputs gets (decode_infer's rule, on a dataset without an id map).
        self.quick_max_ids = min(QUICK_MAX_IDS, self.max_nodes)
        self.quick_outputs = (OUTPUT_NAMES if self.default_outputs is None
                              else tuple(n for n in OUTPUT_NAMES if n in self.default_outputs))
        if self.final.shape[0] != self.num_nodes or (self.hidden is not None and self.hidden.shape[0] != self.num_nodes):
            raise ValueError(f"stored rows of {self.model!r} do not cover its {self.num_nodes} nodes")
        # Indexed as plain arrays (a memmap's own indexing makes a memmap of the rows).
        self._final = np.asarray(self.final)
        self._hidden = np.asarray(self.hidden) if self.hidden is not None else None

    def stored(self, name: str) -> np.ndarray | None:
        """The rows whose row i is output `name` of node i as row() answers it, read as they
        are stored (float32 logits or embeddings), or None where row() converts or computes."""
        rows = {"logits": self._final, "embeddings": self._hidden}.get(name)
        return rows if rows is not None and rows.dtype == np.float32 else None

    def rows(self, node_ids: np.ndarray, with_embeddings: bool) -> _Rows:
        logits = np.asarray(self._final[node_ids], dtype=np.float32)
        if with_embeddings:
            hidden = np.asarray(self._hidden[node_ids], dtype=np.float32)
        else:
            hidden = np.empty((len(node_ids), 0), np.float32)
        return _Rows(logits, hidden)

    def row(self, node_id: int, with_embeddings: bool) -> _Rows:
        """rows([node_id]), as views of one row (a slice costs a fraction of a gather)."""
        logits = np.asarray(self._final[node_id:node_id + 1], dtype=np.float32)
        if with_embeddings:
            hidden = np.asarray(self._hidden[node_id:node_id + 1], dtype=np.float32)
        else:
            hidden = _NO_EMBEDDINGS
        return _Rows(logits, hidden)


class LocalAnswers:
    """Answers counted here until the next report: per model version, each answer's
    seconds (total, and encoding) and the rows answered."""

    __slots__ = ("_by_key", "size")

    def __init__(self):
        self._by_key: dict[tuple[str, str], tuple[array, array, list[int]]] = {}
        self.size = 0  # answers held

    def add(self, model: str, version: str, total_s: float, respond_s: float, rows: int) -> None:
        self.size += 1
        entry = self._by_key.get((model, version))
        if entry is None:
            entry = self._by_key[(model, version)] = (array("d"), array("d"), [0])
        entry[0].append(total_s)
        entry[1].append(respond_s)
        entry[2][0] += rows

    def take(self) -> list[tuple[dict, bytes]]:
        """[(head, seconds)] since the last take: head {model, version, count, rows}, seconds
        the float64 totals then the float64 encoding times (little-endian)."""
        out = []
        for (model, version), (total, respond, rows) in self._by_key.items():
            if total:
                blob = np.concatenate([np.frombuffer(total, np.float64), np.frombuffer(respond, np.float64)])
                out.append(({"model": model, "version": version, "count": len(total), "rows": rows[0]},
                            blob.astype("<f8").tobytes()))
        self._by_key = {}
        self.size = 0
        return out


def count_taken(service, taken: list[tuple[dict, bytes]]) -> None:
    """Count LocalAnswers.take()'s answers in `service` (V2Service.count_local) in this
    process (an HTTP server in the engine's own process answers lookups this way too)."""
    for head, blob in taken:
        seconds = np.frombuffer(blob, dtype="<f8")
        n = int(head["count"])
        service.count_local(head["model"], head["version"], seconds[:n], seconds[n:], int(head["rows"]))


class LocalLookups:
    """The lookups a front end answers itself (see the module docstring)."""

    def __init__(self, specs: list[dict]):
        self._tables: dict[tuple[str, str | None], _Table] = {}
        for spec in specs:
            table = _Table(spec)
            self._tables[(table.model, table.version)] = table
            self._tables[(table.model, None)] = table  # one version per model: what a request without one gets
        self.counted = LocalAnswers()

    def __bool__(self) -> bool:
        return bool(self._tables)

    def answer(self, request: InferInput, bound_s: float) -> tuple[InferAnswer, float, int] | None:
        """(the answer, when it was started, the rows it answers) to `request` if it is a
        lookup answered here, else None (the engine answers it). bound_s: admission's bound
        on waiting, past which the engine judges it."""
        table = self._tables.get((request.model, request.version))
        if table is None or request.standing or request.waited_s > bound_s:
            return None
        params = request.parameters
        if type(params) is not dict or not _PARAMETERS.issuperset(params):
            return None
        if params.get("mode", table.default_mode) != "precomputed":
            return None
        started = time.perf_counter()
        try:
            req = decode_infer(request, max_nodes=table.max_nodes, num_nodes=table.num_nodes,
                               feature_dim=table.feature_dim, default_outputs=table.default_outputs)
        except Exception:  # the engine refuses it, with its message and its counts
            return None
        if req.node_ids is None or len(req.node_ids) > LOCAL_MAX_IDS:
            return None
        with_embeddings = "embeddings" in req.outputs
        if with_embeddings and table.hidden is None:
            return None
        rows = table.rows(req.node_ids, with_embeddings)
        answer = InferAnswer(table.model, table.version, req.request_id, req.answer_outputs(rows))
        return answer, started, req.num_outputs

    def table(self, model: str, version: str | None) -> _Table | None:
        """The stored rows that answer a model (and version, None: the one served), if any."""
        return self._tables.get((model, version))

    def may_quick(self, body: bytes, model: str, version: str | None) -> bool:
        """Whether quick() may answer this body, judged before parsing it: a table serves
        the model, and the body names mode precomputed or that is the default (a sampled
        inference, the main load, is then parsed once, by the general way)."""
        table = self._tables.get((model, version))
        return table is not None and (table.default_mode == "precomputed" or b"precomputed" in body)

    def quick(self, header, model: str, version: str | None) -> tuple[InferAnswer, float, int] | None:
        """What answer() gives for the commonest lookup, from its parsed JSON body alone,
        without building the request's v2 objects: one INT64 node_ids input of at most
        QUICK_MAX_IDS ids in range, mode precomputed (named, or the default), outputs
        named only by name (or none), an optional id; no binary data, no other parameter
        or key. None for anything else (then the caller takes answer()'s way, which
        decides it with the engine's own decoding). The answer is answer()'s, value for
        value: the tests hold the two lanes to the same bytes. The caller checks the
        request's wait and the queue (answer()'s first checks)."""
        table = self._tables.get((model, version))
        if table is None or type(header) is not dict or not _QUICK_KEYS.issuperset(header):
            return None
        params = header.get("parameters")
        if params != _PRECOMPUTED and not (table.default_mode == "precomputed" and (params is None or params == {})):
            return None
        inputs = header.get("inputs")
        if type(inputs) is not list or len(inputs) != 1:
            return None
        tensor = inputs[0]
        if type(tensor) is not dict or tensor.keys() != _QUICK_TENSOR_KEYS or tensor["name"] != INPUT_NAME \
                or tensor["datatype"] != "INT64":
            return None
        ids, shape = tensor["data"], tensor["shape"]
        if type(ids) is not list or type(shape) is not list or len(shape) != 1:
            return None
        n = len(ids)
        if not 0 < n <= table.quick_max_ids or type(shape[0]) is not int or shape[0] != n:
            return None
        num_nodes = table.num_nodes
        for i in ids:
            if type(i) is not int or i < 0 or i >= num_nodes:
                return None
        requested = header.get("outputs")
        if requested is None:
            outputs = table.quick_outputs
        else:
            if type(requested) is not list:
                return None
            names = []
            for out in requested:
                if type(out) is not dict or len(out) != 1 or out.get("name") not in OUTPUT_NAMES:
                    return None
                names.append(out["name"])
            outputs = tuple(dict.fromkeys(names))
        rid = header.get("id")
        if rid is not None:
            try:
                rid = request_id(rid)
            except Exception:
                return None
        started = time.perf_counter()
        with_embeddings = "embeddings" in outputs
        if with_embeddings and table.hidden is None:
            return None
        rows = table.row(ids[0], with_embeddings) if n == 1 else table.rows(np.array(ids, dtype=np.int64),
                                                                             with_embeddings)
        answer = InferAnswer(table.model, table.version, rid, [(name, getattr(rows, name)) for name in outputs])
        return answer, started, n
