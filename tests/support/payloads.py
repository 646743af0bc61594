"""Request bodies and /metrics parsing for tests (no sockets here)."""

from __future__ import annotations


def body(ids) -> dict:
    return {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)}]}


def counter(metrics: str, name: str, **labels) -> float:
    """The value of one sample in a /metrics text."""
    want = ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}") if labels else ""
    for line in metrics.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{want} not in metrics")
