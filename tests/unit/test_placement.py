"""Topology files and detection helpers, placement plans on hand-checked topologies
(Quiver Fig. 8's four cases), baselines under the same capacities, the simulator."""

import json
import time

import numpy as np
import pytest

from hybridgnn.features.placement import (
    DISK,
    EVERY,
    GPU,
    HOST,
    Plan,
    degree_plan,
    fap_plan,
    hash_plan,
    importance_plan,
    snake,
)
from hybridgnn.features.simulate import PATHS, classify, simulate
from hybridgnn.features.topology import Topology, peer_cliques

ROW = 100  # bytes per feature row
FAP = np.array([0.5, 0.4, 0.3, 0.2, 0.1, 0.05])  # node 0 hottest, as in Fig. 8


def topo(**kw) -> Topology:
    base = dict(gpus_per_server=4, nvlink_cliques=4, gpu_memory_bytes=1 * ROW, host_memory_bytes=2 * ROW)
    base.update(kw)
    return Topology(**base)


def where(plan: Plan, node: int) -> tuple:
    return int(plan.tier[node]), int(plan.server[node]), int(plan.clique[node]), int(plan.gpu[node])


def test_fig8a_without_nvlink_the_hottest_row_is_on_every_gpu():
    plan = fap_plan(FAP, topo(), ROW)
    assert where(plan, 0) == (GPU, EVERY, EVERY, EVERY)
    assert [where(plan, n)[0] for n in (1, 2)] == [HOST, HOST]
    assert all(plan.tier[3:] == DISK)


def test_fig8b_with_nvlink_hot_rows_are_partitioned_in_a_clique_and_replicated_across():
    plan = fap_plan(FAP, topo(nvlink_cliques=2), ROW)  # two cliques of two GPUs
    assert where(plan, 0) == (GPU, EVERY, EVERY, 0) and where(plan, 1) == (GPU, EVERY, EVERY, 1)
    assert [where(plan, n)[0] for n in (2, 3)] == [HOST, HOST]
    assert plan.summary(FAP)[0]["bytes_all_copies"] == 2 * 2 * ROW  # 2 rows × 2 cliques


def test_fig8c_without_infiniband_servers_replicate_the_hottest():
    t = topo(servers=2, gpus_per_server=1, nvlink_cliques=1, network="ethernet")
    plan = fap_plan(FAP, t, ROW)
    assert where(plan, 0) == (GPU, EVERY, EVERY, EVERY)
    assert where(plan, 1)[:2] == (HOST, EVERY) and where(plan, 2)[:2] == (HOST, EVERY)
    assert all(plan.tier[3:] == DISK)


def test_fig8d_with_infiniband_servers_partition_the_hottest():
    t = topo(servers=2, gpus_per_server=1, nvlink_cliques=1, network="infiniband")
    plan = fap_plan(FAP, t, ROW)
    assert [where(plan, n)[:2] for n in (0, 1)] == [(GPU, 0), (GPU, 1)]
    assert sorted(int(plan.server[n]) for n in (2, 3, 4, 5)) == [0, 0, 1, 1]
    assert all(plan.tier[2:] == HOST)  # 2 servers × 2 host rows hold the rest


@pytest.mark.parametrize("servers,network", [(1, "none"), (2, "infiniband"), (3, "ethernet")])
@pytest.mark.parametrize("cliques", [1, 2, 4])
def test_every_method_respects_capacities_and_rows_are_dense(servers, network, cliques):
    rng = np.random.default_rng(servers * 10 + cliques)
    n = 500
    fap = rng.pareto(1.2, n)
    t = Topology(servers=servers, gpus_per_server=4, nvlink_cliques=cliques, gpu_memory_bytes=20 * ROW,
                 host_memory_bytes=60 * ROW, disk_bytes=1000 * ROW, network=network)
    for plan in (fap_plan(fap, t, ROW), hash_plan(n, t, ROW), degree_plan(fap, t, ROW), importance_plan(fap, t, ROW)):
        plan.check_capacities()  # (also done on construction)
        key = np.stack([plan.tier, plan.server, plan.clique, plan.gpu], axis=1)
        for k in np.unique(key, axis=0):
            rows = np.sort(plan.row[(key == k).all(axis=1)])
            assert rows.tolist() == list(range(rows.size))  # each store's rows are 0..m-1


def test_capacity_violations_and_bad_topologies_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        fap_plan(np.ones(50), topo(disk_bytes=10 * ROW), ROW)
    with pytest.raises(ValueError, match="nvlink_cliques must divide"):
        Topology(gpus_per_server=4, nvlink_cliques=3)
    with pytest.raises(ValueError, match="need a network"):
        Topology(servers=2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"servers": 2, "gpus_per_server": 8, "nvlink_cliques": 2, "gpu_memory_bytes": "40G",
                                "host_memory_bytes": "512G", "network": "infiniband",
                                "links": {"infiniband": {"bandwidth_gbps": 50}}}))
    t = Topology.load(path)
    assert t.gpus_per_clique == 4 and t.has_nvlink and t.fast_network and t.gpu_memory_bytes == 40 << 30
    assert t.link("infiniband").bandwidth_gbps == 50 and t.link("infiniband").latency_us == 4.0
    path.write_text(json.dumps({"servers": 1, "gpu_count": 2}))
    with pytest.raises(ValueError, match="unknown topology fields"):
        Topology.load(path)


def test_peer_cliques_from_peer_access():
    nvlinked = {(0, 1), (1, 0), (2, 3), (3, 2)}
    assert peer_cliques(4, lambda a, b: (a, b) in nvlinked) == [[0, 1], [2, 3]]
    assert peer_cliques(3, lambda a, b: False) == [[0], [1], [2]]


def test_peer_cliques_never_group_gpus_that_are_not_peers():
    # cut to consecutive ranges, the groups were [0,1],[2,3] though GPU 0 reaches only 2 (and
    # 2 of 8 uneven [0,1,2],[3..7] became [2,3]): rows were dealt across non-peers
    def peers(*groups):
        pairs = {(a, b) for g in groups for a in g for b in g}
        return lambda a, b: (a, b) in pairs

    assert peer_cliques(4, peers([0, 2], [1, 3])) == [[0], [1], [2], [3]]
    assert peer_cliques(8, peers([0, 1, 2], [3, 4, 5, 6, 7])) == [[i] for i in range(8)]
    assert peer_cliques(6, peers([0, 1, 2, 3], [4, 5])) == [[0, 1], [2, 3], [4, 5]]


def test_snake_balances_fap_mass():
    fap = np.sort(np.random.default_rng(0).exponential(1.0, 1000))[::-1]
    mass = np.bincount(snake(1000, 4), weights=fap, minlength=4)
    dealt = np.bincount(np.arange(1000) % 4, weights=fap, minlength=4)  # plain round robin
    assert mass.max() / mass.min() < 1.01 < dealt.max() / dealt.min()


def test_simulator_charges_each_path_and_waits_for_the_slowest(tmp_path):
    t = topo(nvlink_cliques=2, links={"pcie": {"bandwidth_gbps": 1.0, "latency_us": 0.0},
                                      "hbm": {"bandwidth_gbps": 1000.0, "latency_us": 0.0},
                                      "nvlink": {"bandwidth_gbps": 100.0, "latency_us": 0.0},
                                      "disk": {"bandwidth_gbps": 0.1, "latency_us": 0.0}})
    plan = fap_plan(FAP, t, ROW)
    assert [PATHS[p] for p in classify(plan, np.arange(6))] == ["hbm", "nvlink", "pcie", "pcie", "disk", "disk"]
    res = simulate(plan, [np.array([0, 1]), np.array([0, 2, 3]), np.array([5])])
    assert res.seconds[0] == pytest.approx(ROW / 100e9)  # NVLink slower than HBM
    assert res.seconds[1] == pytest.approx(2 * ROW / 1e9)  # two PCIe rows
    assert res.seconds[2] == pytest.approx(ROW / 0.1e9)
    saved = plan.save(tmp_path / "plan")
    again = Plan.load(saved)
    assert np.array_equal(again.row, plan.row) and again.topology.nvlink_cliques == 2


def test_expected_path_time_charges_a_remote_disk_row_as_the_simulator_does():
    # the slower of the network and the disk (it was the network's speed alone)
    from hybridgnn.features.simulate import expected_path_seconds

    links = {"disk": {"bandwidth_gbps": 0.1, "latency_us": 0.0}, "infiniband": {"bandwidth_gbps": 10.0, "latency_us": 0.0}}
    plan = fap_plan(FAP, topo(servers=2, network="infiniband", host_memory_bytes=0, links=links), ROW,
                    balance_links=False)
    remote = classify(plan, np.arange(6)) == PATHS.index("remote_disk")
    assert remote.any()
    want = FAP[remote].sum() * ROW / 0.1e9
    assert expected_path_seconds(plan, FAP)["remote_disk"] == pytest.approx(want)
    assert simulate(plan, [np.flatnonzero(remote)[:1]]).seconds[0] == pytest.approx(ROW / 0.1e9)


def test_fap_beats_hash_on_a_skewed_graph_with_nvlink(skewed_graph):
    from hybridgnn.features.simulate import sample_batches
    from hybridgnn.workload.tables import WorkloadTables, seed_distribution

    p0, _ = seed_distribution(skewed_graph, "degree")
    fap = WorkloadTables.build(skewed_graph, (4, 3), "degree").fap
    t = Topology(gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=5 * ROW, host_memory_bytes=100 * ROW)
    batches = sample_batches(skewed_graph, (4, 3), p0, batch_size=4, count=200)
    fap_ms = simulate(fap_plan(fap, t, ROW), batches).quantile_ms(0.99)
    hash_ms = simulate(hash_plan(skewed_graph.num_nodes, t, ROW), batches).quantile_ms(0.99)
    assert fap_ms <= hash_ms


@pytest.mark.parametrize("fields, match", [
    ({"servers": "abc"}, "servers must be a whole number"),
    ({"gpus_per_server": 2.5}, "gpus_per_server must be a whole number"),
    ({"servers": True}, "servers must be a whole number"),
    ({"network": 3}, "network must be a string"),
    ({"links": []}, "links must be a mapping"),
    ({"links": {"pcie": 5}}, "link pcie must be a mapping"),
    ({"links": {"pcie": {"bw": 5}}}, "link pcie must be a mapping"),
    ({"links": {"pcie": {"bandwidth_gbps": 0}}}, "bandwidth_gbps must be a finite number > 0"),
    ({"links": {"disk": {"bandwidth_gbps": "x"}}}, "bandwidth_gbps must be a finite number"),
    ({"links": {"nvlink": {"latency_us": -1}}}, "latency_us must be a finite number >= 0"),
    ({"links": {"nvlink": {"latency_us": float("nan")}}}, "latency_us must be a finite number"),
    ({"links": {"pcie": {"bandwidth_gbps": 10**400}}}, "bandwidth_gbps must be a finite number"),  # past float
    ({"gpu_memory_bytes": True}, "gpu_memory_bytes must be a size"),
    ({"numa_nodes": 0}, "numa_nodes must be >= 1"),
])
def test_topology_fields_of_the_wrong_type_are_named(tmp_path, fields, match):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=match):
        Topology.load(path)


def test_a_plan_that_is_not_one_is_refused_in_one_line(tmp_path):
    saved = fap_plan(FAP, topo(), ROW).save(tmp_path / "plan")
    good = (saved / "plan.json").read_text()
    for text, match in (("[]", "not a `hybridgnn place` plan"), ("{", "not valid JSON"),
                        (good.replace('"servers": 1', '"servers": "abc"'), "servers must be a whole number")):
        (saved / "plan.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            Plan.load(saved)
    (saved / "plan.json").write_text(good)
    (saved / "tier.npy").write_bytes((saved / "tier.npy").read_bytes()[:60])
    with pytest.raises(ValueError, match=r"tier\.npy: not a readable \.npy file"):
        Plan.load(saved)


def test_a_plan_made_for_another_dataset_is_refused_at_serve(tmp_path):
    # equal node counts were all that was checked: a plan whose hot rows are another
    # graph's was served
    from types import SimpleNamespace

    from hybridgnn.errors import ConfigError
    from hybridgnn.runtime.resources import Resources

    plan = fap_plan(FAP, topo(), ROW)
    old = plan.save(tmp_path / "old")  # saved before plans recorded it: served as before
    plan.made_for = made_for = {"dataset_fingerprint": "aaaa", "fanouts": [5, 3], "seeds": "uniform"}
    saved = plan.save(tmp_path / "plan")
    assert Plan.load(saved).made_for == made_for and Plan.load(old).made_for == {}

    def resources(path, fingerprint):
        cfg = SimpleNamespace(gpu_memory=SimpleNamespace(placement_plan=path, placement_server=0))
        return SimpleNamespace(cfg=cfg, dynamic=None, graph=SimpleNamespace(
            num_nodes=plan.num_nodes, fingerprint=fingerprint, root=tmp_path / "g"))

    assert Resources._load_plan(resources(saved, "aaaa")).num_nodes == plan.num_nodes
    assert Resources._load_plan(resources(old, "bbbb")).num_nodes == plan.num_nodes
    with pytest.raises(ConfigError, match="was made for dataset aaaa, not bbbb .* make it again with `hybridgnn place`"):
        Resources._load_plan(resources(saved, "bbbb"))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_request_counts_that_are_not_finite_are_refused(skewed_graph, tmp_path, bad):
    # NaN counts passed the >= 0 and sum > 0 checks: FAP, and every tier's share, were NaN
    from hybridgnn.workload.tables import seed_distribution

    counts = np.ones(skewed_graph.num_nodes)
    counts[3] = bad
    np.save(tmp_path / "seeds.counts.npy", counts)
    with pytest.raises(ValueError, match="finite non-negative counts"):
        seed_distribution(skewed_graph, str(tmp_path / "seeds.counts.npy"))


@pytest.mark.parametrize("fields, match", [
    ({"servers": 10**9, "network": "infiniband"}, r"servers must be within \[1, 4096\]"),
    ({"gpus_per_server": 10**6}, "gpus_per_server must be at most 256"),
])
def test_a_topology_too_large_to_plan_for_is_refused_at_once(tmp_path, fields, match):
    """A billion servers: making or checking a plan passes over the rows once per server
    (and int16 server numbers wrap past 32,767), so `place` and `serve --placement` never
    finished."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=match):
        Topology.load(path)


def test_a_topology_file_that_is_not_text_is_a_value_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read topology"):
        Topology.load(path)


def _saved_plan(tmp_path):
    t = topo(servers=2, gpus_per_server=2, nvlink_cliques=1, network="infiniband")
    return fap_plan(FAP, t, ROW).save(tmp_path / "plan")


@pytest.mark.parametrize("edit, match", [
    (lambda m, a: m.update(row_bytes=0), "row_bytes must be a whole number >= 1"),  # ZeroDivisionError
    (lambda m, a: m["topology"].update(servers=10**9), r"servers must be within \[1, 4096\]"),  # no end
    (lambda m, a: a.update(row=a["row"][:1]), "one entry per node each"),  # IndexError serving from it
    (lambda m, a: a.update(tier=a["tier"].astype(np.float64)), "tier must be a 1-D integer array"),
    (lambda m, a: a.update(tier=np.full_like(a["tier"], 7)), r"tier values must lie in \[0, 2\]"),
    (lambda m, a: a.update(server=np.full_like(a["server"], 5)), r"server values must lie in \[-1, 1\]"),
    (lambda m, a: a.update(gpu=np.full_like(a["gpu"], 9)), r"gpu values must lie in \[-1, 1\]"),
    (lambda m, a: a.update(row=a["row"] - 100), "row values must be >= 0"),
])
def test_a_damaged_plan_is_refused_at_load(tmp_path, edit, match):
    saved = _saved_plan(tmp_path)
    meta = json.loads((saved / "plan.json").read_text())
    arrays = {n: np.load(saved / f"{n}.npy") for n in ("tier", "server", "clique", "gpu", "row")}
    edit(meta, arrays)
    (saved / "plan.json").write_text(json.dumps(meta))
    for n, a in arrays.items():
        np.save(saved / f"{n}.npy", a)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        Plan.load(saved)
    assert time.perf_counter() - t0 < 5


def test_capacities_are_checked_per_server_in_one_pass(tmp_path):
    """The check passed over every row once per server: 4,096 servers now cost one pass."""
    t = Topology(servers=4096, gpus_per_server=1, nvlink_cliques=1, gpu_memory_bytes=ROW, host_memory_bytes=ROW,
                 network="infiniband")
    plan = hash_plan(20_000, t, ROW)
    t0 = time.process_time()  # CPU time: a loaded machine's descheduling is not counted
    plan.check_capacities()
    assert time.process_time() - t0 < 1
    plan.tier[plan.server == 7] = HOST  # server 7's GPU rows onto its host: one row more than it holds
    with pytest.raises(ValueError, match="rows in host of server 7, capacity 1"):
        plan.check_capacities()


@pytest.mark.parametrize("field", ["servers", "network", "gpu_memory_bytes", "links"])
def test_a_yaml_alias_bomb_in_a_topology_is_one_short_value_error(tmp_path, field):
    """The error message repr()-ed (and a size str()-ed) the value whole: nine aliases of
    nine expanded to 387 million strings, gigabytes, before a line was printed."""
    pytest.importorskip("yaml")
    levels = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)]
    bomb = f"[{', '.join(levels)}]"
    path = tmp_path / "t.yaml"
    path.write_text(f"{field}: {{pcie: {bomb}}}\n" if field == "links" else f"{field}: {bomb}\n")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:
        Topology.load(path)
    assert time.perf_counter() - t0 < 5 and len(str(info.value)) < 1000


def test_topology_keys_that_are_not_text_are_named_not_a_type_error(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "t.yaml"
    path.write_text("1: 2\nfoo: 3\n")  # sorting 1 and 'foo' was a TypeError traceback
    with pytest.raises(ValueError, match="unknown topology fields"):
        Topology.load(path)
    path.write_text("links: {1: 2, foo: 3}\n")
    with pytest.raises(ValueError, match="unknown links"):
        Topology.load(path)


def test_memory_past_int64_in_rows_still_plans():
    # 1e30 bytes of GPU and host memory per server, two servers on InfiniBand: the choice of
    # how many rows to replicate was a numpy ufunc traceback (linspace over Python ints)
    t = Topology.from_dict({"servers": 2, "network": "infiniband", "gpus_per_server": 2, "nvlink_cliques": 1,
                            "gpu_memory_bytes": 1e30, "host_memory_bytes": 1e30})
    plan = fap_plan(FAP, t, ROW)
    assert (plan.tier == GPU).all() and (plan.server == EVERY).all()  # room for all of it everywhere


def test_a_topology_file_past_its_size_bound_is_refused_unread(tmp_path):
    from hybridgnn.features.topology import MAX_TOPOLOGY_BYTES

    path = tmp_path / "t.json"
    path.write_text("{}" + " " * MAX_TOPOLOGY_BYTES)  # valid JSON; any size of file was read whole, then parsed
    with pytest.raises(ValueError, match=f"past the {MAX_TOPOLOGY_BYTES:,}"):
        Topology.load(path)


@pytest.mark.parametrize("name, text", [("t.json", '{"servers": 1' + "0" * 5000 + "}"),
                                        ("t.yaml", "servers: 1" + "0" * 5000)])
def test_a_number_too_long_to_read_names_the_topology_file(tmp_path, name, text):
    # Python's int limit (4300 digits) was a ValueError naming neither the file nor the field,
    # advising sys.set_int_max_str_digits()
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=f"topology {path} is not valid"):
        Topology.load(path)


def test_a_fap_plan_over_many_servers_is_made_in_one_pass_over_the_rows():
    """Each of the 9 candidate plans passed over the partitioned rows once per server: 4,096
    servers and 400,000 rows took about 7 s (under 1 s now), a real graph's rows minutes."""
    t = Topology(servers=4096, network="infiniband", gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=30 * ROW,
                 host_memory_bytes=60 * ROW)
    fap = np.random.default_rng(0).pareto(1.2, 400_000)
    t0 = time.process_time()  # CPU time: a loaded machine's descheduling is not counted
    plan = fap_plan(fap, t, ROW)
    assert time.process_time() - t0 < 3
    everywhere = int((plan.server == EVERY).sum())
    assert 0 < everywhere <= 22  # replicated rows: at most what the partition leaves spare, 91,520 // 4,095
    own = np.bincount(plan.server[plan.server >= 0], minlength=4096)
    assert own.max() + everywhere == 2 * 30 + 60  # every server's memory full


def test_a_fap_plan_partitions_by_place_as_each_server_fills_its_memory():
    """Two servers on InfiniBand, two GPUs in one clique: the replicated rows come first on
    every server, then its own, hottest first, the first 2 × 2 places on GPUs (dealt back
    and forth), the rest on host."""
    fap = np.arange(10, 0, -1, dtype=np.float64)  # node 0 hottest
    t = Topology(servers=2, network="infiniband", gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=2 * ROW,
                 host_memory_bytes=2 * ROW)
    plan = fap_plan(fap, t, ROW, balance_links=False)  # 2 × 6 places for 10 rows: the 2 hottest replicated
    assert plan.server.tolist() == [EVERY, EVERY, 0, 1, 1, 0, 0, 1, 1, 0]
    assert plan.tier.tolist() == [GPU] * 6 + [HOST] * 4
    # server 0 holds 0 1 2 5 | 6 9, server 1 0 1 3 4 | 7 8: GPU places dealt 0 1 1 0
    assert plan.gpu.tolist() == [0, 1, 1, 1, 0, 0] + [EVERY] * 4


def _hand_plan(t: Topology, tier, server, gpu) -> Plan:
    n = len(tier)
    return Plan(t, "hand", ROW, np.array(tier, np.int8), np.array(server, np.int16), np.full(n, EVERY, np.int16),
                np.array(gpu, np.int16), np.zeros(n, np.int64))


def test_a_plan_is_refused_one_row_past_a_capacity_counting_rows_every_server_holds():
    """Each GPU, host and disk holds exactly its capacity; one row more is refused, and a
    row replicated on every server (or every GPU) counts against each of them."""
    t = Topology(servers=2, gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=2 * ROW,
                 host_memory_bytes=3 * ROW, disk_bytes=4 * ROW, network="ethernet")
    _hand_plan(t, [GPU] * 2, [0, 0], [0, 0])  # GPU 0 of server 0 full
    with pytest.raises(ValueError, match="puts 3 rows on GPU 0 of clique 0 of server 0, capacity 2"):
        _hand_plan(t, [GPU] * 3, [0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="puts 3 rows on GPU 1 of clique 0 of server 1, capacity 2"):
        _hand_plan(t, [GPU] * 3, [1, 1, EVERY], [1, 1, EVERY])  # the last row is on every GPU of every server
    _hand_plan(t, [HOST] * 3, [1, 1, 1], [EVERY] * 3)
    with pytest.raises(ValueError, match="puts 4 rows in host of server 1, capacity 3"):
        _hand_plan(t, [HOST] * 4, [1, 1, 1, 1], [EVERY] * 4)
    with pytest.raises(ValueError, match="puts 4 rows in host of server 1, capacity 3"):
        _hand_plan(t, [HOST] * 4, [1, 1, EVERY, EVERY], [EVERY] * 4)
    with pytest.raises(ValueError, match="puts 5 rows in disk"):
        _hand_plan(t, [DISK] * 5, [EVERY] * 5, [EVERY] * 5)
    with pytest.raises(ValueError, match="rows on GPUs, but the topology has none"):
        _hand_plan(Topology(host_memory_bytes=3 * ROW), [GPU], [0], [EVERY])


def test_rows_that_fit_one_disk_exactly_are_replicated_and_more_are_partitioned():
    t = Topology(servers=2, disk_bytes=3 * ROW, network="ethernet")  # slow: a disk's rows replicated if they fit
    assert (fap_plan(np.arange(3, 0, -1.0), t, ROW).server == EVERY).all()
    plan = fap_plan(np.arange(6, 0, -1.0), t, ROW)
    assert (plan.tier == DISK).all() and sorted(np.bincount(plan.server)) == [3, 3]


def test_the_degree_baseline_replicates_its_hottest_rows_on_every_gpu_even_within_a_clique():
    """PaGraph/BGL keep a copy of each cached row on every GPU: with NVLink cliques too
    (where fap_plan partitions a clique's rows), so the baseline is what those systems do."""
    plan = degree_plan(np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.5]), topo(nvlink_cliques=2), ROW)
    assert where(plan, 0) == (GPU, EVERY, EVERY, EVERY)
    assert [where(plan, n)[0] for n in (1, 2)] == [HOST, HOST] and all(plan.tier[3:] == DISK)
