"""Requests to a heterogeneous model decoded: node, pair and top-k requests, every
refusal naming the input or parameter at fault, and (hypothesis) nothing a client sends
raising anything but a 4xx."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.config import NewNodeConfig
from hybridgnn.errors import BadRequest, Conflict, PayloadTooLarge, ServingError
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_import import write_hetero_edges
from hybridgnn.graph.idmap import IdMap
from hybridgnn.models.link import dot
from hybridgnn.serving.v2.typed import MAX_TOPK_PAIRS, decode_typed
from hybridgnn.serving.v2.types import InferInput, Tensor
from hybridgnn.types import TypedResult


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    names = np.array(["ann", "bob", "cy", "di"])
    users, _ = IdMap.build(names)
    nodes = {"user": {"features": np.zeros((4, 2), np.float32), "id_map": users},
             "item": {"features": np.zeros((6, 3), np.float32)},
             "tag": {"features": np.zeros((2, 1), np.float32)}}
    root = write_hetero_edges(tmp_path_factory.mktemp("tr") / "g", nodes,
                              {("user", "rates", "item"): np.array([[0, 1, 2], [0, 1, 5]]),
                               ("tag", "of", "item"): np.array([[0, 1], [2, 3]])}, undirected=True)
    return SimpleNamespace(graph=HeteroGraphStore.open(root), out_dims={"user": 4, "item": 4},
                           decoder=dot, link_pairs=[("user", "item"), ("item", "item")], serves_new_nodes=True,
                           max_feature_dim=3,
                           cfg=SimpleNamespace(server=SimpleNamespace(max_request_nodes=64), dataset_dir="D",
                                               model_dir="M", new_nodes=NewNodeConfig()))


def ids(name, values, datatype="INT64"):
    return Tensor(name, datatype, [len(values)], list(values))


def decode(engine, *inputs, outputs=None, **params):
    return decode_typed(InferInput("m", None, list(inputs), params, outputs), engine)


def test_the_three_request_kinds(engine):
    node = decode(engine, ids("node_ids", [0, 5]), node_type="item")
    assert node.query.kind == "node" and node.outputs == ("logits", "embeddings", "predictions")
    named = decode(engine, ids("node_ids", ["cy", "ann"], "BYTES"), node_type="user", outputs=["logits"])
    assert named.query.src_ids.tolist() == [2, 0] and named.outputs == ("logits",)
    pair = decode(engine, ids("src_ids", ["bob"], "BYTES"), ids("dst_ids", [3]), src_type="user", dst_type="item")
    assert (pair.query.kind, pair.query.src_ids.tolist(), pair.query.dst_ids.tolist()) == ("pair", [1], [3])
    top = decode(engine, ids("src_ids", [1, 2]), ids("candidate_ids", [0, 4, 5]), src_type="item",
                 dst_type="item", k=2)
    assert top.query.kind == "topk" and top.query.k == 2 and top.outputs == ("topk_ids", "topk_scores")
    result = TypedResult("cpu", None, topk_index=np.array([[2, 0], [1, 2]]), topk_scores=np.zeros((2, 2)))
    assert top.answer_outputs(result)[0][1].tolist() == [[5, 0], [4, 5]]  # candidates as named


def test_top_k_names_candidates_by_their_external_ids(engine):
    both = SimpleNamespace(**{**vars(engine), "link_pairs": [*engine.link_pairs, ("item", "user")]})
    top = decode(both, ids("src_ids", [0]), ids("candidate_ids", ["di", "ann"], "BYTES"), src_type="item",
                 dst_type="user", k=1)
    assert top.query.dst_ids.tolist() == [3, 0]
    result = TypedResult("cpu", None, topk_index=np.array([[1]]), topk_scores=np.zeros((1, 1)))
    assert top.answer_outputs(result)[0][1].tolist() == [["ann"]]


def test_a_top_k_over_a_whole_type_in_mode_precomputed(engine):
    both = SimpleNamespace(**{**vars(engine), "link_pairs": [*engine.link_pairs, ("item", "user")]})
    top = decode(both, ids("src_ids", [0, 5]), src_type="item", dst_type="user", k=2, mode="precomputed")
    assert top.mode == "precomputed" and top.query.whole_type and top.query.dst_ids.tolist() == [0, 1, 2, 3]
    result = TypedResult("precomputed", None, topk_index=np.array([[3, 0], [1, 2]]), topk_scores=np.zeros((2, 2)))
    assert top.answer_outputs(result)[0][1].tolist() == [["di", "ann"], ["bob", "cy"]]  # the type's own names
    node = decode(engine, ids("node_ids", [1]), node_type="item", mode="precomputed")
    assert node.mode == "precomputed" and not node.query.whole_type


def feats(rows):
    return Tensor("features", "FP32", [len(rows), len(rows[0])], [v for r in rows for v in r])


def test_new_nodes_with_neighbours_by_relation(engine):
    # two new users: user 0 rated items 1 and 5, user 1 rated item 5; reverse edges added
    req = decode(engine, feats([[0.5, 1.0], [0.0, -1.0]]), ids("neighbor_ids", [1, 5, 5]),
                 ids("query_index", [0, 0, 1]), node_type="user", edge_type="user__rates__item", mode="pe")
    new = req.query
    assert (new.node_type, new.mode, new.k) == ("user", "pe", 0) and req.outputs == ("logits", "embeddings",
                                                                                       "predictions")
    assert new.edges[("user", "rates", "item")].tolist() == [[4, 4, 5], [1, 5, 5]]  # query j is user 4 + j
    assert new.edges[("item", "rev_rates", "user")].tolist() == [[1, 5, 5], [4, 4, 5]]
    # a new item tagged and rated by named users (edge_type per neighbour), with its top-k items
    req = decode(engine, feats([[1.0, 2.0, 3.0]]), ids("neighbor_ids", ["di", "ann"], "BYTES"),
                 ids("edge_type", ["user__rates__item", "user__rates__item"], "BYTES"), node_type="item",
                 dst_type="item", k=2)
    assert req.query.edges[("user", "rates", "item")].tolist() == [[0, 3], [6, 6]]
    assert req.query.mode == "srpe" and req.query.k == 2 and "topk_ids" in req.outputs
    isolated = decode(engine, feats([[1.0, 2.0, 3.0]]), node_type="item")
    assert isolated.query.edges == {}
    # empty neighbour lists are isolated nodes too, whichever way the relation is given
    # (an empty edge_type input was served so, a parameters.edge_type was a 400), or with
    # none given: no edge needs a relation (that was a 400 asking for parameters.edge_type)
    for relation, empty in (({"edge_type": "user__rates__item"}, []), ({}, [ids("edge_type", [], "BYTES")]),
                            ({}, [])):
        req = decode(engine, feats([[1.0, 2.0, 3.0]]), ids("neighbor_ids", []), *empty, node_type="item",
                     **relation)
        assert req.query.edges == {}


def test_a_new_node_request_refused_for_k_is_refused_before_its_edges_are_decoded(engine, monkeypatch):
    """Decoding half a million edges held the event loop 0.8 s, and a request bound to be
    refused for its k was decoded all the same."""
    import hybridgnn.serving.v2.typed as typed

    monkeypatch.setattr(typed, "_new_node_edges", lambda *a: pytest.fail("edges decoded before the refusal"))
    with pytest.raises(BadRequest, match="parameters.k"):
        decode(engine, feats([[1.0, 2.0, 3.0]]), ids("neighbor_ids", [1]), node_type="item",
               edge_type="user__rates__item", dst_type="item", k=0)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(cols=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=30))
def test_unique_columns_are_numpys_unique_along_axis_1(cols):
    from hybridgnn.serving.v2.typed import _unique_columns

    ei = np.array(cols, dtype=np.int64).reshape(-1, 2).T
    assert np.array_equal(_unique_columns(ei), np.unique(ei, axis=1))


@pytest.mark.parametrize("inputs, params, words", [
    ([feats([[1.0, 2.0]])], {}, "parameters.node_type is required"),
    ([feats([[1.0, 2.0]])], {"node_type": "user", "mode": "sampled"}, "parameters.mode"),
    ([feats([[1.0]])], {"node_type": "user"}, "features must have 2 columns"),
    ([feats([[float("nan"), 1.0]])], {"node_type": "user"}, "finite"),
    ([feats([[1.0, 2.0]]), ids("neighbor_ids", [1])], {"node_type": "user"}, "parameters.edge_type"),
    ([feats([[1.0, 2.0]]), ids("neighbor_ids", [1])], {"node_type": "user", "edge_type": "tag__of__item"},
     "not an edge type touching node type 'user'"),
    ([feats([[1.0, 2.0]]), ids("neighbor_ids", [9])], {"node_type": "user", "edge_type": "user__rates__item"},
     "neighbor_ids: id 9 is out of range for node type 'item'"),
    ([feats([[1.0, 2.0], [1.0, 2.0]]), ids("neighbor_ids", [1])], {"node_type": "user",
                                                                    "edge_type": "user__rates__item"},
     "query_index is required"),
    ([feats([[1.0, 2.0]]), ids("neighbor_ids", [1]), ids("query_index", [1])],
     {"node_type": "user", "edge_type": "user__rates__item"}, "query_index must lie in"),
    ([feats([[1.0, 2.0]]), ids("neighbor_ids", [1, 2]), ids("edge_type", ["user__rates__item"], "BYTES")],
     {"node_type": "user"}, "edge_type must have one entry per neighbor_ids"),
    ([feats([[1.0, 2.0]]), ids("node_ids", [1])], {"node_type": "user"}, "do not go with 'features'"),
    ([feats([[1.0, 2.0]])], {"node_type": "user", "gamma": 2}, "parameters.gamma"),
    ([feats([[1.0, 2.0, 3.0]])], {"node_type": "item", "k": 2}, "parameters.dst_type is required"),
    ([feats([[1.0, 2.0, 3.0]])], {"node_type": "item", "k": 0, "dst_type": "item"}, "parameters.k"),
    ([ids("neighbor_ids", [1])], {"node_type": "user"}, "needs 'features'"),
])
def test_new_node_refusals_name_the_field(engine, inputs, params, words):
    with pytest.raises(BadRequest, match=words) as err:
        decode(engine, *inputs, **params)
    assert err.value.status == 400


def test_new_nodes_without_precomputed_embeddings_are_a_conflict(engine):
    bare = SimpleNamespace(**{**vars(engine), "serves_new_nodes": False})
    with pytest.raises(Conflict, match="hybridgnn precompute"):
        decode(bare, feats([[1.0, 2.0]]), node_type="user")


@pytest.mark.parametrize("inputs, params, words", [
    ([ids("node_ids", [0])], {}, "parameters.node_type is required"),
    ([ids("node_ids", [0])], {"node_type": "movie"}, "parameters.node_type: unknown node type 'movie'"),
    ([ids("node_ids", [0])], {"node_type": "tag"}, "parameters.node_type: unknown node type 'tag'"),
    ([ids("node_ids", [6])], {"node_type": "item"}, "node_ids: id 6 is out of range for node type 'item'"),
    ([ids("node_ids", [-1])], {"node_type": "item"}, "node_ids: id -1 is out of range"),
    ([ids("node_ids", [0])], {"node_type": "user"}, "node_ids must be BYTES"),
    ([ids("node_ids", ["zed"], "BYTES")], {"node_type": "user"}, "node_ids: unknown 'user' id 'zed'"),
    ([ids("node_ids", ["x"], "BYTES")], {"node_type": "item"}, "node_ids must be INT64"),
    ([ids("node_ids", [])], {"node_type": "item"}, "node_ids is empty"),
    ([ids("src_ids", [0, 1]), ids("dst_ids", [1])], {"src_type": "item", "dst_type": "item"},
     "src_ids and dst_ids must have the same length"),
    ([ids("src_ids", [0]), ids("dst_ids", [9])], {"src_type": "item", "dst_type": "item"}, "dst_ids: id 9"),
    ([ids("src_ids", [0]), ids("dst_ids", [1])], {"src_type": "item"}, "parameters.dst_type is required"),
    ([ids("src_ids", [0]), ids("dst_ids", [1])], {"src_type": "item", "dst_type": "user"},
     "parameters.dst_type: unknown node type 'user'"),
    ([ids("src_ids", [0]), ids("dst_ids", [1])], {"src_type": "tag", "dst_type": "item"},
     "parameters.src_type: unknown node type 'tag'"),
    ([ids("src_ids", [0]), ids("candidate_ids", [1, 2])], {"src_type": "item", "dst_type": "item"},
     "parameters.k must be an integer in \\[1, 2\\]"),
    ([ids("src_ids", [0]), ids("candidate_ids", [1, 2])], {"src_type": "item", "dst_type": "item", "k": 3},
     "parameters.k"),
    ([ids("src_ids", [0]), ids("candidate_ids", [1, 2])], {"src_type": "item", "dst_type": "item", "k": True},
     "parameters.k"),
    ([ids("src_ids", [0])], {"src_type": "item", "dst_type": "item", "k": 1}, "needs parameters.mode 'precomputed'"),
    ([ids("src_ids", [0])], {"src_type": "item", "dst_type": "item", "mode": "precomputed"}, "parameters.k"),
    ([ids("node_ids", [0]), ids("src_ids", [0])], {}, "do not make a request"),
    ([ids("weights", [0])], {}, "unknown input 'weights'"),
    ([ids("node_ids", [0])], {"node_type": "item", "mode": "full"}, "parameters.mode"),
])
def test_refusals_name_the_field(engine, inputs, params, words):
    with pytest.raises(BadRequest, match=words) as err:
        decode(engine, *inputs, **params)
    assert err.value.status == 400


def test_limits_and_a_model_without_decoder(engine):
    with pytest.raises(PayloadTooLarge, match="at most 64"):
        decode(engine, ids("node_ids", [0] * 65), node_type="item")
    big = SimpleNamespace(**{**vars(engine), "cfg": SimpleNamespace(server=SimpleNamespace(max_request_nodes=1 << 20))})
    with pytest.raises(PayloadTooLarge, match="pairs to score"):
        decode(big, ids("src_ids", [0] * 3000), ids("candidate_ids", [1] * (MAX_TOPK_PAIRS // 3000 + 1)),
               src_type="item", dst_type="item", k=1)
    # n x k bounds the answer (encoded on the event loop: 2048 x 2048 held it 0.5 s)
    with pytest.raises(PayloadTooLarge, match="600 seeds x k 500 = 300000 top-k entries to answer; the limit is"):
        decode(big, ids("src_ids", [0] * 600), ids("candidate_ids", list(range(6)) * 100), src_type="item",
               dst_type="item", k=500)
    assert decode(big, ids("src_ids", [0] * 500), ids("candidate_ids", list(range(6)) * 100), src_type="item",
                  dst_type="item", k=500).query.k == 500
    for ntype, width in (("user", 2), ("item", 3)):  # too many query nodes, whatever the type's width
        with pytest.raises(PayloadTooLarge, match="features"):
            decode(engine, feats([[0.0] * width] * 65), node_type=ntype)
    bare = SimpleNamespace(**{**vars(engine), "decoder": None, "link_pairs": []})
    with pytest.raises(BadRequest, match="no link decoder"):
        decode(bare, ids("src_ids", [0]), ids("dst_ids", [1]), src_type="item", dst_type="item")
    with pytest.raises(BadRequest, match="unknown output 'scores' for a node request"):
        decode(engine, ids("node_ids", [0]), node_type="item", outputs=["scores"])


_names = st.sampled_from(["node_ids", "src_ids", "dst_ids", "candidate_ids", "features", "neighbor_ids",
                          "query_index", "edge_type", "x", ""])
_values = st.one_of(st.lists(st.integers(-10, 10), max_size=5), st.lists(st.text(max_size=3), max_size=5),
                    st.lists(st.floats(allow_nan=True), max_size=3), st.none(), st.text(max_size=3))
_tensor = st.builds(Tensor, _names, st.sampled_from(["INT64", "INT32", "BYTES", "FP32", "BOOL", 3]),
                    st.one_of(st.lists(st.integers(-1, 6), max_size=3), st.none(), st.text(max_size=2)), _values)
_params = st.dictionaries(st.sampled_from(["node_type", "src_type", "dst_type", "k", "mode", "edge_type", "gamma",
                                           "policy"]),
                          st.one_of(st.sampled_from(["user", "item", "tag", "x", "user__rates__item", "pe",
                                                     "item__rev_rates__user", "precomputed"]),
                                    st.integers(-2, 5), st.none(), st.floats(), st.booleans(),
                                    st.lists(st.integers(), max_size=2)), max_size=5)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=st.lists(_tensor, max_size=4), params=st.one_of(_params, st.lists(st.integers(), max_size=1)))
def test_nothing_a_client_sends_raises_but_a_4xx(engine, inputs, params):
    try:
        decode_typed(InferInput("m", None, inputs, params), engine)
    except ServingError as exc:
        assert 400 <= exc.status < 500


def test_a_new_paper_on_a_relation_stored_both_ways_gets_both_directions(tmp_path):
    nodes = {"paper": {"features": np.zeros((4, 2), np.float32)}}
    both = write_hetero_edges(tmp_path / "u", nodes, {("paper", "cites", "paper"): np.array([[0, 1], [1, 2]])},
                              undirected=True)
    one = write_hetero_edges(tmp_path / "d", nodes, {("paper", "cites", "paper"): np.array([[0, 1], [1, 2]])})
    got = {}
    for name, root in (("both", both), ("one", one)):
        eng = SimpleNamespace(graph=HeteroGraphStore.open(root), out_dims={"paper": 2}, decoder=None, link_pairs=[],
                              serves_new_nodes=True, max_feature_dim=2,
                              cfg=SimpleNamespace(server=SimpleNamespace(max_request_nodes=8), dataset_dir="D",
                                                  model_dir="M", new_nodes=NewNodeConfig()))
        got[name] = decode(eng, feats([[1.0, 2.0]]), ids("neighbor_ids", [3]), node_type="paper",
                           edge_type="paper__cites__paper").query.edges[("paper", "cites", "paper")].tolist()
    assert got["both"] == [[3, 4], [4, 3]]  # new paper 4 cites 3, and 3 reads 4 back
    assert got["one"] == [[4], [3]]  # a directed relation: the query node is its source
