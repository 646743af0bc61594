"""The ranks' identities compared before their first collective: which fields differ,
which ranks hold which value, and the one line every rank raises."""

from __future__ import annotations

import numpy as np

from hybridgnn.distributed.agreement import disagreement_error, disagreements
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.errors import ConfigError


def _ident(**changes) -> dict:
    base = {"hybridgnn": "0.1.0", "ranks": 4, "partition": "metis", "dataset": "d1", "model": "m1",
            "embeddings": "e1"}
    return {**base, **changes}


def test_ranks_that_agree_give_nothing():
    same = [_ident() for _ in range(4)]
    assert disagreements(same) == []
    assert disagreement_error(same, "partition ranks", "fix it") is None


def test_each_differing_field_names_its_values_and_the_ranks_holding_them():
    idents = [_ident(), _ident(partition="ranges"), _ident(partition="ranges", embeddings=None),
              _ident(partition="ranges")]
    assert disagreements(idents) == ["partition 'metis' on rank 0, 'ranges' on ranks 1-3",
                                     "embeddings 'e1' on ranks 0-1, 3, none on rank 2"]


def test_the_error_is_one_line_naming_the_group_the_fields_and_what_to_do():
    idents = [_ident(ranks=2, model="m1"), _ident(ranks=2, model="m2")]
    exc = disagreement_error(idents, "partition ranks", "give every rank the same --model")
    assert isinstance(exc, ConfigError)
    text = str(exc)
    assert text == ("the 2 partition ranks do not agree on model 'm1' on rank 0, 'm2' on rank 1: "
                    "give every rank the same --model")
    assert "\n" not in text


def test_a_field_one_rank_lacks_counts_as_none_and_many_values_are_counted():
    idents = [_ident(), {k: v for k, v in _ident().items() if k != "embeddings"}]
    assert disagreements(idents) == ["embeddings 'e1' on rank 0, none on rank 1"]
    many = [_ident(dataset=f"d{r}") for r in range(7)]
    (line,) = disagreements(many)
    assert line.startswith("dataset 'd0' on rank 0, 'd1' on rank 1, 'd2' on rank 2, 'd3' on rank 3")
    assert line.endswith("3 other values")


def test_an_embedding_store_fingerprint_names_what_it_was_computed_from_not_when(tmp_path):
    layers = [np.zeros((3, 2), np.float32)]
    state = {"num_layers": 1, "dims": [2], "dtype": "float32", "model_fingerprint": "w", "features_fingerprint": "f",
             "complete": True, "computed_unix_s": 1.0, "precompute_s": 3.0}
    a = EmbeddingStore(tmp_path, layers, state)
    again = EmbeddingStore(tmp_path, layers, {**state, "computed_unix_s": 2.0, "precompute_s": 9.0,
                                              "distributed": {"ranks": 2}})
    assert a.fingerprint == again.fingerprint
    assert a.fingerprint != EmbeddingStore(tmp_path, layers, {**state, "model_fingerprint": "w2"}).fingerprint
    assert a.fingerprint != EmbeddingStore(tmp_path, layers, {**state, "dtype": "float16"}).fingerprint
    assert a.fingerprint != EmbeddingStore(tmp_path, layers, state, output=layers[0]).fingerprint
