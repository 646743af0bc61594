"""`hybridgnn precompute --nprocs N`: real rank processes on 127.0.0.1 (gloo) give the
single-process embeddings, fail as a whole with one line when a rank dies, and resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridgnn.distributed.partition import metis_available
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute
from hybridgnn.embeddings.store import EmbeddingStore, embeddings_dir
from hybridgnn.graph.generate import generate_csbm
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import load_checkpoint, save_checkpoint, save_model
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.runtime.ranks import HOSTED_STORE_ENV, rank_environment
from tests.support.server import exit_codes_within, free_port

METIS = "metis" if metis_available() else "ranges"


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dist") / "csbm"
    generate_csbm(path, num_nodes=2500, num_classes=4, feature_dim=12, avg_degree=7, feature_signal=0.3, seed=5)
    return path


def precompute_cli(dataset: Path, model: Path, *flags: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(dataset),
                           "--model", str(model), *flags], capture_output=True, text=True, timeout=timeout_s)


def single_and_distributed(tmp_path: Path, graph_dir: Path, model, *flags: str, dtype: str = "float32"):
    """(single-process store, distributed store, the run's report) for the same saved model."""
    graph = GraphStore.open(graph_dir)
    single, dist = tmp_path / "single", tmp_path / "dist"
    if isinstance(model, GNN):
        save_checkpoint(model, single)
    else:
        save_model(model, single)
    shutil.copytree(single, dist)
    expected = precompute(graph, load_checkpoint(single)[0], single, PrecomputeConfig(dtype=dtype, batch_size=300),
                          progress=False)
    run = precompute_cli(graph_dir, dist, "--dtype", dtype, "--batch-size", "200", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    got = EmbeddingStore.open(dist, graph.fingerprint)
    assert got is not None
    return expected, got, json.loads(run.stdout)


def assert_equal_stores(expected: EmbeddingStore, got: EmbeddingStore, atol: float = 1e-5) -> None:
    assert len(expected.layers) == len(got.layers)
    for a, b in zip(expected.layers, got.layers, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()) <= atol
    assert (expected.output is None) == (got.output is None)
    if expected.output is not None:
        assert float(np.abs(np.asarray(expected.output) - np.asarray(got.output)).max()) <= atol


# (gcn, 2 ranks, ranges) is test_the_same_command_runs_under_torchrun's case
@pytest.mark.parametrize("kind,ranks,partition", [("sage", 2, "ranges"), ("gcn", 3, METIS), ("gat", 4, "ranges"),
                                                  ("sage", 4, METIS)])
def test_ranks_give_the_single_process_embeddings(tmp_path, graph_dir, kind, ranks, partition):
    torch.manual_seed(ranks)
    model = GNN(ModelSpec(kind, 12, 16, 4, num_layers=3, heads=2)).eval()
    expected, got, report = single_and_distributed(tmp_path, graph_dir, model, "--nprocs", str(ranks),
                                                   "--partition", partition, "--chunk-mb", "0.01")
    assert_equal_stores(expected, got)
    assert report["ranks"] == ranks and report["partition"] == partition
    assert len(report["layers"]) == 3
    for layer in report["layers"]:
        assert len(layer["bytes_sent"]) == ranks and sum(layer["bytes_sent"]) > 0  # real halos
        assert sum(layer["bytes_sent"]) < layer["naive_bytes"]
    assert 0 < report["edge_cut"]["fraction"] < 1
    assert got.state["distributed"] == {"ranks": ranks, "partition": partition}


def test_the_batched_halo_exchange_gives_the_single_process_embeddings(tmp_path, graph_dir, monkeypatch):
    """Under NCCL the halo exchange is posted as one batch (NCCL runs a pair's sends and
    receives in order on one stream, and each rank's receive posted before its send waited
    for ever): here the batched exchange over gloo, GCN's degree table and many chunks."""
    monkeypatch.setenv("HYBRIDGNN_HALO_BATCHED", "1")
    torch.manual_seed(7)
    model = GNN(ModelSpec("gcn", 12, 16, 4, num_layers=2)).eval()
    expected, got, report = single_and_distributed(tmp_path, graph_dir, model, "--nprocs", "3",
                                                   "--partition", "ranges", "--chunk-mb", "0.01")
    assert_equal_stores(expected, got)
    assert all(sum(layer["bytes_sent"]) > 0 for layer in report["layers"])  # real halos, 0.01 MB chunks: many


def test_a_pyg_model_with_jumping_knowledge_and_half_precision(tmp_path, graph_dir):
    from torch_geometric.nn.models import GraphSAGE

    torch.manual_seed(1)
    model = GraphSAGE(12, 16, num_layers=2, out_channels=4, jk="cat", aggr="max").eval()
    expected, got, _ = single_and_distributed(tmp_path, graph_dir, model, "--nprocs", "3", dtype="float16")
    assert_equal_stores(expected, got, atol=2e-3)  # one float16 rounding apart at most
    assert got.output is not None


def rank_pids(parent: int) -> dict[int, int]:
    """{rank: pid} of the rank processes the launcher `parent` started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if ppid == parent and b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry.name)
    return found


def test_a_killed_rank_fails_the_run_in_one_line_and_a_rerun_resumes(tmp_path, graph_dir):
    torch.manual_seed(3)
    model = GNN(ModelSpec("sage", 12, 16, 4, num_layers=4)).eval()
    path = tmp_path / "m"
    save_checkpoint(model, path)
    graph = GraphStore.open(graph_dir)
    root = embeddings_dir(path, graph.fingerprint)
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir), "--model",
           str(path), "--nprocs", "3", "--partition", "ranges"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        victim = None
        while time.monotonic() < deadline and launcher.poll() is None:
            state = root / "state.json"
            if state.is_file() and json.loads(state.read_text()).get("layer", 0) >= 1:
                victim = rank_pids(launcher.pid).get(1)
                if victim is not None:
                    os.kill(victim, signal.SIGSTOP)  # held mid-run: the run cannot finish without it
                    break
            time.sleep(0.01)  # poll interval, bounded by the deadline
        assert victim is not None, "rank 1 was not found running after layer 1"
        os.kill(victim, signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("hybridgnn precompute:")]
    assert len(lines) == 1 and "rank 1 of 3 was killed by SIGKILL" in lines[0], err[-2000:]
    state = json.loads((root / "state.json").read_text())
    assert not state.get("complete") and 1 <= state["layer"] < 4
    assert EmbeddingStore.open(path, graph.fingerprint) is None  # never served as it stands
    assert not rank_pids(launcher.pid)
    first_layer = (root / "layer_1.npy").stat().st_mtime_ns

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming precompute at layer {state['layer'] + 1}" in rerun.stderr
    assert (root / "layer_1.npy").stat().st_mtime_ns == first_layer  # finished layers are kept
    expected_dir = tmp_path / "single"
    save_checkpoint(model, expected_dir)
    expected = precompute(graph, load_checkpoint(expected_dir)[0], expected_dir, progress=False)
    assert_equal_stores(expected, EmbeddingStore.open(path, graph.fingerprint))


def test_a_rank_that_fails_by_itself_is_named_with_its_error(tmp_path, graph_dir):
    model = GNN(ModelSpec("sage", 7, 8, 4, num_layers=2)).eval()  # 7-dim input; the graph has 12
    save_checkpoint(model, tmp_path / "m")
    run = precompute_cli(graph_dir, tmp_path / "m", "--nprocs", "2")
    assert run.returncode == 2  # the input's fault: running again would not mend it, and the line says so
    lines = [line for line in run.stderr.splitlines() if line.startswith("hybridgnn precompute:")]
    assert len(lines) == 1 and "exited with code 2: model expects 7-dim features, dataset has 12" in lines[0], \
        run.stderr[-2000:]
    assert "fix that and run the command again" in lines[0] and "resume" not in lines[0]


def test_the_same_command_runs_under_torchrun(tmp_path, graph_dir):
    torch.manual_seed(4)
    model = GNN(ModelSpec("gcn", 12, 8, 4, num_layers=2)).eval()
    graph = GraphStore.open(graph_dir)
    single, dist = tmp_path / "single", tmp_path / "dist"
    save_checkpoint(model, single)
    save_checkpoint(model, dist)
    expected = precompute(graph, load_checkpoint(single)[0], single, progress=False)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir), "--model", str(dist),
                          "--partition", "ranges"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["ranks"] == 2  # rank 0 reports; rank 1 says nothing
    assert_equal_stores(expected, EmbeddingStore.open(dist, graph.fingerprint))


def test_a_rerun_that_rewrites_a_complete_store_unmarks_it_before_touching_a_layer(tmp_path, graph_dir, monkeypatch):
    """A complete store recomputed with other settings (here float16) is no longer served
    from the moment its layer files are rewritten: a rank failing in the first layer left
    the old state.json saying complete over a half-written layer_1.npy."""
    from hybridgnn.distributed import driver

    torch.manual_seed(4)
    path = tmp_path / "m"
    save_checkpoint(GNN(ModelSpec("sage", 12, 8, 4, num_layers=2)).eval(), path)
    graph = GraphStore.open(graph_dir)
    precompute(graph, load_checkpoint(path)[0], path, PrecomputeConfig(dtype="float32"), progress=False)
    assert EmbeddingStore.open(path, graph.fingerprint) is not None

    opened = []

    def failing_open(layer_path, *args):
        opened.append(json.loads((layer_path.parent / "state.json").read_text()))
        raise RuntimeError("rank failed in its first layer")

    monkeypatch.setattr(driver, "_open_layer", failing_open)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="first layer"):
        driver.run_rank(graph_dir, path, PrecomputeConfig(dtype="float16"),
                        driver.DistributedConfig(partition="ranges", timeout_s=60), progress=False)
    assert opened and not opened[0].get("complete") and opened[0]["dtype"] == "float16"
    assert EmbeddingStore.open(path, graph.fingerprint) is None


def test_a_launcher_killed_with_sigkill_leaves_no_rank_running(tmp_path, graph_dir):
    """Its ranks end with it (they ran on to the end, or waited out --timeout-s, as
    orphans; a rerun then wrote the same layer files beside them); the store is not
    served and the same command resumes."""
    torch.manual_seed(3)
    model = GNN(ModelSpec("sage", 12, 16, 4, num_layers=4)).eval()
    path = tmp_path / "m"
    save_checkpoint(model, path)
    graph = GraphStore.open(graph_dir)
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir), "--model",
           str(path), "--nprocs", "2", "--partition", "ranges"]
    # small batches: the ranks are still at work when the launcher goes
    launcher = subprocess.Popen([*cmd, "--batch-size", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(ranks) < 2 and launcher.poll() is None:
            ranks = rank_pids(launcher.pid)
            time.sleep(0.01)  # poll interval, bounded by the deadline
        assert len(ranks) == 2, "the ranks were not found running"
        launcher.kill()
        launcher.wait(30)

        def alive(pid: int) -> bool:
            try:
                return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False

        deadline = time.monotonic() + 5  # they get SIGTERM at once
        while time.monotonic() < deadline and any(alive(pid) for pid in ranks.values()):
            time.sleep(0.05)  # poll interval, bounded by the deadline
        left = [pid for pid in ranks.values() if alive(pid)]
    finally:
        for pid in ranks.values():  # what the run left, so a failure here leaves nothing behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert not left, f"rank processes {left} outlived the launcher"
    assert EmbeddingStore.open(path, graph.fingerprint) is None
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    expected_dir = tmp_path / "single"
    save_checkpoint(model, expected_dir)
    expected = precompute(graph, load_checkpoint(expected_dir)[0], expected_dir, progress=False)
    assert_equal_stores(expected, EmbeddingStore.open(path, graph.fingerprint))


def test_ctrl_c_stops_the_ranks_with_one_line_and_a_rerun_resumes(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: each rank said "interrupted"
    beside the launcher's own line."""
    graph_dir = tmp_path / "g"  # large enough that a layer takes a while: Ctrl-C comes mid-run
    generate_csbm(graph_dir, num_nodes=30000, num_classes=4, feature_dim=12, avg_degree=7, feature_signal=0.3, seed=5)
    torch.manual_seed(3)
    model = GNN(ModelSpec("sage", 12, 128, 4, num_layers=4)).eval()
    path = tmp_path / "m"
    save_checkpoint(model, path)
    graph = GraphStore.open(graph_dir)
    root = embeddings_dir(path, graph.fingerprint)
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir), "--model",
           str(path), "--nprocs", "2", "--partition", "ranges", "--threads-per-rank", "1"]
    # a group of its own, as a terminal's job
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # rank 0 makes layer 2's file once both ranks finished layer 1: they compute layer 2 now
        while time.monotonic() < deadline and launcher.poll() is None and not (root / "layer_2.npy").is_file():
            time.sleep(0.005)  # poll interval, bounded by the deadline
        ranks = rank_pids(launcher.pid)
        assert len(ranks) == 2, "the ranks were not found running"
        os.kill(ranks[1], signal.SIGSTOP)  # held mid-run: the run cannot finish before Ctrl-C
        os.killpg(launcher.pid, signal.SIGINT)
        os.kill(ranks[1], signal.SIGCONT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("hybridgnn precompute:")]
    assert len(lines) == 1 and "stopped by SIGINT" in lines[0], err[-2000:]
    assert not rank_pids(launcher.pid) and not any((Path("/proc") / str(pid)).exists() for pid in ranks.values())
    assert EmbeddingStore.open(path, graph.fingerprint) is None
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    expected_dir = tmp_path / "single"
    save_checkpoint(model, expected_dir)
    expected = precompute(graph, load_checkpoint(expected_dir)[0], expected_dir, progress=False)
    assert_equal_stores(expected, EmbeddingStore.open(path, graph.fingerprint))


def test_a_rank_that_hangs_is_the_one_named_when_the_others_time_out(tmp_path, graph_dir):
    """A rank that stops answering (here SIGSTOP) fails the run within --timeout-s, and the
    line names it, not one of the ranks that only waited for it and timed out."""
    torch.manual_seed(3)
    path = tmp_path / "m"
    save_checkpoint(GNN(ModelSpec("sage", 12, 16, 4, num_layers=4)).eval(), path)
    root = embeddings_dir(path, GraphStore.open(graph_dir).fingerprint)
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir), "--model",
           str(path), "--nprocs", "3", "--partition", "ranges", "--timeout-s", "5", "--batch-size", "50"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            state = root / "state.json"
            if state.is_file() and json.loads(state.read_text()).get("layer", 0) >= 1:
                victim = rank_pids(launcher.pid).get(1)
                if victim is not None:
                    os.kill(victim, signal.SIGSTOP)
                    break
            time.sleep(0.01)  # poll interval, bounded by the deadline
        assert victim is not None, "rank 1 was not found running after layer 1"
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
    assert launcher.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("hybridgnn precompute:")]
    assert len(lines) == 1 and lines[0].startswith("hybridgnn precompute: rank 1 of 3 stopped answering"), \
        err[-2000:]
    assert took < 5 + 30


def test_a_rerun_replaces_layer_files_a_server_maps_instead_of_rewriting_them(tmp_path, graph_dir, monkeypatch):
    """A serving engine that maps a store's files keeps reading the rows it mapped while
    ranks recompute the store (a rewrite in place truncated the pages under its map:
    zeros, or SIGBUS and the server gone), as a single process's rerun does."""
    from hybridgnn.distributed import driver

    torch.manual_seed(4)
    path = tmp_path / "m"
    save_checkpoint(GNN(ModelSpec("sage", 12, 8, 4, num_layers=2)).eval(), path)
    graph = GraphStore.open(graph_dir)
    precompute(graph, load_checkpoint(path)[0], path, PrecomputeConfig(dtype="float32"), progress=False)
    served = EmbeddingStore.open(path, graph.fingerprint)
    before = [np.array(a) for a in served.layers]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    driver.run_rank(graph_dir, path, PrecomputeConfig(dtype="float16"),
                    driver.DistributedConfig(partition="ranges", timeout_s=60), progress=False)
    for mapped, rows in zip(served.layers, before, strict=True):
        assert np.array_equal(np.asarray(mapped), rows)
    assert EmbeddingStore.open(path, graph.fingerprint).layers[0].dtype == np.float16


def test_a_complete_but_damaged_store_is_computed_again(tmp_path, graph_dir, monkeypatch):
    """A store marked complete whose layer file is damaged (here truncated) is not served
    and is computed again, as one process does (the ranks called it complete and did nothing)."""
    from hybridgnn.distributed import driver

    torch.manual_seed(4)
    path = tmp_path / "m"
    save_checkpoint(GNN(ModelSpec("sage", 12, 8, 4, num_layers=2)).eval(), path)
    graph = GraphStore.open(graph_dir)
    expected = precompute(graph, load_checkpoint(path)[0], path, progress=False)
    expected = [np.array(a) for a in expected.layers]
    layer = embeddings_dir(path, graph.fingerprint) / "layer_2.npy"
    layer.write_bytes(layer.read_bytes()[:1000])
    assert EmbeddingStore.open(path, graph.fingerprint) is None
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    report = driver.run_rank(graph_dir, path, PrecomputeConfig(),
                             driver.DistributedConfig(partition="ranges", timeout_s=60), progress=False)
    assert not report.get("already_complete")
    got = EmbeddingStore.open(path, graph.fingerprint)
    assert got is not None
    for a, b in zip(expected, got.layers, strict=True):
        assert float(np.abs(a - np.asarray(b)).max()) <= 1e-5


def under_torchrun(env: dict[str, str]) -> dict[str, str]:
    """A rank's environment as torchrun gives it: rank 0 holds the store (env://)."""
    return {k: v for k, v in env.items() if k != HOSTED_STORE_ENV}


def test_ranks_under_torchrun_that_disagree_exit_at_once_and_leave_the_store_alone(tmp_path, graph_dir):
    """Ranks started apart (torchrun on two machines) given other halo chunk sizes sent
    and awaited messages of other sizes: a rank aborted inside gloo (SIGABRT) and the
    other failed with no word of why. Every rank now exits 2 at start with one line naming
    the setting and each rank's value, before rank 0 writes anything into the store."""
    path = tmp_path / "m"
    save_checkpoint(GNN(ModelSpec("sage", 12, 8, 4, num_layers=2)).eval(), path)
    port = free_port()
    errors = [tmp_path / f"rank-{r}.txt" for r in range(2)]
    chunk_mb = ("4", "0.0001")
    procs = [subprocess.Popen([sys.executable, "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(graph_dir),
                               "--model", str(path), "--partition", "ranges", "--timeout-s", "600",
                               "--chunk-mb", chunk_mb[r]],
                              env=under_torchrun(rank_environment(r, 2, port, 1, errors[r])),
                              stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for r in range(2)]
    codes = exit_codes_within(procs, 120)  # well inside the ranks' 600 s timeout
    assert codes == [2, 2]  # the input's fault: the launcher says "fix that", not "run again"
    for r in range(2):
        said = errors[r].read_text()
        assert said == ("the 2 precompute ranks do not agree on chunk_bytes 4194304 on rank 0, 104 on rank 1: give "
                        "every rank the same --dataset, --model, --partition, --dtype and --chunk-mb, with the same "
                        "files on every machine, and the same hybridgnn"), said
    assert not (embeddings_dir(path, GraphStore.open(graph_dir).fingerprint) / "state.json").exists()
