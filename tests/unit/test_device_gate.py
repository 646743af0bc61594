"""DEVICE_GATE's contract (capabilities.py): device work runs side by side, a capture
runs alone (it waits for the work under way and holds new work out), a thread inside its
own work can capture, and two such threads capturing at once do not deadlock."""

import threading

from hybridgnn.capabilities import DeviceGate

WAIT_S = 30


def test_work_runs_side_by_side_and_nests():
    gate = DeviceGate()
    inside, leave = threading.Barrier(3), threading.Event()

    def worker():
        with gate.work(), gate.work():  # nested: counted once
            inside.wait(WAIT_S)
            assert leave.wait(WAIT_S)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(WAIT_S)  # both are inside at once
    assert gate.working == 2
    leave.set()
    for t in threads:
        t.join(WAIT_S)
    assert gate.working == 0


def test_a_capture_waits_for_work_under_way_and_holds_new_work_out():
    gate = DeviceGate()
    events = []
    entered, release_work, captured = threading.Event(), threading.Event(), threading.Event()

    def working():
        with gate.work():
            entered.set()
            assert release_work.wait(WAIT_S)
            events.append("work done")

    def capturing():
        with gate.capture():
            events.append("capture")
            captured.set()
            later = threading.Thread(target=late_work)
            later.start()
            later.join(0.2)  # bounded: it must still be waiting outside
            assert later.is_alive()
            events.append("capture done")
        later.join(WAIT_S)

    def late_work():
        with gate.work():
            events.append("late work")

    w = threading.Thread(target=working)
    w.start()
    assert entered.wait(WAIT_S)
    c = threading.Thread(target=capturing)
    c.start()
    assert not captured.wait(0.2)  # the capture waits for the work under way
    release_work.set()
    c.join(WAIT_S)
    w.join(WAIT_S)
    assert events == ["work done", "capture", "capture done", "late work"]


def test_threads_inside_work_capture_one_after_another():
    gate = DeviceGate()
    both_inside = threading.Barrier(2)
    captures, lock = [], threading.Lock()
    running = [0]

    def worker(i):
        with gate.work():
            both_inside.wait(WAIT_S)
            with gate.capture():
                with lock:
                    running[0] += 1
                    captures.append((i, running[0]))
                with lock:
                    running[0] -= 1
            assert gate.working >= 1  # its own hold is back

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert sorted(i for i, _ in captures) == [0, 1] and all(n == 1 for _, n in captures)
    assert gate.working == 0


def test_the_cpu_lanes_device_work_and_executor_building_hold_the_gate(skewed_graph, monkeypatch):
    """With --cpu-compute-device cuda the CPU lane ran its model on the GPU outside the
    gate, and executors were built (device and pinned allocations) outside it too: either
    could overlap another thread's CUDA graph capture."""
    from types import SimpleNamespace

    import numpy as np

    from hybridgnn.capabilities import DEVICE_GATE
    from hybridgnn.features.store import HostFeatureStore
    from hybridgnn.models.gnn import GNN, ModelSpec
    from hybridgnn.pipelines.executor import BatchExecutor
    from hybridgnn.runtime.resources import Resources
    from hybridgnn.sampling.cpu import CPUSampler

    seen = []

    class Recording(GNN):
        def forward(self, *args, **kwargs):
            seen.append(DEVICE_GATE.working)
            return super().forward(*args, **kwargs)

    model = Recording(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    ex = BatchExecutor(CPUSampler(skewed_graph, [3, 2]), HostFeatureStore(skewed_graph.features), model)
    assert not ex.gated  # the CPU's own model takes no gate
    ex.run(np.array([1, 2]))
    ex.gated = True  # as on a GPU
    ex.run(np.array([1, 2]))
    assert seen == [0, 1] and DEVICE_GATE.working == 0

    built = []
    fake = SimpleNamespace(
        cfg=SimpleNamespace(cpu_pipeline=SimpleNamespace(processes=False, split=False, device="cuda")),
        _make_gpu_executor=lambda worker: built.append(("gpu", DEVICE_GATE.working)),
        _make_cpu_executor=lambda worker: built.append(("cpu", DEVICE_GATE.working)))
    Resources.make_executor(fake, "gpu", 0)
    Resources.make_executor(fake, "cpu", 0)
    fake.cfg.cpu_pipeline.device = "cpu"
    Resources.make_executor(fake, "cpu", 0)
    fake.cfg.cpu_pipeline.split = True
    Resources.make_executor(fake, "cpu", 0)
    assert built == [("gpu", 1), ("cpu", 1), ("cpu", 0), ("cpu", 1)]
