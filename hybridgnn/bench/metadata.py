"""What a server serves, as the load generator needs it: a model's metadata (GET
/v2/models/{m}) and how many nodes a load may draw ids 0..n-1 from."""

from __future__ import annotations

import json

import aiohttp

from hybridgnn.errors import ConfigError


async def fetch_metadata(url: str, model: str) -> dict:
    """The model's metadata (GET /v2/models/{m}); a refusal is a ConfigError saying what
    the server said (an unknown model was "ClientResponseError: 404, message='Not Found'",
    not the models the server does serve)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v2/models/{model}") as r:
            if r.status >= 400:
                text = await r.text()
                try:
                    said = json.loads(text).get("error") or text
                except (ValueError, AttributeError):
                    said = text
                said = " ".join(str(said).split())[:300] or r.reason
                raise ConfigError(f"cannot load {url} model {model!r}: the server answered {r.status}: {said}")
            return await r.json()


async def fetch_num_nodes(url: str, model: str, node_type: str | None = None) -> int:
    """How many nodes (of node_type, on a heterogeneous model) requests may draw ids
    0..n-1 from (load_size)."""
    return load_size(await fetch_metadata(url, model), node_type)


def load_size(metadata: dict, node_type: str | None = None) -> int:
    """The node count n in a model's metadata (GET /v2/models/{m}) whose ids 0..n-1 the
    load sends (of node_type on a heterogeneous model), or a ConfigError in one line for
    a model that the load cannot serve so: a heterogeneous one without a node type it
    answers (its metadata has no num_nodes: it was a KeyError), or nodes named by strings
    or sparse integer ids (every request was refused, and the run reported only an
    error count)."""
    params = metadata.get("parameters") or {}
    name = metadata.get("name", "the model")
    types = params.get("node_types")
    if types is None:
        if node_type is not None:
            raise ConfigError(f"model {name!r} is homogeneous: it takes no node type (--node-type {node_type!r})")
        nodes, count, ids = "nodes", params["num_nodes"], params.get("node_ids", "dense")
    else:
        answered = [t["name"] for t in types if t.get("output_dim") is not None]
        if node_type is None:
            raise ConfigError(f"model {name!r} is heterogeneous: bench loads it with node requests of one type; "
                              f"give --node-type (one of {answered})")
        if node_type not in answered:
            raise ConfigError(f"model {name!r} answers no node requests of type {node_type!r}; --node-type must "
                              f"be one of {answered}")
        kind = next(t for t in types if t["name"] == node_type)
        nodes, count, ids = f"{node_type!r} nodes", kind["num_nodes"], kind.get("node_ids", "dense")
    if ids != "dense":  # metadata before node_ids was reported said nothing: dense
        named = "strings" if ids == "string" else "sparse integer ids"
        raise ConfigError(f"model {name!r} names its {nodes} by {named} (node_ids {ids!r} in its metadata), and "
                          f"bench sends ids 0..n-1, which it would refuse: bench loads only graphs whose node ids "
                          f"are 0..n-1 (generated, or imported from ids 0..n-1)")
    return int(count)
