"""What the v2 service says about a model: its metadata (GET /v2/models/{m}, gRPC
ModelMetadata) and its configuration in the shape Triton's model configuration takes
(.../config, gRPC ModelConfig: what tritonclient's get_model_config reads)."""

from __future__ import annotations

from hybridgnn.serving.v2.tensors import INPUT_NAME
from hybridgnn.serving.v2.types import ID_OUTPUT

_TRITON_TYPES = {"INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}


def describe_model(engine, name: str, versions: list[str]) -> dict:
    """A model's metadata: name, versions, platform, inputs, outputs, parameters (the
    engine's own description)."""
    if getattr(engine, "typed", False):
        return _describe_typed(engine, name, versions)
    id_map = engine.graph.id_map
    id_type = "BYTES" if id_map is not None and id_map.kind == "string" else "INT64"
    outputs = [{"name": "logits", "datatype": "FP32", "shape": [-1, engine.out_dim]},
               {"name": "embeddings", "datatype": "FP32", "shape": [-1, engine.embedding_dim]},
               {"name": "predictions", "datatype": "INT64", "shape": [-1]}]
    if id_map is not None:
        outputs.append({"name": ID_OUTPUT, "datatype": id_type, "shape": [-1]})
    return {
        "name": name,
        "versions": versions,
        "platform": "pytorch_geometric",
        "inputs": [{"name": INPUT_NAME, "datatype": id_type, "shape": [-1]}],
        "outputs": outputs,
        "parameters": engine.metadata(),
    }


def _describe_typed(engine, name: str, versions: list[str]) -> dict:
    """A heterogeneous model: ids are INT64, or BYTES for node types named by strings
    (parameters.node_types says which); outputs by request kind."""
    kinds = {m.kind for n in engine.graph.nodes.values() if (m := n.id_map) is not None}
    id_type = "BYTES" if kinds == {"string"} else "INT64"
    inputs = [{"name": "node_ids", "datatype": id_type, "shape": [-1]}]
    outputs = [{"name": "logits", "datatype": "FP32", "shape": [-1, -1]},
               {"name": "embeddings", "datatype": "FP32", "shape": [-1, -1]},
               {"name": "predictions", "datatype": "INT64", "shape": [-1]}]
    if engine.decoder is not None:
        inputs += [{"name": n, "datatype": id_type, "shape": [-1]} for n in ("src_ids", "dst_ids", "candidate_ids")]
        outputs += [{"name": "scores", "datatype": "FP32", "shape": [-1]},
                    {"name": "topk_ids", "datatype": id_type, "shape": [-1, -1]},
                    {"name": "topk_scores", "datatype": "FP32", "shape": [-1, -1]}]
    if engine.serves_new_nodes:
        inputs += [{"name": "features", "datatype": "FP32", "shape": [-1, -1]},
                   {"name": "neighbor_ids", "datatype": id_type, "shape": [-1]},
                   {"name": "query_index", "datatype": "INT64", "shape": [-1]},
                   {"name": "edge_type", "datatype": "BYTES", "shape": [-1]}]
    return {"name": name, "versions": versions, "platform": "pytorch_geometric", "inputs": inputs,
            "outputs": outputs, "parameters": engine.metadata()}


def config_of(engine, name: str, versions: list[str]) -> dict:
    d = describe_model(engine, name, versions)
    return {
        "name": d["name"], "platform": d["platform"], "backend": "hybridgnn", "max_batch_size": 0,
        "input": [{"name": t["name"], "data_type": _TRITON_TYPES[t["datatype"]], "dims": t["shape"]}
                  for t in d["inputs"]],
        "output": [{"name": t["name"], "data_type": _TRITON_TYPES[t["datatype"]], "dims": t["shape"]}
                   for t in d["outputs"]],
        "version_policy": {"specific": {"versions": [int(v) for v in d["versions"] if v.isdigit()]}},
        "parameters": {"fanouts": {"string_value": _fanouts_text(engine)}},
    }


def _fanouts_text(engine) -> str:
    if getattr(engine, "typed", False):  # per edge type: src__rel__dst=10,5;...
        return ";".join(f"{k}={','.join(map(str, v))}" for k, v in engine.metadata()["fanouts"].items())
    return ",".join(map(str, engine.cfg.sampling.fanouts))
