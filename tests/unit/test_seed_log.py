"""The seed log (serve --seed-log): per-node request counts written whole, for `place
--from-log` and `workload build --seeds`."""

from types import SimpleNamespace

import numpy as np

from hybridgnn.serving.core.placement_refresh import PlacementRefresh


def _refresh(num_nodes: int) -> PlacementRefresh:
    return PlacementRefresh(SimpleNamespace(graph=SimpleNamespace(num_nodes=num_nodes)), stats=None)


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
