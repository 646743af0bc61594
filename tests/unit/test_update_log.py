"""The durable update log (updates/log.py) and replay through the update applier."""

from __future__ import annotations

import asyncio
import sqlite3

import numpy as np
import pytest

from hybridgnn.config import UpdateConfig
from hybridgnn.errors import ConfigError
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch
from hybridgnn.serving.updates import UpdateApplier, decode_update_request
from hybridgnn.testing.graphs import dynamic_setup, update_body
from hybridgnn.types import ServingStats
from hybridgnn.updates.log import UpdateLog, decode_batch, encode_batch, parse_log_url


def test_a_batch_round_trips_through_its_record():
    batch = UpdateBatch(add_edges=np.array([[1, 2], [3, 4]]), remove_nodes=np.array([5]),
                        add_node_features=np.ones((1, 4), np.float32))
    back, base, ext = decode_batch(encode_batch(batch, 60, 4))
    assert base == 60 and len(ext) == 0 and back.add_edges.tolist() == [[1, 2], [3, 4]] and back.remove_nodes.tolist() == [5]
    assert back.add_node_features.shape == (1, 4) and back.update_features is None
    assert back.num_updates == batch.num_updates


def test_log_urls(tmp_path):
    assert parse_log_url(None, tmp_path) == tmp_path / "updates.sqlite"
    assert parse_log_url("off", tmp_path) is None
    assert str(parse_log_url("sqlite:///var/x.sqlite", tmp_path)) == "/var/x.sqlite"
    with pytest.raises(ConfigError, match="sqlite"):
        parse_log_url("redis://localhost/stream", tmp_path)


def test_the_log_keeps_order_and_belongs_to_one_dataset(tmp_path):
    log = UpdateLog(tmp_path / "u.sqlite", "abc", 4)
    for k in range(3):
        assert log.append(UpdateBatch(remove_nodes=np.array([k])), 10) == k + 1
    log.close()
    again = UpdateLog(tmp_path / "u.sqlite", "abc", 4)
    assert [(p, b.remove_nodes.tolist()) for p, b, _, _ in again.entries()] == [(1, [0]), (2, [1]), (3, [2])]
    assert [p for p, _, _, _ in again.entries(after=2)] == [3] and again.position == 3
    again.close()
    with pytest.raises(ConfigError, match="belongs to dataset abc"):
        UpdateLog(tmp_path / "u.sqlite", "other", 4)
    with pytest.raises(ConfigError, match="cannot open the update log"):
        UpdateLog(tmp_path / "u.sqlite" / "below-a-file.sqlite", "abc", 4)


def _requests():
    def dec(*inputs):
        return decode_update_request(update_body(*inputs), None, feature_dim=4, max_updates=100)

    return [dec(("update_ids", [1], "INT64"), ("update_features", np.ones((1, 4)), "FP32")),
            dec(("add_node_features", np.full((1, 4), 2.0), "FP32"), ("add_edges", [[-1, 3], [3, -1]], "INT64")),
            dec(("remove_nodes", [7], "INT64")),
            dec(("add_edges", [[60, 9]], "INT64"), ("remove_edges", [[0, 59]], "INT64"))]


def _serve(applier: UpdateApplier, requests) -> list:
    async def scenario():
        applier.start()
        out = []
        for r in requests:  # one at a time: each is its own batch and log record
            out.append(await asyncio.gather(applier.submit(r), return_exceptions=True))
        await applier.stop()
        return [o[0] for o in out]

    return asyncio.run(scenario())


def test_replay_rebuilds_exactly_what_was_acknowledged(tmp_path):
    dyn, inc, _ = (*dynamic_setup(tmp_path / "live"), None)
    log = UpdateLog(tmp_path / "u.sqlite", dyn.base.fingerprint, 4)
    results = _serve(UpdateApplier(UpdateConfig(token="12345678"), inc, dyn, ServingStats(), log), _requests())
    applied = [r for r in results if isinstance(r, dict)]
    assert [r["log_position"] for r in applied] == list(range(1, len(applied) + 1)) and len(log) == len(applied)
    log.close()

    fresh_dyn, fresh_inc, _ = (*dynamic_setup(tmp_path / "restart"), None)  # the stored dataset again, as after a restart
    log = UpdateLog(tmp_path / "u.sqlite", fresh_dyn.base.fingerprint, 4)
    replayer = UpdateApplier(UpdateConfig(token="12345678"), fresh_inc, fresh_dyn, ServingStats(), log)
    assert replayer.replay() == len(applied)
    assert (fresh_dyn.num_nodes, fresh_dyn.version) == (dyn.num_nodes, dyn.version)
    ids = np.flatnonzero(dyn.alive[:dyn.num_nodes])
    np.testing.assert_array_equal(fresh_inc.lookup(ids), inc.lookup(ids))  # the same batches, the same order
    np.testing.assert_array_equal(fresh_dyn.to_csr()[1], dyn.to_csr()[1])


def test_a_batch_whose_log_append_fails_is_rolled_back_and_not_acknowledged(tmp_path):
    dyn, inc = dynamic_setup(tmp_path)
    log = UpdateLog(tmp_path / "u.sqlite", dyn.base.fingerprint, 4)
    before = inc.lookup(np.arange(60)).copy()

    def disk_full(*args):
        raise sqlite3.OperationalError("database or disk is full")

    log.append = disk_full
    [result] = _serve(UpdateApplier(UpdateConfig(token="12345678"), inc, dyn, ServingStats(), log), _requests()[1:2])
    assert isinstance(result, sqlite3.OperationalError)
    assert dyn.num_nodes == 60 and dyn.version == 0
    np.testing.assert_array_equal(inc.lookup(np.arange(60)), before)


def test_a_log_that_does_not_fit_the_data_is_refused(tmp_path):
    dyn, inc = dynamic_setup(tmp_path)
    log = UpdateLog(tmp_path / "u.sqlite", dyn.base.fingerprint, 4)
    log.append(UpdateBatch(remove_nodes=np.array([3])), 61)  # applied live to a 61-node graph
    with pytest.raises(ConfigError, match="61 nodes"):
        UpdateApplier(UpdateConfig(token="12345678"), inc, dyn, ServingStats(), log).replay()


def test_graph_only_updates_are_logged_and_replayed_too(tmp_path):
    dyn, _, _ = (*dynamic_setup(tmp_path / "a"), None)
    log = UpdateLog(tmp_path / "u.sqlite", dyn.base.fingerprint, 4)
    _serve(UpdateApplier(UpdateConfig(token="12345678"), None, dyn, ServingStats(), log), _requests()[:2])
    other = DynamicGraph(dynamic_setup(tmp_path / "b")[0].base)
    assert UpdateApplier(UpdateConfig(token="12345678"), None, other, ServingStats(), log).replay() == 2
    assert other.num_nodes == 61 and (other.features(np.array([60])) == 2).all()


def test_an_id_map_names_added_nodes_for_lookups_both_ways():
    from hybridgnn.graph.idmap import IdMap

    names, _ = IdMap.build(np.array(["bob", "alice", "zed"]))
    names.extend(np.array(["carol", "al"]))
    internal, known = names.to_internal(np.array(["alice", "carol", "al", "mallory", "zed"]))
    assert internal.tolist() == [0, 3, 4, -1, 2] and known.tolist() == [True, True, True, False, True]
    assert names.to_external(np.array([4, 0, 3])).tolist() == ["al", "alice", "carol"] and len(names) == 5
    ints, _ = IdMap.build(np.array([100, 5, 70]))
    ints.extend(np.array([3, 1000]))
    assert ints.to_internal(np.array([3, 5, 1000, 7]))[0].tolist() == [3, 0, 4, -1]


def test_updates_on_a_mapped_dataset_translate_names_and_new_nodes():
    from hybridgnn.errors import BadRequest
    from hybridgnn.graph.idmap import IdMap

    names, _ = IdMap.build(np.array([f"n{i}" for i in range(5)]))

    def dec(*inputs):
        return decode_update_request(update_body(*inputs), None, feature_dim=4, max_updates=100, id_map=names)

    req = dec(("add_node_features", np.ones((2, 4)), "FP32"), ("add_node_ids", ["x", "y"], "BYTES"),
              ("add_edges", [["x", "n1"], ["n2", "y"], ["x", "y"]], "BYTES"), ("update_ids", ["y"], "BYTES"),
              ("update_features", np.zeros((1, 4)), "FP32"))
    assert req.add_edges.tolist() == [[-1, 1], [2, -2], [-1, -2]] and req.update_ids.tolist() == [-2]
    assert req.new_external_ids.tolist() == ["x", "y"]
    for inputs, match in [
        ((("add_node_features", np.ones((1, 4)), "FP32"),), "needs its id"),
        ((("add_node_features", np.ones((1, 4)), "FP32"), ("add_node_ids", ["n3"], "BYTES")), "already exists"),
        ((("remove_nodes", ["q"], "BYTES"),), "unknown node 'q'"),
        ((("remove_nodes", [1], "INT64"),), "must be BYTES"),
        ((("add_node_features", np.ones((2, 4)), "FP32"), ("add_node_ids", ["a", "a"], "BYTES")), "twice"),
    ]:
        with pytest.raises(BadRequest, match=match):
            dec(*inputs)
    with pytest.raises(BadRequest, match="id map"):
        decode_update_request(update_body(("remove_nodes", ["n1"], "BYTES")), None, feature_dim=4, max_updates=100)


def _keyed(req, key: str, digest: str):
    req.idempotency_key, req.body_sha256 = key, digest
    return req


@pytest.mark.parametrize("durable", [True, False])
def test_a_retried_update_with_the_same_idempotency_key_applies_once(tmp_path, durable):
    from hybridgnn.errors import Conflict

    dyn, inc = dynamic_setup(tmp_path / "g")
    log = UpdateLog(tmp_path / "u.sqlite", dyn.base.fingerprint, 4) if durable else None
    applier = UpdateApplier(UpdateConfig(token="12345678"), inc, dyn, ServingStats(), log)
    add = _requests()[1]

    async def scenario():
        applier.start()
        first, twin = applier.submit(_keyed(add, "k1", "h1")), applier.submit(_keyed(add, "k1", "h1"))
        assert twin is first  # a retry while the first is in flight waits for it
        one = await first
        again = await applier.submit(_keyed(_requests()[1], "k1", "h1"))
        with pytest.raises(Conflict, match="different update"):
            applier.submit(_keyed(_requests()[0], "k1", "h2"))
        await applier.stop()
        return one, again

    one, again = asyncio.run(scenario())
    assert again["replayed"] and again["new_node_ids"] == one["new_node_ids"] == [60]
    assert dyn.num_nodes == 61 and dyn.version == 1  # applied once
    if durable:  # the key outlives a restart
        log.close()
        fresh_dyn, fresh_inc = dynamic_setup(tmp_path / "restart")
        log = UpdateLog(tmp_path / "u.sqlite", fresh_dyn.base.fingerprint, 4)
        restarted = UpdateApplier(UpdateConfig(token="12345678"), fresh_inc, fresh_dyn, ServingStats(), log)
        restarted.replay()

        async def retry():
            return await restarted.submit(_keyed(_requests()[1], "k1", "h1"))

        answer = asyncio.run(retry())
        assert answer["replayed"] and answer["log_position"] == one["log_position"] and fresh_dyn.version == 1
