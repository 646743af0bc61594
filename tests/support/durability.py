"""Kill -9 checks of durable graph updates: a stream of small updates against a real
server, and a check after restart that every acknowledged update is there whole.

Each update adds one node with features and the two edges (new, anchor) and (anchor,
new), so a batch that was half applied shows in the counts: every applied update adds
exactly one node and two edges."""

from __future__ import annotations

import http.client
import json
import random
import threading
from urllib.parse import urlsplit

MODEL = "hybridgnn"


def _conn(url: str, timeout_s: float) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)


def get_json(url: str, path: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    c = _conn(url, timeout_s)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def post_json(url: str, path: str, body: dict, headers: dict | None = None,
              timeout_s: float = 30.0) -> tuple[int, dict]:
    c = _conn(url, timeout_s)
    try:
        c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def graph_state(url: str) -> dict:
    status, meta = get_json(url, f"/v2/models/{MODEL}")
    if status != 200:
        raise RuntimeError(f"metadata answered {status}: {meta}")
    p = meta["parameters"]
    return {"num_nodes": int(p["num_nodes"]), "num_edges": int(p["num_edges"]),
            "graph_version": int(p["graph_version"]), "feature_dim": int(p["feature_dim"])}


def add_node_body(k: int, anchor: int, feature_dim: int) -> dict:
    return {"inputs": [
        {"name": "add_node_features", "datatype": "FP32", "shape": [1, feature_dim],
         "data": [float((k + j) % 7) / 7 for j in range(feature_dim)]},
        {"name": "add_edges", "datatype": "INT64", "shape": [2, 2], "data": [-1, anchor, anchor, -1]}]}


class UpdateStream(threading.Thread):
    """Posts add-node updates one after another until stopped or the server goes away;
    `acked` holds the new node ids of the updates answered 200."""

    def __init__(self, url: str, token: str, base_nodes: int, feature_dim: int, seed: int = 0):
        super().__init__(daemon=True)
        self.url, self.token, self.base_nodes, self.feature_dim = url, token, base_nodes, feature_dim
        self.rng = random.Random(seed)
        self.acked: list[int] = []
        self.refused: list[tuple[int, dict]] = []  # answers other than 200 while the server was up
        self.in_flight: tuple[str, dict] | None = None  # (Idempotency-Key, body) sent but not answered
        self.stop_event = threading.Event()
        self.killed = threading.Event()  # set just before the server is killed
        self.seed = seed

    def run(self) -> None:
        k = 0
        while not self.stop_event.is_set():
            body = add_node_body(k, self.rng.randrange(self.base_nodes), self.feature_dim)
            self.in_flight = (f"stream-{self.seed}-{k}", body)
            try:
                status, out = send_update(self.url, self.token, *self.in_flight)
            except (OSError, http.client.HTTPException):
                return  # killed: what was in flight is unacknowledged (retry it with its key)
            if status != 200 and self.killed.is_set():
                # the kill's own answers: a front end outliving its engine for a moment refuses
                # what it cannot send (503); what was in flight is retried with its key
                return
            self.in_flight = None
            if status == 200:
                self.acked.extend(out["new_node_ids"])
            else:
                self.refused.append((status, out))
            k += 1


def send_update(url: str, token: str, key: str, body: dict) -> tuple[int, dict]:
    """POST one graph update with an Idempotency-Key."""
    return post_json(url, f"/v2/models/{MODEL}/graph", body,
                     {"Authorization": f"Bearer {token}", "Idempotency-Key": key})


def check_after_restart(url: str, base: dict, acked: list[int], *, exact: bool = False) -> list[str]:
    """Problems found (empty: every acknowledged update is there, none half applied;
    exact: and nothing else, as when every update sent has been answered)."""
    now = graph_state(url)
    added = now["num_nodes"] - base["num_nodes"]
    problems = []
    if exact and added != len(acked):
        problems.append(f"{len(acked)} updates acknowledged once each, but {added} nodes added")
    if added < len(acked):
        problems.append(f"{len(acked)} updates acknowledged but only {added} nodes added after restart")
    if acked and max(acked) >= now["num_nodes"]:
        problems.append(f"acknowledged node {max(acked)} is beyond the {now['num_nodes']} nodes after restart")
    if now["num_edges"] - base["num_edges"] != 2 * added:
        problems.append(f"{added} nodes added but {now['num_edges'] - base['num_edges']} edges: half applied")
    if acked:
        ids = sorted(set(acked))
        status, out = post_json(url, f"/v2/models/{MODEL}/infer", {
            "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}],
            "parameters": {"mode": "precomputed"}})
        if status != 200:
            problems.append(f"looking up the acknowledged nodes answered {status}: {out}")
    return problems
