"""The seed log (serve --seed-log): per-node request counts written whole, for `place
--from-log` and `workload build --seeds`; a heterogeneous server's, one array per node type."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hybridgnn.serving.core.placement_refresh import PlacementRefresh


def _refresh(num_nodes: int) -> PlacementRefresh:
    return PlacementRefresh(SimpleNamespace(graph=SimpleNamespace(num_nodes=num_nodes),
                                            seed_counts=np.zeros(num_nodes, dtype=np.int64)), stats=None)


def test_counts_are_written_whole_with_no_temporary_left(tmp_path):
    r = _refresh(6)
    r.count(np.array([1, 1, 4, 9]))  # 9: added by an update, not counted
    path = tmp_path / "seeds.counts.npy"
    r.save_seed_log(path)
    r.count(np.array([0]))
    r.save_seed_log(path)
    assert np.load(path).tolist() == [1, 2, 0, 0, 1, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["seeds.counts.npy"]


def test_a_link_at_the_path_is_replaced_not_written_through(tmp_path):
    # the file it pointed to (perhaps another replica's log) is left as it was
    other = tmp_path / "other.counts.npy"
    np.save(other, np.arange(3))
    path = tmp_path / "seeds.counts.npy"
    path.symlink_to(other)
    r = _refresh(3)
    r.count(np.array([2]))
    r.save_seed_log(path)
    assert not path.is_symlink() and np.load(path).tolist() == [0, 0, 1]
    assert np.load(other).tolist() == [0, 1, 2]


def test_typed_counts_are_written_whole_per_type_a_request_named(tmp_path):
    """A heterogeneous server's log: one .npz, one counts array per node type a request
    named (repeats counted, a whole top-k's candidates too), readable without pickle."""
    from hybridgnn.serving.core.placement_refresh import TypedSeedCounts

    seeds = TypedSeedCounts({"user": 4, "item": 3, "field": 2})
    path = tmp_path / "seeds.counts.npz"
    seeds.save_seed_log(path)  # before any request: an archive naming no type
    with np.load(path, allow_pickle=False) as stored:
        assert stored.files == []
    seeds.count([("user", np.array([1, 1, 3])), ("item", np.array([2]))])
    seeds.count([("item", np.arange(3))])
    seeds.save_seed_log(path)
    seeds.count([("user", np.array([0]))])
    seeds.save_seed_log(path)
    with np.load(path, allow_pickle=False) as stored:
        assert {t: stored[t].tolist() for t in stored.files} == {"user": [1, 2, 0, 1], "item": [1, 1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["seeds.counts.npz"]
    other = tmp_path / "other.counts.npz"  # a link at the path is replaced, not written through
    other.write_bytes(b"another replica's")
    (tmp_path / "linked.counts.npz").symlink_to(other)
    seeds.save_seed_log(tmp_path / "linked.counts.npz")
    assert not (tmp_path / "linked.counts.npz").is_symlink() and other.read_bytes() == b"another replica's"


def test_a_node_type_named_like_a_savez_keyword_is_stored_by_its_name(tmp_path):
    from hybridgnn.workload.typed import write_typed_counts

    write_typed_counts(tmp_path / "s.counts.npz", {"file": np.array([1]), "allow_pickle": np.array([2, 3])})
    with np.load(tmp_path / "s.counts.npz", allow_pickle=False) as stored:
        assert {t: stored[t].tolist() for t in stored.files} == {"file": [1], "allow_pickle": [2, 3]}


@pytest.mark.parametrize("hetero, given, match", [
    (True, "s.counts.npy", r"--seed-log s\.counts\.npy: the seed log of a heterogeneous dataset is a \.counts\.npz "
                           r"file \(one counts array per node type\)$"),
    (False, "s.counts.npz", r"--seed-log s\.counts\.npz: the seed log of a homogeneous dataset is a \.counts\.npy "
                            r"file \(one counts array\)$"),
])
def test_serve_refuses_a_seed_log_of_the_other_kind_at_start(hetero, given, match):
    from hybridgnn.config import ServeConfig, ServerConfig
    from hybridgnn.errors import ConfigError
    from hybridgnn.serving.server import refuse_seed_log_of_the_other_kind

    with pytest.raises(ConfigError, match=match):
        refuse_seed_log_of_the_other_kind(ServeConfig(Path("d"), Path("m"), server=ServerConfig(seed_log=Path(given))),
                                          hetero)
    for ok in ("s.counts.npz" if hetero else "s.counts.npy", None):
        refuse_seed_log_of_the_other_kind(ServeConfig(Path("d"), Path("m"), server=ServerConfig(
            seed_log=ok and Path(ok))), hetero)
    with pytest.raises(ValueError, match="must be a .counts.npy file"):
        ServerConfig(seed_log=Path("s.npz"))
