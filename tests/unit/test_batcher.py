import asyncio
import time

import numpy as np

from hybridgnn.config import BatcherConfig
from hybridgnn.serving.core.batcher import MicroBatcher
from hybridgnn.types import InferenceRequest


def make_request(n, loop):
    """A request whose answers (result, error) are kept in req.answers."""
    answers = []
    req = InferenceRequest(node_ids=np.arange(n, dtype=np.int64), on_done=lambda r, e: answers.append((r, e)),
                           arrival_s=time.perf_counter())
    req.answers = answers
    return req


async def until(done, timeout_s=2.0):
    """Return once done() holds (batches due to the max_wait timer), or at the deadline."""
    deadline = time.perf_counter() + timeout_s
    while not done() and time.perf_counter() < deadline:
        await asyncio.sleep(0.001)  # poll interval; bounded by the deadline


async def collect(cfg, sizes, capacity=lambda: True):
    batches = []
    b = MicroBatcher(cfg, batches.append, capacity)
    loop = asyncio.get_running_loop()
    for n in sizes:
        b.add(make_request(n, loop))
    await until(lambda: sum(len(x.requests) for x in batches) == len(sizes))
    b.close()
    return batches


def test_batches_respect_seed_and_request_limits():
    # every batch here closes at a limit; a wait this long never closes one (at 10 ms, a
    # loaded machine's pause between two adds closed the first request's batch early)
    cfg = BatcherConfig(max_batch_seeds=10, max_batch_requests=3, max_wait_s=10.0)
    batches = asyncio.run(collect(cfg, [4, 4, 4, 1, 1, 1, 1, 20]))
    assert [len(b.requests) for b in batches] == [2, 3, 2, 1]
    for b in batches:
        assert b.offsets[-1] == b.num_seeds == sum(len(r.node_ids) for r in b.requests)
        assert b.num_seeds <= 10 or len(b.requests) == 1  # an oversized request goes alone


def test_waits_at_most_max_wait():
    cfg = BatcherConfig(max_batch_seeds=1000, max_wait_s=0.02)

    async def run():
        t0 = time.perf_counter()
        batches = await collect(cfg, [1])
        return batches, batches[0].closed_s - t0

    batches, waited = asyncio.run(run())
    assert len(batches) == 1 and 0.015 <= waited < 0.5


def gated_batcher(cfg, free: bool):
    """A batcher whose capacity is the switch capacity["ok"]; batches land in the list."""
    batches, capacity = [], {"ok": free}
    return MicroBatcher(cfg, batches.append, lambda: capacity["ok"]), batches, capacity


def test_holds_batches_until_capacity_and_grows_them():
    cfg = BatcherConfig(max_batch_seeds=100, max_wait_s=0.0)

    async def run():
        b, batches, free = gated_batcher(cfg, free=False)
        loop = asyncio.get_running_loop()
        for _ in range(5):
            b.add(make_request(2, loop))
            await asyncio.sleep(0.005)
        assert batches == []  # no capacity: nothing dispatched, requests accumulate
        free["ok"] = True
        b.capacity_freed()  # dispatches at once: no turn of the loop needed
        b.close()
        return batches

    batches = asyncio.run(run())
    assert len(batches[0].requests) == 5


def test_batches_close_before_passing_the_psgs_bound():
    cfg = BatcherConfig(max_batch_seeds=1000, max_batch_psgs=100.0, max_wait_s=0.01)

    async def run():
        batches = []
        b = MicroBatcher(cfg, batches.append, lambda: True)
        loop = asyncio.get_running_loop()
        for psgs in (40.0, 40.0, 40.0, 150.0, 10.0):
            req = make_request(1, loop)
            req.psgs = psgs
            b.add(req)
        await until(lambda: sum(len(x.requests) for x in batches) == 5)
        b.close()
        return batches

    batches = asyncio.run(run())
    # 40+40 fits, a third 40 would pass 100; an oversized request still goes (alone)
    assert [[r.psgs for r in b.requests] for b in batches] == [[40.0, 40.0], [40.0], [150.0], [10.0]]


def test_a_due_batch_is_dispatched_in_the_call_that_makes_it_due():
    # No turn of the event loop between a batch becoming due and its dispatch: the
    # request that fills it, and the completion that frees a worker, dispatch it.
    cfg = BatcherConfig(max_batch_seeds=4, max_wait_s=10.0)

    async def run():
        b, batches, free = gated_batcher(cfg, free=True)
        loop = asyncio.get_running_loop()
        b.add(make_request(2, loop))
        assert batches == []  # not full, its deadline 10 s away
        b.add(make_request(2, loop))
        assert [len(x.requests) for x in batches] == [2]  # full: dispatched inside add
        free["ok"] = False
        b.add(make_request(4, loop))
        assert len(batches) == 1 and len(b) == 1  # full but no idle worker: held
        free["ok"] = True
        b.capacity_freed()
        assert [len(x.requests) for x in batches] == [2, 1] and len(b) == 0
        b.close()

    asyncio.run(run())


def test_the_timer_follows_the_first_waiting_request():
    cfg = BatcherConfig(max_batch_seeds=3, max_wait_s=0.03)

    async def run():
        batches = []
        b = MicroBatcher(cfg, batches.append, lambda: True)
        loop = asyncio.get_running_loop()
        b.add(make_request(2, loop))
        await asyncio.sleep(0.01)
        late = make_request(2, loop)
        b.add(late)  # overflows: the first goes at once, the second waits its own max_wait
        assert [len(x.requests) for x in batches] == [1]
        await until(lambda: len(batches) == 2)
        assert batches[1].requests == [late]
        assert batches[1].closed_s - late.arrival_s >= 0.025
        b.close()

    asyncio.run(run())


def test_close_answers_waiting_and_later_requests():
    cfg = BatcherConfig(max_batch_seeds=100, max_wait_s=10.0)

    async def run():
        b = MicroBatcher(cfg, lambda batch: None, lambda: True)
        loop = asyncio.get_running_loop()
        waiting, late = make_request(1, loop), make_request(1, loop)
        b.add(waiting)
        b.close()
        b.add(late)
        for req in (waiting, late):
            assert len(req.answers) == 1 and type(req.answers[0][1]).__name__ == "Draining"

    asyncio.run(run())


def test_a_batch_is_full_at_exactly_its_request_or_psgs_limit():
    """Dispatched inside the add that reaches a limit, not max_wait_s (10 s) later."""
    async def run():
        b, batches, _ = gated_batcher(BatcherConfig(max_batch_requests=3, max_wait_s=10.0), free=True)
        loop = asyncio.get_running_loop()
        for _ in range(3):
            b.add(make_request(1, loop))
        assert [len(x.requests) for x in batches] == [3]
        b.close()
        b, batches, _ = gated_batcher(BatcherConfig(max_batch_psgs=100.0, max_wait_s=10.0), free=True)
        for psgs in (50.0, 50.0):
            req = make_request(1, loop)
            req.psgs = psgs
            b.add(req)
        assert [[r.psgs for r in x.requests] for x in batches] == [[50.0, 50.0]]
        b.close()

    asyncio.run(run())


def test_batches_taken_from_a_backlog_keep_every_limit():
    """Requests held while no worker was idle are cut into batches by the request and PSGS
    limits when capacity returns."""
    async def run():
        b, batches, free = gated_batcher(BatcherConfig(max_batch_requests=3, max_batch_psgs=100.0, max_wait_s=0.0),
                                         free=False)
        loop = asyncio.get_running_loop()
        for psgs in (10.0, 10.0, 10.0, 10.0, 60.0, 60.0):
            req = make_request(1, loop)
            req.psgs = psgs
            b.add(req)
        assert batches == [] and len(b) == 6
        free["ok"] = True
        b.capacity_freed()
        b.close()
        return batches

    batches = asyncio.run(run())
    assert [[r.psgs for r in x.requests] for x in batches] == [[10.0] * 3, [10.0, 60.0], [60.0]]


def test_a_batchs_deadline_is_its_first_requests_and_its_psgs_leaves_with_it():
    async def run():
        b, batches, free = gated_batcher(BatcherConfig(max_batch_psgs=100.0, max_wait_s=10.0), free=False)
        loop = asyncio.get_running_loop()
        old, new = make_request(1, loop), make_request(1, loop)
        old.arrival_s -= 20.0  # its 10 s are up; the one behind it just came
        b.add(old)
        b.add(new)
        free["ok"] = True
        b.capacity_freed()
        assert [len(x.requests) for x in batches] == [2]  # due by the first request's deadline
        for psgs in (60.0, 60.0):  # the first fills half the bound, the second passes it: the first goes
            req = make_request(1, loop)
            req.psgs = psgs
            b.add(req)
        assert len(batches) == 2 and len(b) == 1  # the second waits: only its own 60 is pending
        b.close()

    asyncio.run(run())


def test_a_policys_psgs_bound_applies_from_the_next_batch():
    async def run():
        b, batches, _ = gated_batcher(BatcherConfig(max_wait_s=10.0), free=True)
        b.limit_psgs(50.0)
        loop = asyncio.get_running_loop()
        for psgs in (30.0, 30.0):
            req = make_request(1, loop)
            req.psgs = psgs
            b.add(req)
        assert [[r.psgs for r in x.requests] for x in batches] == [[30.0]]
        b.close()

    asyncio.run(run())


def test_a_request_on_a_quiet_server_goes_at_once():
    """With quiet (the server's default), max_wait_s holds batches only while a batch is
    under way: a lone request on a quiet server is dispatched inside its add."""
    cfg = BatcherConfig(max_batch_seeds=100, max_wait_s=10.0)

    async def run():
        batches, idle = [], {"now": True}
        b = MicroBatcher(cfg, batches.append, lambda: True, lambda: idle["now"])
        loop = asyncio.get_running_loop()
        b.add(make_request(1, loop))
        assert [len(x.requests) for x in batches] == [1]  # not 10 s later
        idle["now"] = False  # a batch under way: requests wait to batch, as without quiet
        for _ in range(3):
            b.add(make_request(1, loop))
        assert len(batches) == 1 and len(b) == 3
        idle["now"] = True  # the batch ends: what waited goes as one batch
        b.capacity_freed()
        assert [len(x.requests) for x in batches] == [1, 3] and len(b) == 0
        b.close()

    asyncio.run(run())


def test_without_quiet_a_lone_request_waits_for_its_batch_to_fill():
    """--wait-when-idle: the engine passes no quiet, and a lone request waits max_wait_s."""
    cfg = BatcherConfig(max_batch_seeds=100, max_wait_s=10.0)

    async def run():
        batches = []
        b = MicroBatcher(cfg, batches.append, lambda: True, None)
        b.add(make_request(1, asyncio.get_running_loop()))
        assert batches == [] and len(b) == 1
        b.close()

    asyncio.run(run())
