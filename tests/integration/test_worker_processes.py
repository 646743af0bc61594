"""CPU workers in processes of their own: same outputs as in-process workers, errors
and exits surface as failed batches, the engine serves through them and stops them."""

import asyncio
import os
import signal
import socket
import struct
import subprocess
import time

import numpy as np
import pytest

from hybridgnn.config import PipelineConfig, SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.pipelines import liveness
from hybridgnn.pipelines.process import (
    MESSAGE_HEAD,
    STALL_S,
    MessageReader,
    ProcessExecutor,
    WorkerProcessError,
    WorkerProcessExited,
)
from hybridgnn.runtime.resources import Resources, build_worker_executor
from hybridgnn.serving.core.engine import Engine
from tests.support.server import ServerProcess, children_of, process_alive

EVERYTHING = (1 << 30, 1 << 30)  # fanouts that take every neighbour: sampling is deterministic


def config(tiny_dataset, tiny_model, fanouts=EVERYTHING, **pipe) -> ServeConfig:
    return ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig(fanouts),
                       cpu_pipeline=PipelineConfig(**{"name": "cpu", "workers": 1, **pipe}))


def test_process_worker_matches_the_in_process_one_and_survives_its_child(tiny_dataset, tiny_model):
    cfg = config(tiny_dataset, tiny_model)
    seeds = np.array([3, 17, 17, 400, 2999])
    local = Resources.open(cfg).make_executor("cpu", 0).run(seeds)
    ex = ProcessExecutor(cfg, 0, build_worker_executor)
    try:
        # a child stopped mid-message holds a blocking read or write (the profiler's, a
        # large batch's thread) for at most STALL_S
        with socket.socket(fileno=os.dup(ex.fileno())) as sock:
            for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                assert struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, 16)) == (STALL_S, 0)
        remote = ex.run(seeds)
        np.testing.assert_array_equal(remote.logits, local.logits)
        np.testing.assert_array_equal(remote.embeddings, local.embeddings)
        np.testing.assert_array_equal(remote.predictions, local.predictions)
        assert remote.sampled_edges == local.sampled_edges and remote.gathered_rows == local.gathered_rows
        assert remote.timings.sample_s > 0 and remote.timings.compute_s > 0
        with pytest.raises(WorkerProcessError, match="seed ids must lie in"):
            ex.run(np.array([10**9]))  # the child reports the failure and lives on
        assert ex.run(seeds).predictions.tolist() == local.predictions.tolist()
        os.kill(ex._proc.pid, signal.SIGKILL)  # a child killed between batches is started again
        ex._proc.join()
        np.testing.assert_array_equal(ex.run(seeds).logits, local.logits)
    finally:
        ex.close()
    assert ex._proc is None


def test_a_hung_child_fails_its_batch_within_the_timeout_and_is_replaced(tiny_dataset, tiny_model, monkeypatch):
    monkeypatch.setenv("HYBRIDGNN_WORKER_BATCH_TIMEOUT_S", "1")
    ex = ProcessExecutor(config(tiny_dataset, tiny_model), 0, build_worker_executor)
    try:
        seeds = np.array([3, 17])
        expected = ex.run(seeds).logits
        hung = ex._proc
        os.kill(hung.pid, signal.SIGSTOP)  # alive, but never answers
        with pytest.raises(WorkerProcessError, match="answered no batch within 1 s"):
            ex.run(seeds)
        assert ex._proc is None and not hung.is_alive()
        np.testing.assert_array_equal(ex.run(seeds).logits, expected)
        # an answer that stops mid-message (read here as a head and nothing after) fails at the
        # stall limit, and the child, its stream out of step, is replaced
        stalled, rest = socket.socketpair()
        rest.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        stalled.sendall(MESSAGE_HEAD.pack(100, 0))
        ex._reader.close()
        ex._reader, child = MessageReader(rest), ex._proc
        with pytest.raises(WorkerProcessExited):
            ex.run(seeds)
        assert ex._proc is None and not child.is_alive()
        stalled.close()
        np.testing.assert_array_equal(ex.run(seeds).logits, expected)
    finally:
        ex.close()


def test_a_stopped_child_fails_its_batch_at_the_stopped_limit_not_the_timeout(tiny_dataset, tiny_model, monkeypatch):
    """/proc tells a SIGSTOPped child from a slow one: with the default 300 s timeout, its
    batch fails within the stopped limit and a new child serves the next."""
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 2.0)
    ex = ProcessExecutor(config(tiny_dataset, tiny_model), 0, build_worker_executor)
    try:
        assert ex.batch_timeout_s == 300
        seeds = np.array([3, 17])
        expected = ex.run(seeds).logits
        stopped = ex._proc
        os.kill(stopped.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerProcessExited, match="was stopped"):
            ex.run(seeds)
        assert time.monotonic() - t0 < 30 and not stopped.is_alive()
        np.testing.assert_array_equal(ex.run(seeds).logits, expected)
    finally:
        ex.close()


def test_engine_serves_through_worker_processes_and_stops_them(tiny_dataset, tiny_model):
    cfg = config(tiny_dataset, tiny_model, fanouts=(5, 3), processes=True)

    async def scenario():
        engine = Engine(cfg)
        await engine.start()
        children = [ex._proc for ex in engine._pipelines["cpu"]._executors]
        try:
            assert all(p.is_alive() for p in children)
            results = await asyncio.gather(*(engine.submit(np.array([i, i + 1])) for i in range(40)))
            assert all(r.logits.shape[0] == 2 for r in results)
        finally:
            await engine.stop()
        return children

    children = asyncio.run(scenario())
    assert all(not p.is_alive() for p in children)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_the_engine_survives_a_child_killed_under_load_and_serves_through_its_replacement(
        tiny_dataset, tiny_model, monkeypatch, sig):
    """The loop drives the children: a kill -9 fails no request (the batch that child held
    is sent again), the waiting batches go to the other child or the restarted one, and
    every request is answered once. A stopped child is killed at the stopped limit, alike."""
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 1.0)
    cfg = config(tiny_dataset, tiny_model, fanouts=(5, 3), processes=True, workers=2)

    async def scenario():
        engine = Engine(cfg)
        await engine.start()
        pipe = engine._pipelines["cpu"]
        victim = pipe._executors[0]._proc
        try:
            first = [engine.submit(np.array([i, i + 1])) for i in range(60)]
            os.kill(victim.pid, sig)
            outcomes = await asyncio.gather(*first, return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            assert not failed, failed
            deadline = asyncio.get_running_loop().time() + 120
            while pipe._executors[0]._proc is victim or not pipe._executors[0].running:
                assert asyncio.get_running_loop().time() < deadline, "the killed child was not replaced"
                await asyncio.sleep(0.05)
            after = await asyncio.gather(*(engine.submit(np.array([i])) for i in range(40)))
            assert all(r.logits.shape[0] == 1 for r in after) and pipe.depth == 0
        finally:
            await engine.stop()
        return len(outcomes) - len(failed)

    answered = asyncio.run(scenario())
    assert answered > 0


def test_answers_larger_than_the_pipe_buffer_cross_intact_under_uvloop(tiny_dataset, tiny_model):
    """uvloop makes a watched descriptor non-blocking: a batch whose seeds or answer
    outgrew the socket buffer broke off mid-message (EAGAIN) and failed as if the child
    had exited. The server runs on uvloop, so the engine is tested on it."""
    import uvloop

    cfg = config(tiny_dataset, tiny_model, processes=True)  # every neighbour: a seed's rows are the same each time
    seeds = np.tile(np.arange(3000), 30)  # 720 KB of ids out, megabytes of outputs back

    async def scenario():
        engine = Engine(cfg)
        await engine.start()
        try:
            return await engine.submit(seeds)
        finally:
            await engine.stop()

    result = uvloop.run(scenario())
    assert result.logits.shape[0] == seeds.shape[0] and result.embeddings.shape[0] == seeds.shape[0]
    np.testing.assert_array_equal(result.logits[:3000], result.logits[-3000:])


def test_worker_processes_refuse_graph_updates_and_the_gpu_pipeline(tiny_dataset, tiny_model):
    with pytest.raises(ValueError, match="static graph"):
        ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, updates=UpdateConfig(token="t" * 16),
                    cpu_pipeline=PipelineConfig(processes=True))
    with pytest.raises(ValueError, match="CPU pipeline"):
        ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model,
                    gpu_pipeline=PipelineConfig(name="gpu", device="cpu", processes=True))


def _cores_of(pid: int) -> dict[str, set[int]]:
    """Each thread's name -> the cores it may run on, read from /proc."""
    cores = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        cores.setdefault(name, set()).update(os.sched_getaffinity(int(tid)))
    return cores


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning apart needs two cores")
def test_worker_cpus_put_the_batches_and_the_event_loop_on_different_cores(tiny_dataset, tiny_model):
    """serve --worker-cpus: the worker processes run on the given core, every thread of
    the server on the others, and requests are answered as before."""
    import json
    import urllib.request

    from tests.support.server import ServerProcess

    worker_core = max(os.sched_getaffinity(0))
    others = os.sched_getaffinity(0) - {worker_core}
    srv = ServerProcess(tiny_dataset, tiny_model, "--worker-cpus", str(worker_core)).wait_ready()
    try:
        server_threads = _cores_of(srv.proc.pid)
        assert server_threads and all(cores == others for cores in server_threads.values()), server_threads
        children = [int(c) for c in os.popen(f"pgrep -P {srv.proc.pid}").read().split()]
        workers = [c for c in children if "cpu-proc" in open(f"/proc/{c}/comm").read()]
        assert len(workers) == 1  # one worker per given core
        assert all(cores == {worker_core} for cores in _cores_of(workers[0]).values())
        body = json.dumps({"inputs": [{"name": "node_ids", "shape": [2], "datatype": "INT64", "data": [3, 17]}],
                           "outputs": [{"name": "predictions"}]}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{srv.url}/v2/models/hybridgnn/infer", body)) as r:
            assert json.loads(r.read())["outputs"][0]["shape"] == [2]
    finally:
        assert srv.stop() == 0


class _OddExecutor:
    """A worker's executor (built in the child by build_odd_executor): seed 13 answers with
    outputs that cannot be pickled, seed 14 takes 0.6 s, others answer their ids."""

    def run(self, seeds):
        import time

        from hybridgnn.types import BatchResult

        if seeds[0] == 14:
            time.sleep(0.6)
        logits = seeds[:, None].astype(np.float32)
        return BatchResult(logits=(lambda: 0) if seeds[0] == 13 else logits, predictions=seeds.copy())


def build_odd_executor(cfg, worker):
    return _OddExecutor()


def test_an_answer_that_cannot_be_pickled_fails_its_batch_and_the_child_serves_on(tiny_dataset, tiny_model):
    ex = ProcessExecutor(config(tiny_dataset, tiny_model), 0, build_odd_executor)
    try:
        child = ex._proc
        with pytest.raises(WorkerProcessError) as failed:
            ex.run(np.array([13]))
        assert not isinstance(failed.value, WorkerProcessExited), failed.value  # the child lives on
        assert ex._proc is child and child.is_alive()
        assert ex.run(np.array([5, 6])).predictions.tolist() == [5, 6]
    finally:
        ex.close()


def test_without_a_batch_timeout_a_long_batch_is_waited_for_past_the_stall_limit(tiny_dataset, tiny_model,
                                                                                  monkeypatch):
    """The stall limit bounds an answer begun, not a batch's time: with the batch timeout
    off, the profiler's run() waited for the first bytes under the stall limit and killed
    a child whose batch took longer."""
    monkeypatch.setenv("HYBRIDGNN_WORKER_BATCH_TIMEOUT_S", "0")
    ex = ProcessExecutor(config(tiny_dataset, tiny_model), 0, build_odd_executor)
    try:
        ex._reader._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        assert ex.run(np.array([14, 2])).predictions.tolist() == [14, 2]  # 0.6 s: past the 0.2 s limit
    finally:
        ex.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


def _until(what, timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)  # poll interval, bounded by the deadline


def _infer_ok(url: str) -> bool:
    import requests

    body = {"inputs": [{"name": "node_ids", "shape": [2], "datatype": "INT64", "data": [1, 2]}]}
    try:
        return requests.post(f"{url}/v2/models/hybridgnn/infer", json=body, timeout=30).status_code == 200
    except requests.RequestException:
        return False


def test_a_sighup_to_the_process_group_spares_the_workers_and_the_resource_tracker(tiny_dataset, tiny_model,
                                                                                   tmp_path):
    """SIGHUP (the server's cache refresh) sent to the whole process group killed
    multiprocessing's resource tracker, which the next worker start relaunched with a
    warning that resources might leak: the tracker and the workers are started with the
    stop signals blocked, as the workers ignore them."""
    log = tmp_path / "server.log"
    srv = ServerProcess(tiny_dataset, tiny_model, "--worker-processes", "on", "--workers", "1", own_group=True,
                        output_file=log).wait_ready()
    try:
        helpers = set(children_of(srv.proc.pid))  # the worker and the resource tracker
        [worker] = [p for p in helpers if b"spawn_main" in _cmdline(p)]
        assert len(helpers) == 2, helpers
        os.killpg(srv.proc.pid, signal.SIGHUP)
        _until(lambda: "placement not refreshed" in srv.output(), 30, "the server did not take the SIGHUP")
        os.kill(worker, signal.SIGKILL)  # its replacement is started: the tracker must still be there
        _until(lambda: "starting it again" in srv.output(), 30, "the killed worker was not noticed")
        _until(lambda: _infer_ok(srv.url), 120, "the killed worker was not replaced")
        assert all(process_alive(p) for p in helpers - {worker}), srv.output()
    finally:
        code = srv.stop()
    out = srv.output()
    assert code == 0, out
    assert "relaunching" not in out and "Traceback" not in out, out


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_signal_while_the_worker_processes_start_stops_the_server_and_them(tiny_dataset, tiny_model,
                                                                                 tmp_path, how):
    """A Ctrl-C (SIGINT to the process group) while the first worker process starts: the
    worker, still importing torch, died of it with a KeyboardInterrupt traceback; once it
    ignored it, the start went on after the server had given up, and the server's exit
    waited for ever on workers nothing would stop. A SIGTERM to the server alone (a pod
    deleted while it starts) killed it outright, silently, and left the starting workers
    running until their start ended."""
    log = tmp_path / "server.log"
    srv = ServerProcess(tiny_dataset, tiny_model, "--worker-processes", "on", "--workers", "2", own_group=True,
                        output_file=log)
    try:
        def workers() -> list[int]:
            return [p for p in children_of(srv.proc.pid) if b"spawn_main" in _cmdline(p)]

        _until(lambda: workers() or srv.proc.poll() is not None, 120, "no worker process started")
        started = children_of(srv.proc.pid)  # the first worker (still starting) and the resource tracker
        if how == "ctrl-c":
            os.killpg(srv.proc.pid, signal.SIGINT)
        else:
            os.kill(srv.proc.pid, signal.SIGTERM)
        try:
            code = srv.proc.wait(90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit:\n{srv.output()}") from None
        _until(lambda: not any(process_alive(p) for p in started), 30, f"left running: {started}")
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
    out = srv.output()
    if how == "ctrl-c":
        assert code == 130 and "interrupted" in out, out
    else:
        assert code == 143 and "serve: terminated" in out, out
    assert "Traceback" not in out, out
