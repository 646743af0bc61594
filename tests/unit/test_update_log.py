"""The update log (updates/log.py), its entries, followers replaying it, and snapshots."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from hybridgnn.errors import ConfigError, Conflict, LogTrimmed, ServiceUnavailable
from hybridgnn.graph.dynamic import DynamicGraph
from hybridgnn.updates.log import MemoryLog, SqliteLog, open_update_log, parse_log_url
from hybridgnn.updates.requests import (
    LoggedRequest,
    build_request,
    decode_entry,
    encode_entry,
)
from hybridgnn.updates.snapshot import Snapshots
from tests.support.graphs import dynamic_setup, update_body
from tests.support.updates import follower_for, run_updates
from tests.support.v2_codec import decode_update_request


def test_an_entry_round_trips_with_its_requests_keys_and_id_kinds():
    reqs = [LoggedRequest({"add_edges": np.array([[1, 2], [3, 4]]), "remove_nodes": np.array([5])}, "k1", "d1"),
            LoggedRequest({"add_node_features": np.ones((1, 4), np.float32), "add_node_ids": np.array(["x"]),
                           "add_edges": np.array([["x", "n1"]])}),
            LoggedRequest({"remove_nodes": np.array([7, 8])}, "k2", "d2")]
    back = decode_entry(encode_entry(reqs))
    assert [r.idempotency_key for r in back] == ["k1", None, "k2"] and back[0].body_sha256 == "d1"
    assert back[0].inputs["add_edges"].tolist() == [[1, 2], [3, 4]] and back[2].inputs["remove_nodes"].tolist() == [7, 8]
    assert back[1].inputs["add_node_ids"].tolist() == ["x"] and back[1].inputs["add_edges"].tolist() == [["x", "n1"]]
    assert back[1].inputs["add_node_features"].shape == (1, 4) and "remove_nodes" not in back[1].inputs
    with pytest.raises(ValueError):
        decode_entry(b"not an entry")


def test_log_urls(tmp_path):
    assert parse_log_url(None, tmp_path) == f"sqlite://{(tmp_path / 'updates.sqlite').resolve()}"
    assert parse_log_url("off", tmp_path) == "off" and parse_log_url("redis://h:1/s", tmp_path) == "redis://h:1/s"
    assert parse_log_url("sqlite:///var/x.sqlite", tmp_path) == "sqlite:///var/x.sqlite"
    assert parse_log_url("rel.sqlite", tmp_path).endswith("/rel.sqlite")
    with pytest.raises(ConfigError, match="redis://host:port"):
        parse_log_url("kafka://h/t", tmp_path)
    assert isinstance(open_update_log("off", tmp_path, "abc"), MemoryLog)


def test_the_sqlite_log_keeps_order_is_shared_and_belongs_to_one_dataset(tmp_path):
    log = SqliteLog(tmp_path / "u.sqlite", "abc")
    other = SqliteLog(tmp_path / "u.sqlite", "abc")  # another replica on this machine
    assert [log.append(b"a"), other.append(b"b"), log.append(b"c")] == [1, 2, 3]
    assert [(e.position, e.body) for e in other.read(0, 10)] == [(1, b"a"), (2, b"b"), (3, b"c")]
    assert [e.position for e in log.read(2, 10)] == [3] and log.head() == other.head() == 3
    assert log.log_id == other.log_id and len(log) == 3
    assert log.read(3, 10, block_s=0.02) == []  # waits, then nothing
    log.close()
    other.close()
    with pytest.raises(ConfigError, match="belongs to dataset abc"):
        SqliteLog(tmp_path / "u.sqlite", "other")
    with pytest.raises(ConfigError, match="cannot open the update log"):
        SqliteLog(tmp_path / "u.sqlite" / "below-a-file.sqlite", "abc")


def _requests():
    def dec(*inputs):
        return decode_update_request(update_body(*inputs), None, feature_dim=4, max_updates=100)

    return [dec(("update_ids", [1], "INT64"), ("update_features", np.ones((1, 4)), "FP32")),
            dec(("add_node_features", np.full((1, 4), 2.0), "FP32"), ("add_edges", [[-1, 3], [3, -1]], "INT64")),
            dec(("remove_nodes", [7], "INT64"),),
            dec(("add_edges", [[60, 9]], "INT64"), ("remove_edges", [[0, 59]], "INT64"))]


def _same_state(dyn, inc, other_dyn, other_inc):
    assert (other_dyn.num_nodes, other_dyn.version) == (dyn.num_nodes, dyn.version)
    ids = np.flatnonzero(dyn.alive[:dyn.num_nodes])
    np.testing.assert_array_equal(other_inc.lookup(ids), inc.lookup(ids))
    np.testing.assert_array_equal(other_dyn.to_csr()[1], dyn.to_csr()[1])
    np.testing.assert_array_equal(other_dyn.features(np.arange(dyn.num_nodes)), dyn.features(np.arange(dyn.num_nodes)))


def test_a_second_follower_of_the_log_reaches_the_same_state(tmp_path):
    """What a restart (or another replica) does: apply the same log from the start."""
    dyn, inc = dynamic_setup(tmp_path / "live")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    results = run_updates(follower_for(dyn, inc, log), _requests())
    applied = [r for r in results if isinstance(r, dict)]
    assert [r["graph_version"] for r in applied] == list(range(1, len(applied) + 1)) and len(log) == len(applied)
    fresh_dyn, fresh_inc = dynamic_setup(tmp_path / "restart")
    replica = follower_for(fresh_dyn, fresh_inc, SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint))
    assert replica.catch_up() == len(applied) and replica.applied == log.head()
    _same_state(dyn, inc, fresh_dyn, fresh_inc)


def test_an_update_the_log_refuses_is_not_applied_and_says_so(tmp_path):
    dyn, inc = dynamic_setup(tmp_path)
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    before = inc.lookup(np.arange(60)).copy()

    def disk_full(body):
        raise ServiceUnavailable("the update log refused the append: database or disk is full")

    log.append = disk_full
    [result] = run_updates(follower_for(dyn, inc, log), _requests()[1:2])
    assert isinstance(result, ServiceUnavailable) and result.status == 503
    assert dyn.num_nodes == 60 and dyn.version == 0
    np.testing.assert_array_equal(inc.lookup(np.arange(60)), before)


def test_an_entry_that_does_not_apply_is_rejected_alike_on_every_replica(tmp_path):
    dyn, inc = dynamic_setup(tmp_path)
    log = MemoryLog()
    log.append(encode_entry([LoggedRequest({"remove_nodes": np.array([600])})]))  # no such node
    log.append(b"garbage")  # unreadable: skipped
    log.append(encode_entry([_requests()[2].logged]))
    follower = follower_for(dyn, inc, log)
    outcomes = [o for _, o in follower.step()]
    assert "unknown node 600" in str(outcomes[0][0]) and outcomes[1] == [] and outcomes[2][0]["graph_version"] == 3
    assert follower.applied == 3 and not dyn.alive[7]


def _damaged_entries() -> list[tuple[str, bytes]]:
    import io
    import zipfile

    blob = encode_entry([_requests()[2].logged, LoggedRequest({"add_edges": np.array([[1, 2], [3, 4]])}, "k", "d")])
    crc = bytearray(blob)
    crc[zipfile.ZipFile(io.BytesIO(blob)).getinfo("counts.npy").header_offset + 100] ^= 0xFF  # a byte of data
    entries = [("cut short", blob[:len(blob) // 2]), ("a changed byte", bytes(crc))]
    for name, counts in (("a negative count", -1), ("a count past its column", 5)):
        with np.load(io.BytesIO(blob)) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["counts"][1, 0] = counts  # the second request's add_edges: silently other slices
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        entries.append((name, buf.getvalue()))
    return entries


def test_a_damaged_entry_is_skipped_alike_on_every_replica_not_a_stopped_follower(tmp_path):
    """A cut or changed blob raised zipfile's BadZipFile (or EOFError, NotImplementedError,
    RuntimeError), which the follower did not take for damage: it stopped there (a
    traceback at start). Counts that did not match their columns were read as other slices."""
    dyn, inc = dynamic_setup(tmp_path)
    log = MemoryLog()
    damaged = _damaged_entries()
    for _, blob in damaged:
        log.append(blob)
    log.append(encode_entry([_requests()[2].logged]))
    for name, blob in damaged:
        with pytest.raises(ValueError, match="not a log entry|counts|does not hold") as info:
            decode_entry(blob)
        assert "\n" not in str(info.value), name
    follower = follower_for(dyn, inc, log)
    outcomes = [o for _, o in follower.step()]
    assert outcomes[:len(damaged)] == [[]] * len(damaged) and outcomes[-1][0]["graph_version"] == len(damaged) + 1
    assert follower.applied == len(damaged) + 1


def test_an_entry_another_build_wrote_stops_the_follower_there_instead_of_being_skipped(tmp_path):
    """Skipped, a replica of an older build applied none of what newer ones applied from a
    shared log, and parted from them for good while it reported ready."""
    import io

    from hybridgnn.errors import ConfigError, LogFromAnotherBuild

    dyn, inc = dynamic_setup(tmp_path)
    log = MemoryLog()
    log.append(encode_entry([_requests()[2].logged]))
    newer = io.BytesIO()
    np.savez(newer, format=np.int64(99), counts=np.zeros((0, 1)))
    log.append(newer.getvalue())
    log.append(encode_entry([_requests()[0].logged]))
    follower = follower_for(dyn, inc, log)
    with pytest.raises(LogFromAnotherBuild, match="position 2 cannot be read by this build .log entry format 99"):
        follower.step()
    assert follower.applied == 1  # what came before it applied; nothing past it
    assert follower.done_before_failure and follower.done_before_failure[0][0] == 1
    with pytest.raises(ConfigError, match="run the same hybridgnn version on every replica"):
        follower_for(DynamicGraph(dynamic_setup(tmp_path / "b")[0].base), None, log).catch_up()


def test_graph_only_updates_are_logged_and_replayed_too(tmp_path):
    dyn = DynamicGraph(dynamic_setup(tmp_path / "a")[0].base)
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    run_updates(follower_for(dyn, None, log), _requests()[:2])
    other = DynamicGraph(dynamic_setup(tmp_path / "b")[0].base)
    assert follower_for(other, None, log).catch_up() == 2
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


def test_added_names_merge_into_the_sorted_ones_in_any_order_and_width():
    """extend merges (linear) instead of sorting every added name again (n log n per
    update, under the graph's write lock); lookups both ways hold over many extends."""
    from hybridgnn.graph.idmap import IdMap

    rng = np.random.default_rng(3)
    names, _ = IdMap.build(np.array(["m", "b", "zz"]))
    assert names.max_new_name_chars == 64 and IdMap.build(np.array(["q" * 100]))[0].max_new_name_chars == 100
    assert IdMap.build(np.array([3, 1]))[0].max_new_name_chars is None
    added = []
    for k in range(40):  # widths grow and shrink between extends
        batch = [f"{'w' * int(rng.integers(1, 30))}{k}-{j}" for j in range(int(rng.integers(1, 6)))]
        names.extend(np.array(batch))
        added += batch
    internal, known = names.to_internal(np.array(added[::-1] + ["b", "nope"]))
    assert known[:-1].all() and not known[-1]
    assert internal[:-2].tolist() == list(range(3 + len(added)))[3:][::-1] and internal[-2] == 0
    assert names.to_external(np.arange(3, 3 + len(added))).tolist() == added
    sorted_names = names._added[1]
    assert (sorted_names[1:] > sorted_names[:-1]).all()
    ints, _ = IdMap.build(np.array([100, 5]))
    for k in range(5):
        ints.extend(np.array([1000 - k, k + 6]))
    assert ints.to_internal(np.array([996, 10, 1000]))[0].tolist() == [10, 11, 2]


def test_updates_on_a_mapped_dataset_translate_names_and_new_nodes():
    from hybridgnn.errors import BadRequest
    from hybridgnn.graph.idmap import IdMap

    names, _ = IdMap.build(np.array([f"n{i}" for i in range(5)]))

    def dec(*inputs):
        pending = decode_update_request(update_body(*inputs), None, feature_dim=4, max_updates=100, id_map=names)
        return build_request(pending.logged.inputs, feature_dim=4, max_updates=100, id_map=names)

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
        # one long name made every added name as wide as it (1.6 GB for 200k names of 8)
        ((("add_node_features", np.ones((1, 4)), "FP32"), ("add_node_ids", ["x" * 65], "BYTES")),
         "a name of 65 characters; a node added to this dataset may have at most 64"),
    ]:
        with pytest.raises(BadRequest, match=match):
            dec(*inputs)
    with pytest.raises(BadRequest, match="id map"):
        decode_update_request(update_body(("remove_nodes", ["n1"], "BYTES")), None, feature_dim=4, max_updates=100)


def _keyed(pending, key: str, digest: str):
    pending.logged.idempotency_key, pending.logged.body_sha256 = key, digest
    return pending


@pytest.mark.parametrize("durable", [True, False])
def test_a_retried_update_with_the_same_idempotency_key_applies_once(tmp_path, durable):
    dyn, inc = dynamic_setup(tmp_path / "g")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint) if durable else MemoryLog()
    follower = follower_for(dyn, inc, log)
    from hybridgnn.serving.core.updates import UpdateApplier

    applier = UpdateApplier(follower.cfg, follower, dyn, follower.stats)

    async def scenario():
        follower.start()
        applier.start()
        first, twin = applier.submit(_keyed(_requests()[1], "k1", "h1")), applier.submit(_keyed(_requests()[1], "k1", "h1"))
        # A retry while the first is in flight waits for it and, applying nothing itself,
        # gets its answer marked "replayed" (the first one's own answer is not marked).
        one, twin_answer = await first, await twin
        assert twin is not first and "replayed" not in one and twin_answer == {**one, "replayed": True}
        again = await applier.submit(_keyed(_requests()[1], "k1", "h1"))
        with pytest.raises(Conflict, match="different update"):
            applier.submit(_keyed(_requests()[0], "k1", "h2"))
        await applier.stop()
        await follower.stop()
        return one, again

    one, again = asyncio.run(scenario())
    assert again["replayed"] and again["new_node_ids"] == one["new_node_ids"] == [60]
    assert dyn.num_nodes == 61 and dyn.version == 1  # applied once
    # Two replicas that both logged the same keyed request (a retry sent to another one):
    # the second entry applies nothing, everywhere.
    log.append(encode_entry([_keyed(_requests()[1], "k1", "h1").logged]))
    follower.step(block_s=0)
    assert dyn.num_nodes == 61 and follower.applied == 2
    if durable:  # the key outlives a restart
        fresh_dyn, fresh_inc = dynamic_setup(tmp_path / "restart")
        restarted = follower_for(fresh_dyn, fresh_inc, SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint))
        restarted.catch_up()
        assert restarted.answer_for("k1")[1]["graph_version"] == one["graph_version"] and fresh_dyn.num_nodes == 61


def test_a_snapshot_plus_the_rest_of_the_log_equals_the_whole_log(tmp_path):
    dyn, inc = dynamic_setup(tmp_path / "live")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m1",
                      log_id=log.log_id, every=2, keep=1)
    follower = follower_for(dyn, inc, log, snapshots=snaps)
    reqs = _requests()
    _keyed(reqs[1], "k1", "h1")
    for r in reqs[:3]:
        log.append(encode_entry([r.logged]))
    follower.step(block_s=0)  # applies 3 entries; a snapshot is due at 3
    job = follower._job
    assert job is not None
    job()
    [path] = [p for p in (tmp_path / "snaps").iterdir()]
    meta = json.loads((path / "snapshot.json").read_text())
    assert meta["position"] == 3 and json.loads((path / "keys.json").read_text())[0][0] == "k1"
    assert path.name == f"000000000003-{log.log_id[:12]}-m1"
    log.append(encode_entry([reqs[3].logged]))
    follower.step(block_s=0)

    fresh_dyn, fresh_inc_unused = dynamic_setup(tmp_path / "restart")
    snap = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m1",
                     log_id=log.log_id, every=2).latest(with_embeddings=True)
    assert snap.position == 3
    fresh_dyn.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)
    from hybridgnn.embeddings.incremental import IncrementalEmbeddings

    fresh_inc = IncrementalEmbeddings(fresh_dyn, fresh_inc_unused.model, snap.layers, aggregates=snap.aggregates)
    for a, b in zip(fresh_inc.aggregates, [snap.aggregates[0], snap.aggregates[1]], strict=True):
        assert a is None or np.array_equal(a, b)  # the aggregates as the deltas left them, not recomputed
    replica = follower_for(fresh_dyn, fresh_inc, log, position=snap.position, keys=snap.keys)
    assert replica.catch_up() == 1 and replica.answer_for("k1") is not None
    _same_state(dyn, inc, fresh_dyn, fresh_inc)
    # Another log's (or model's) snapshots are not this one's.
    assert Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m1",
                     log_id="another", every=2).latest(with_embeddings=True) is None
    assert Snapshots(tmp_path / "snaps", base_fingerprint="another dataset", model_fingerprint="m1",
                     log_id=log.log_id, every=2).latest(with_embeddings=True) is None
    assert Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m2",
                     log_id=log.log_id, every=2).latest(with_embeddings=True) is None
    # ... unless it names m1 as what this model was called before (an older fingerprint)
    assert Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m2",
                     log_id=log.log_id, every=2, also_model="m1").latest(with_embeddings=True) is not None


def _damage_array(name, change):
    def damage(path):
        a = np.load(path / f"{name}.npy")
        np.save(path / f"{name}.npy", change(a.copy()))
    return damage


def _damage_meta(**changes):
    def damage(path):
        meta = json.loads((path / "snapshot.json").read_text())
        (path / "snapshot.json").write_text(json.dumps({**meta, **changes}))
    return damage


def _set_at(i, value):
    def change(a):
        a[i] = value
        return a
    return change


@pytest.mark.parametrize("damage", [
    _damage_array("indices", _set_at(3, 10**6)),  # a segmentation fault restoring it, at every start
    _damage_array("indices", _set_at(3, -3)),
    _damage_array("indptr", _set_at(3, 0)),  # falls
    _damage_array("indptr", lambda a: a.astype(np.float64)),
    _damage_array("alive", lambda a: a[:-1]),
    _damage_array("layer_1", lambda a: a[:10]),
    _damage_meta(position="x"),  # int("x"): a ValueError traceback at every start
    _damage_meta(position=None),
    _damage_meta(num_layers="2"),
    lambda path: (path / "snapshot.json").write_text("[1]"),  # an AttributeError traceback
    lambda path: (path / "keys.json").write_text("[5]"),
])
def test_a_damaged_snapshot_is_passed_over_for_an_older_one(tmp_path, damage):
    dyn, inc = dynamic_setup(tmp_path / "g")

    def snapshots():
        return Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                         log_id="L", every=1, keep=2)

    older = snapshots().write(snapshots().capture(1, dyn, inc, {}))
    newer = snapshots().write(snapshots().capture(2, dyn, inc, {}))
    damage(newer)
    snap = snapshots().latest(with_embeddings=True)
    assert snap is not None and snap.path == older
    fresh = DynamicGraph(dyn.base)
    fresh.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)


def test_snapshots_are_pruned_to_the_newest_few(tmp_path):
    dyn, inc = dynamic_setup(tmp_path / "g")
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id="L", every=1, keep=2)
    for position in (1, 2, 3):
        assert snaps.write(snaps.capture(position, dyn, inc, {})) is not None
    assert snaps.write(snaps.capture(3, dyn, inc, {})) is None  # already there (another replica wrote it)
    assert sorted(p.name[:12] for p in (tmp_path / "snaps").iterdir()) == ["000000000002", "000000000003"]


def test_replicas_sharing_a_snapshot_folder_take_turns(tmp_path):
    """A snapshot is due `every` entries past the newest one in the folder, whoever wrote
    it: a replica that has written none itself waits for its turn too."""
    dyn, inc = dynamic_setup(tmp_path / "g")

    def replica():
        return Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                         log_id="L", every=10)

    a, b = replica(), replica()
    assert a.due(10)
    a.write(a.capture(10, dyn, inc, {}))
    assert not b.due(12) and not b.due(19) and b.due(20)


def test_a_snapshot_that_does_not_load_is_passed_over_for_the_one_before(tmp_path, caplog):
    dyn, inc = dynamic_setup(tmp_path / "g")
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id="L", every=1, keep=3)
    for position in (1, 2):
        snaps.write(snaps.capture(position, dyn, inc, {}))
    newest = sorted((tmp_path / "snaps").iterdir())[-1]
    (newest / "indptr.npy").unlink()  # as when another replica prunes it while this one opens it
    again = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id="L", every=1)
    assert again.latest(with_embeddings=True).position == 1 and "does not load" in caplog.text
    for path in (tmp_path / "snaps").iterdir():
        (path / "indptr.npy").unlink(missing_ok=True)
    assert again.latest(with_embeddings=True) is None  # none loads: start from the dataset, replay the log


def _named(tmp_path):
    """dynamic_setup's graph with its nodes named n0..n59 (an id map)."""
    from hybridgnn.graph.idmap import IdMap

    dyn, inc = dynamic_setup(tmp_path)
    dyn.base.id_map = IdMap.build(np.array([f"n{i:02d}" for i in range(60)]))[0]
    return dyn, inc


def test_two_requests_naming_the_same_new_node_in_one_entry_give_it_once(tmp_path):
    dyn, inc = _named(tmp_path)
    req = {"add_node_features": np.ones((1, 4), np.float32), "add_node_ids": np.array(["alice"]),
           "add_edges": np.array([["alice", "n01"]])}
    log = MemoryLog()
    log.append(encode_entry([LoggedRequest(dict(req)), LoggedRequest(dict(req))]))
    [(_, (first, second))] = follower_for(dyn, inc, log).step(block_s=0)
    assert first["new_node_ids"] == ["alice"] and "already exists" in str(second)
    assert dyn.num_nodes == 61 and len(dyn.base.id_map) == 61


def test_an_entry_that_fails_part_way_resumes_without_applying_twice(tmp_path):
    dyn, inc = dynamic_setup(tmp_path)
    log = MemoryLog()
    add = {"add_node_features": np.ones((1, 4), np.float32), "add_edges": np.array([[-1, 3]])}
    # valid alone, but together they add one edge twice: the follower applies them one by one
    log.append(encode_entry([LoggedRequest(dict(add)), LoggedRequest({"add_edges": np.array([[5, 6]])}),
                             LoggedRequest({"add_edges": np.array([[5, 6]])})]))
    follower = follower_for(dyn, inc, log)
    real, calls = inc.apply, []

    def flaky(batch, commit=None):
        calls.append(batch)
        if len(calls) == 3:  # the second request alone: out of memory, say
            raise MemoryError("no room")
        return real(batch, commit)

    inc.apply = flaky
    with pytest.raises(MemoryError):
        follower.step(block_s=0)
    assert dyn.num_nodes == 61 and follower.applied == 0  # the first request applied, the entry not done
    [(_, outcomes)] = follower.step(block_s=0)
    assert dyn.num_nodes == 61 and follower.applied == 1  # not added twice
    assert outcomes[0]["new_node_ids"] == [60] and outcomes[1]["graph_version"] == 1
    assert "already in the graph" in str(outcomes[2])


def test_remembered_keys_are_bounded_by_the_ids_their_answers_hold(tmp_path, monkeypatch):
    import hybridgnn.updates.follower as follower_module

    monkeypatch.setattr(follower_module, "MEMORY_KEY_IDS", 5)
    dyn, inc = dynamic_setup(tmp_path)
    follower = follower_for(dyn, inc)
    for k in range(4):
        follower._remember(f"k{k}", "d", {"new_node_ids": [1, 2], "graph_version": k})
    assert list(follower.keys) == ["k2", "k3"] and follower._key_ids == 4


def test_reads_waiting_for_a_version_are_released_in_order_and_bounded(tmp_path, monkeypatch):
    import hybridgnn.updates.follower as follower_module

    dyn, inc = dynamic_setup(tmp_path)
    follower = follower_for(dyn, inc)
    monkeypatch.setattr(follower_module, "MAX_VERSION_WAITERS", 3)

    async def scenario():
        waits = [asyncio.ensure_future(follower.wait_for(v, 5.0)) for v in (2, 1, 3)]
        await asyncio.sleep(0)
        assert not await follower.wait_for(9, 5.0)  # a fourth: refused at once
        follower.applied = 2
        follower._release_versions()
        done, pending = await asyncio.wait(waits, timeout=0.5)
        assert len(done) == 2 and all(t.result() for t in done) and len(pending) == 1
        assert not await asyncio.wait_for(pending.pop(), 6.0) is None

    asyncio.run(scenario())


def test_a_server_without_the_token_is_refused_where_the_log_holds_acknowledged_updates(tmp_path):
    from hybridgnn.config import ServeConfig, UpdateConfig
    from hybridgnn.serving.server import refuse_unfollowed_updates
    from hybridgnn.updates.log import logged_updates

    cfg = ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path)
    refuse_unfollowed_updates(cfg)  # no log: nothing to follow
    assert logged_updates(None, tmp_path) == 0
    log = SqliteLog(tmp_path / "updates.sqlite", "abc")
    refuse_unfollowed_updates(cfg)  # an empty log
    log.append(b"entry")
    log.append(b"entry")
    log.close()
    assert logged_updates(None, tmp_path) == 2
    with pytest.raises(ConfigError, match=r"holds acknowledged graph updates \(up to position 2\).*--update-log off"):
        refuse_unfollowed_updates(cfg)
    refuse_unfollowed_updates(ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path, updates=UpdateConfig(log="off")))
    refuse_unfollowed_updates(ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path,
                                          updates=UpdateConfig(token="long-enough-token")))
    (tmp_path / "other.sqlite").write_text("not a database")
    assert logged_updates(str(tmp_path / "other.sqlite"), tmp_path) == 0


def test_an_in_memory_log_drops_what_its_reader_applied_unless_it_is_replayed():
    log, kept = MemoryLog(), MemoryLog(keep_all=True)
    for m in (log, kept):
        for i in range(5):
            m.append(b"e%d" % i)
    assert [e.position for e in log.read(0, 2)] == [1, 2] and len(log) == 5
    assert [e.body for e in log.read(2, 10)] == [b"e2", b"e3", b"e4"] and len(log) == 3
    assert log.read(5, 10) == [] and len(log) == 0 and log.head() == 5
    assert log.append(b"e5") == 6 and [e.position for e in log.read(5, 10)] == [6]
    with pytest.raises(LookupError, match="dropped"):
        log.read(0, 10)
    # a partitioned group reads the whole log again whenever it is formed
    assert [e.position for e in kept.read(5, 10)] == [] and len(kept) == 5
    assert [e.position for e in kept.read(0, 10)] == [1, 2, 3, 4, 5]
    assert open_update_log("off", Path("."), "abc", replayed=True).keep_all
    assert not open_update_log("off", Path("."), "abc").keep_all


def test_a_trimmed_sqlite_log_keeps_its_last_entry_and_refuses_a_reader_from_before_it(tmp_path):
    log = SqliteLog(tmp_path / "u.sqlite", "abc")
    for i in range(10):
        log.append(b"e%d" % i)
    assert log.first() == 1 and log.trim(0) == 0
    assert log.trim(4) == 4 and log.first() == 5 and len(log) == 6
    assert log.trim(3) == 0 and log.first() == 5  # only ever forward
    assert [e.position for e in log.read(4, 3)] == [5, 6, 7]
    assert [e.position for e in log.read(7, 10)] == [8, 9, 10]
    with pytest.raises(LogTrimmed, match="from position 5 on .* at position 2: it needs a snapshot at position 4"):
        log.read(2, 10)
    assert log.trim(100) == 5 and log.first() == 10 and log.head() == 10  # the last entry stays ...
    assert log.append(b"e10") == 11  # ... so positions go on
    log.close()
    again = SqliteLog(tmp_path / "u.sqlite", "abc")
    assert again.first() == 10 and [e.position for e in again.read(9, 10)] == [10, 11]
    assert again.read(11, 10) == []  # caught up: nothing, not an error
    assert MemoryLog().first() == 1


def test_a_follower_trims_what_every_kept_snapshot_covers_beyond_the_newest_entries(tmp_path):
    from hybridgnn.config import UpdateConfig

    dyn, inc = dynamic_setup(tmp_path / "live")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id=log.log_id, every=3, keep=2)
    cfg = UpdateConfig(token="12345678", snapshot_every=3, snapshot_keep=2, log_retain=2)
    follower = follower_for(dyn, inc, log, snapshots=snaps, cfg=cfg)
    body = encode_entry([_requests()[0].logged])  # the same feature update each time: always applies
    positions = []
    for _ in range(4):
        for _ in range(3):
            log.append(body)
        follower.step(block_s=0)
        job, follower._job = follower._job, None
        job()  # a snapshot at 3, 6, 9, 12 (two kept), then the trim
        positions.append((snaps.oldest_position(), log.first()))
    # the oldest kept snapshot bounds the trim: 3 (alone), then 3, 6, 9 as the oldest of two
    assert positions == [(3, 2), (3, 4), (6, 7), (9, 10)]
    # a replica from the oldest kept snapshot still catches up; one from the dataset cannot
    fresh_dyn, fresh_inc = dynamic_setup(tmp_path / "restart")
    snap = snaps.latest(with_embeddings=True)
    fresh_dyn.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)
    assert follower_for(fresh_dyn, fresh_inc, log, position=snap.position).catch_up() == 12 - snap.position
    with pytest.raises(LogTrimmed, match="at position 0"):
        follower_for(*dynamic_setup(tmp_path / "late"), log).step(block_s=0)
    # without log_retain nothing is trimmed
    assert follower_for(dyn, inc, log, snapshots=snaps).trim_log() == 0 and log.first() == 10


def test_entries_applied_while_a_snapshot_is_written_are_snapshotted_once_it_is_done(tmp_path):
    """A burst's last entries, applied while the snapshot before them was written, were
    snapshotted only when another entry came, which may never."""
    dyn, inc = dynamic_setup(tmp_path)
    log = MemoryLog()
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id=log.log_id, every=2, keep=3)
    follower = follower_for(dyn, inc, log, snapshots=snaps)
    body = encode_entry([_requests()[0].logged])
    for _ in range(2):
        log.append(body)
    follower.step(block_s=0)
    job, follower._job = follower._job, None  # the snapshot at 2, written "in the background"
    follower._job_running = True
    for _ in range(3):
        log.append(body)
    follower.step(block_s=0)  # 3..5 applied while it runs: no second job
    assert follower._job is None
    job()
    follower._job_running = False
    assert follower.step(block_s=0) == []  # nothing new: the snapshot of 5 is due all the same
    follower._job()
    assert snaps.latest(with_embeddings=True).position == 5


def test_retaining_the_log_needs_snapshots_and_a_partitioned_server_keeps_it_all(tmp_path):
    from hybridgnn.config import PartitionConfig, ServeConfig, UpdateConfig

    with pytest.raises(ValueError, match="needs snapshot_every > 0"):
        UpdateConfig(token="12345678", log_retain=5, snapshot_every=0)
    with pytest.raises(ValueError, match="log_retain must be >= 0"):
        UpdateConfig(log_retain=-1)
    with pytest.raises(ValueError, match="drop --update-log-retain"):
        ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path, partitions=PartitionConfig(partitions=2),
                    updates=UpdateConfig(token="12345678", log_retain=5))


def test_a_partitioned_server_refuses_a_log_another_server_trimmed(tmp_path):
    from types import SimpleNamespace

    from hybridgnn.config import ServeConfig, UpdateConfig
    from hybridgnn.serving.core.partitioned_updates import PartitionedUpdates
    from hybridgnn.types import ServingStats

    log = SqliteLog(tmp_path / "u.sqlite", "abc")
    for i in range(4):
        log.append(b"e%d" % i)
    cfg = ServeConfig(dataset_dir=tmp_path, model_dir=tmp_path,
                      updates=UpdateConfig(token="12345678", log=str(tmp_path / "u.sqlite")))
    graph = SimpleNamespace(root=tmp_path, fingerprint="abc", id_map=None)
    PartitionedUpdates(cfg, graph, ServingStats()).log.close()  # untrimmed: fine
    log.trim(2)
    with pytest.raises(ConfigError, match="holds entries from position 3 on.*replays the whole log"):
        PartitionedUpdates(cfg, graph, ServingStats())


def test_a_log_trimmed_past_a_starting_replica_refuses_it_in_one_line_not_a_traceback(tmp_path):
    # Another replica trims past this one's snapshot after it chose it (Resources checked
    # log.first() then) but before its catch-up read the log: a refusal at start, like the
    # one Resources gives, not an uncaught LogTrimmed.
    dyn, inc = dynamic_setup(tmp_path / "live")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    body = encode_entry([_requests()[0].logged])
    for _ in range(6):
        log.append(body)
    log.trim(4)
    with pytest.raises(ConfigError, match="holds entries from position 5 on .* at position 0") as caught:
        follower_for(dyn, inc, log).catch_up()
    assert isinstance(caught.value.__cause__, LogTrimmed)


def test_a_snapshot_written_while_the_server_stops_does_not_trim_the_closed_log(tmp_path):
    # Stopping does not wait for a snapshot write in flight, and the server closes the log
    # right after: the trim that follows the write is left to the next start, not an
    # error (a traceback at shutdown) on a closed log.
    from hybridgnn.config import UpdateConfig

    dyn, inc = dynamic_setup(tmp_path / "live")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    snaps = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m",
                      log_id=log.log_id, every=3, keep=1)
    follower = follower_for(dyn, inc, log, snapshots=snaps,
                            cfg=UpdateConfig(token="12345678", snapshot_every=3, snapshot_keep=1, log_retain=1))
    for _ in range(4):
        log.append(encode_entry([_requests()[0].logged]))
    follower.step(limit=3, block_s=0)
    job, follower._job = follower._job, None  # captured at 3, to write in the background
    asyncio.run(follower.stop())
    log.close()
    job()
    assert snaps.oldest_position() == 3  # written; the log is trimmed after the next one
    again = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    assert again.first() == 1 and again.head() == 4
    again.close()


def test_a_replica_the_log_was_trimmed_past_refuses_updates_at_once_and_logs_nothing(tmp_path):
    # Stranded (it can never apply the log again), it would append each update (which the
    # other replicas apply) and answer it 503 only after ANSWER_WAIT_S: it says so now.
    from hybridgnn.serving.core.updates import UpdateApplier

    dyn, inc = dynamic_setup(tmp_path / "g")
    log = SqliteLog(tmp_path / "u.sqlite", dyn.base.fingerprint)
    for _ in range(4):
        log.append(encode_entry([_requests()[0].logged]))
    log.trim(3)  # another replica's trim, past this one (at 0)
    follower = follower_for(dyn, inc, log)
    applier = UpdateApplier(follower.cfg, follower, dyn, follower.stats)

    async def scenario():
        follower.start()
        applier.start()
        try:
            for _ in range(200):
                if follower.failed:
                    break
                await asyncio.sleep(0.01)
            assert "holds entries from position 4 on" in follower.failed
            # its lag reads as growing, not 0 (caught up): it will never apply the entries
            t0 = follower.lag_s()
            await asyncio.sleep(0.02)
            assert follower.lag_s() >= t0 + 0.02
            with pytest.raises(ServiceUnavailable, match="from position 4 on.*nothing of this update was logged"):
                applier.submit(_requests()[1])
        finally:
            await applier.stop()
            await follower.stop()

    asyncio.run(scenario())
    assert log.head() == 4 and dyn.version == 0


def test_a_trimmed_sqlite_log_is_marked_for_builds_that_would_not_see_the_gap(tmp_path):
    import sqlite3

    from hybridgnn.config import UpdateConfig

    log = SqliteLog(tmp_path / "u.sqlite", "abc")
    for i in range(3):
        log.append(b"e%d" % i)
    schema = "SELECT value FROM meta WHERE key = 'schema'"
    assert sqlite3.connect(tmp_path / "u.sqlite").execute(schema).fetchone()[0] == "2"
    log.trim(1)
    log.close()
    assert sqlite3.connect(tmp_path / "u.sqlite").execute(schema).fetchone()[0] == "3"
    assert SqliteLog(tmp_path / "u.sqlite", "abc").first() == 2  # this build reads it
    with pytest.raises(ValueError, match="drop log_retain"):
        UpdateConfig(token="12345678", log="off", log_retain=5)


def test_computed_layers_equal_the_embeddings_kept_fresh_by_incremental_updates(tmp_path):
    from hybridgnn.embeddings.incremental import computed_layers

    dyn, inc = dynamic_setup(tmp_path)
    for a, b in zip(computed_layers(dyn, inc.model), inc.layers, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)  # what precompute gave on the stored graph
    run_updates(follower_for(dyn, inc), _requests())
    assert dyn.version > 0
    alive = np.flatnonzero(dyn.alive[:dyn.num_nodes])  # (the kept rows have room to grow beyond)
    for a, b in zip(computed_layers(dyn, inc.model), inc.layers, strict=True):
        assert len(a) == dyn.num_nodes
        np.testing.assert_allclose(a[alive], b[alive], atol=1e-5)  # and on the updated graph


def test_a_graph_to_start_from_may_come_from_another_models_snapshot(tmp_path):
    dyn, inc = dynamic_setup(tmp_path / "g")
    for model, position in (("m1", 4), ("m2", 7)):
        Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint=model, log_id="L",
                  every=1).write(Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint,
                                           model_fingerprint=model, log_id="L", every=1)
                                 .capture(position, dyn, inc, {"k": ("d", {"new_node_ids": []})}))
    new = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m3", log_id="L",
                    every=1)
    assert new.latest(with_embeddings=True) is None  # none of its own
    graph = new.latest_graph(at_least=5)
    assert graph.position == 7 and graph.layers is None and graph.keys == [("k", "d", {"new_node_ids": []})]
    assert new.latest_graph(at_least=8) is None
    other_log = Snapshots(tmp_path / "snaps", base_fingerprint=dyn.base.fingerprint, model_fingerprint="m3",
                          log_id="other", every=1)
    assert other_log.latest_graph(at_least=0) is None  # another log's are never used


def test_two_handles_on_one_sqlite_log_never_see_a_gap_a_repeat_or_a_restart(tmp_path_factory):
    """Random interleavings of appends, trims and reads through two handles on one file (as
    two replicas sharing it): positions only grow and are never reused; a read returns the
    entries right after where it asked, in order, or LogTrimmed when the trim passed it;
    first() only moves forward and never past the last entry."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from(["append", "trim", "read", "reopen"]), st.integers(0, 1),
                             st.integers(0, 40)), min_size=1, max_size=60)

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ops)
    def check(steps):
        path = tmp_path_factory.mktemp("log") / "u.sqlite"
        handles = [SqliteLog(path, "abc"), SqliteLog(path, "abc")]
        bodies: dict[int, bytes] = {}
        last, first = 0, 1
        try:
            for op, h, n in steps:
                log = handles[h]
                if op == "append":
                    body = b"entry %d" % len(bodies)
                    position = log.append(body)
                    assert position == last + 1 and position not in bodies
                    bodies[position], last = body, position
                elif op == "trim":
                    gone = log.trim(n)
                    want = max(0, min(n, last - 1) - (first - 1))
                    assert gone == want
                    first = max(first, min(n, last - 1) + 1)
                elif op == "read":
                    after = n % (last + 1)
                    if after + 1 < first:
                        with pytest.raises(LogTrimmed):
                            log.read(after, 5)
                    else:
                        got = log.read(after, 5)
                        assert [e.position for e in got] == list(range(after + 1, min(last, after + 5) + 1))
                        assert all(e.body == bodies[e.position] for e in got)
                else:  # a restart of that replica
                    log.close()
                    handles[h] = SqliteLog(path, "abc")
                assert handles[0].first() == handles[1].first() == first <= max(last, 1)
                assert handles[0].head() == handles[1].head() == last
        finally:
            for log in handles:
                log.close()

    check()


def test_an_update_whose_apply_finds_its_executor_down_is_answered_at_once_not_after_answer_wait(tmp_path):
    # A partitioned graph's ranks down while the follower applies a logged update: its
    # request heard nothing for ANSWER_WAIT_S (30 s). It now hears the 503 at once, and a
    # retry with the same Idempotency-Key gets the first answer once the entry applies.
    from hybridgnn.serving.core.updates import UpdateApplier

    dyn, inc = dynamic_setup(tmp_path)
    follower = follower_for(dyn, inc)
    applier = UpdateApplier(follower.cfg, follower, dyn, follower.stats)
    real, down = inc.apply, [True]

    def ranks(batch, commit=None):
        if down[0]:
            raise ServiceUnavailable("partition ranks are down (rank 1 exited)")
        return real(batch, commit)

    inc.apply = ranks
    update = decode_update_request(update_body(("update_ids", [1], "INT64"), ("update_features", np.ones((1, 4)), "FP32")),
                                   None, feature_dim=4, max_updates=100, idempotency_key="K1", body_sha256="a")

    async def scenario():
        follower.start()
        applier.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="logged but could not be applied here yet: partition ranks"):
                await asyncio.wait_for(applier.submit(update), 10)
            assert time.monotonic() - t0 < 5
            down[0] = False
            await follower.wait_for(1, 10)
            return await applier.submit(update)
        finally:
            await applier.stop()
            await follower.stop()

    answer = asyncio.run(scenario())
    assert answer["graph_version"] == 1 and answer["replayed"] and dyn.version == 1 and follower.log.head() == 1


def test_the_memory_log_refuses_a_read_behind_what_its_reader_read_past_and_blocks_for_new_entries():
    """Once the reader has read past every entry (they are dropped), a read from before
    them is refused, not answered with nothing; a blocking read at the head waits for the
    next append and returns it."""
    import threading

    log = MemoryLog()
    for body in (b"a", b"b"):
        log.append(body)
    assert log.read(2, 10) == []  # read past both: dropped
    with pytest.raises(LookupError, match="entries 2..2"):
        log.read(1, 10)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(log.read(2, 10, block_s=30)))
    reader.start()
    deadline = time.monotonic() + 10
    while reader.is_alive() and not log._cond._waiters and time.monotonic() < deadline:
        time.sleep(0.001)  # until the reader waits (or, not blocking, has answered)
    log.append(b"c")
    reader.join(10)
    assert [(e.position, e.body) for e in got[0]] == [(3, b"c")]


def test_a_version_wait_cancelled_as_its_version_is_released_is_cancelled(tmp_path):
    """A task cancelled in the same loop turn as its version wait was released went on as
    if never cancelled (asyncio.wait_for before 3.12 returns the result then): a partitioned
    server's swap released the old applier's catch-up wait and stopped it at once, so the
    old applier ran on, its stop never returned, and the server's shutdown hung."""
    dyn, inc = dynamic_setup(tmp_path)
    follower = follower_for(dyn, inc)

    async def scenario():
        waiting = asyncio.ensure_future(follower.wait_for(2, 5.0))
        await asyncio.sleep(0)
        follower.applied = 2
        follower._release_versions()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert follower._live_version_waiters == 0
        timed_out = asyncio.ensure_future(follower.wait_for(3, 0.01))  # a timeout is still False
        assert not await timed_out and all(w[2].done() for w in follower._version_waiters)

    asyncio.run(scenario())
