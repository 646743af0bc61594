"""docs/api.md against the real server: every example answer the page marks with
`<!-- answer: METHOD PATH [STATUS] -->` (followed by a ```json block) is fetched live and
must have the same structure: the same keys at every level, the same JSON types, and the
same strings except where they name the dataset, a path or a message. Numbers need not
be equal (counts, widths and times depend on the dataset and the moment).

A POST takes the body of the `<!-- request: METHOD PATH -->` block for the same path
when the page has one; otherwise the test makes one (a graph update fitted to the test
graph's feature width, an empty body for the repository endpoints). Paths under
/v2/repository/models/ go to a server started with --model-repository, the others to a
one-model server with graph updates on. Examples are fetched in page order."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import requests

from tests.support.server import ServerProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TOKEN = "api-docs-token"
MODEL = "hybridgnn"

_MARKED = re.compile(r"<!--\s*(answer|request):\s*([A-Z]+)\s+(\S+)(?:\s+(\d{3}))?\s*-->\s*\n```json\n(.*?)\n```",
                     re.S)
# String values that name the dataset, a file or a message: compared by type only.
_FREE_STRINGS = {"dataset", "dataset_fingerprint", "update_log", "snapshot", "string_value", "error", "reason",
                 "update_follower_error", "version"}


def documented(text: str) -> tuple[list[tuple[str, str, int, object]], dict[tuple[str, str], object]]:
    """The page's example answers (method, path, status, JSON) in order, and its example
    requests by (method, path)."""
    answers, requests_ = [], {}
    for kind, method, path, status, body in _MARKED.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"docs/api.md: the {kind} for {method} {path} is not JSON: {exc}") from exc
        if kind == "answer":
            answers.append((method, path, int(status or 200), value))
        else:
            requests_[(method, path)] = value
    return answers, requests_


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def mismatches(doc, live, where: str = "", key: str | None = None) -> list[str]:
    """Where the documented value's structure differs from the live one's."""
    if _kind(doc) != _kind(live):
        return [f"{where or '(top)'}: documented {_kind(doc)} {json.dumps(doc)[:60]}, "
                f"live {_kind(live)} {json.dumps(live)[:60]}"]
    if isinstance(doc, dict):
        out = []
        for k in sorted(doc.keys() - live.keys()):
            out.append(f"{where}.{k}: documented, not sent")
        for k in sorted(live.keys() - doc.keys()):
            out.append(f"{where}.{k}: sent, not documented")
        for k in sorted(doc.keys() & live.keys()):
            out += mismatches(doc[k], live[k], f"{where}.{k}", k)
        return out
    if isinstance(doc, list):
        if len(doc) == len(live):
            return [m for i, (d, v) in enumerate(zip(doc, live, strict=True))
                    for m in mismatches(d, v, f"{where}[{i}]", key)]
        scalar = all(not isinstance(x, (dict, list)) for x in doc + live)
        if scalar and {_kind(x) for x in doc} == {_kind(x) for x in live}:  # data of another size
            return []
        return [f"{where}: documented {len(doc)} items {json.dumps(doc)[:60]}, live {len(live)} "
                f"{json.dumps(live)[:60]}"]
    if isinstance(doc, str) and key not in _FREE_STRINGS and doc != live:
        return [f"{where}: documented {doc!r}, live {live!r}"]
    return []


def test_documented_structure_is_checked():
    """The comparison finds a key too many, a key missing and a changed type or string."""
    live = {"a": 1, "b": [{"c": "x"}], "d": [0.5, 1.5]}
    assert mismatches({"a": 2, "b": [{"c": "x"}], "d": [1.0]}, live) == []
    assert mismatches({"a": 2, "b": [{"c": "x"}], "d": [1.0], "bogus": 0}, live) == [".bogus: documented, not sent"]
    assert mismatches({"a": 2, "b": [{"c": "x"}]}, live) == [".d: sent, not documented"]
    assert len(mismatches({"a": "2", "b": [{"c": "y"}], "d": [1.0]}, live)) == 2
    answers, _ = documented(DOC.read_text())
    assert len(answers) >= 12, "docs/api.md lost its marked examples"


@pytest.fixture(scope="module")
def servers(tiny_dataset, tiny_model_pe, tmp_path_factory):
    """A one-model server with graph updates on, and a model-repository server serving
    the same model as MODEL version 1 and as `other` (the last model served cannot be
    unloaded)."""
    log = tmp_path_factory.mktemp("api-docs-log") / "updates.sqlite"
    repo = tmp_path_factory.mktemp("api-docs-repository")
    shutil.copytree(tiny_model_pe, repo / MODEL / "1")
    shutil.copytree(tiny_model_pe, repo / "other" / "1")
    one = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-token", TOKEN,
                        "--update-log", str(log))
    many = ServerProcess(tiny_dataset, None, "--workers", "1", "--model-repository", str(repo),
                         "--update-token", TOKEN)
    try:
        one.wait_ready()
        many.wait_ready()
        yield one, many
    finally:
        for srv in (one, many):
            srv.stop()


def _graph_update(url: str) -> dict:
    """One new node with an edge each way, and one rewritten feature row, at the graph's width."""
    width = requests.get(f"{url}/v2/models/{MODEL}", timeout=10).json()["parameters"]["feature_dim"]
    return {"inputs": [
        {"name": "add_node_features", "shape": [1, width], "datatype": "FP32", "data": [0.1] * width},
        {"name": "add_edges", "shape": [2, 2], "datatype": "INT64", "data": [[-1, 17], [17, -1]]},
        {"name": "update_ids", "shape": [1], "datatype": "INT64", "data": [4]},
        {"name": "update_features", "shape": [1, width], "datatype": "FP32", "data": [0.2] * width}]}


def test_every_documented_answer_matches_the_server(servers):
    one, many = servers
    answers, bodies = documented(DOC.read_text())
    problems = []
    for method, path, status, doc in answers:
        url = (many if path.startswith("/v2/repository/models/") else one).url
        headers = {"Authorization": f"Bearer {TOKEN}"} if path.endswith(("/graph", "/load", "/unload")) else {}
        body = None
        if method == "POST":
            body = bodies.get((method, path))
            if body is None and path.endswith("/graph"):
                body = _graph_update(url)
        r = requests.request(method, url + path, json=body, headers=headers, timeout=60)
        if r.status_code != status:
            problems.append(f"{method} {path}: documented status {status}, live {r.status_code}: {r.text[:200]}")
            continue
        problems += [f"{method} {path}: {m}" for m in mismatches(doc, r.json())]
    assert not problems, "docs/api.md differs from the server:\n" + "\n".join(problems)
