"""EagerFuture: eager callbacks run in the call that completes the future; the rest is a
plain asyncio future."""

import asyncio

import pytest

from hybridgnn.serving.core.eager import EagerFuture, Later, together, when_done


def _run(coro):
    return asyncio.run(coro)


def test_eager_callbacks_run_inside_set_result_in_order():
    async def go():
        fut = EagerFuture()
        seen = []
        fut.add_eager_callback(lambda f: seen.append(("a", f.result())))
        fut.add_eager_callback(lambda f: seen.append(("b", f.result())))
        fut.set_result(7)
        assert seen == [("a", 7), ("b", 7)]  # before set_result returned, no pass of the loop
        fut.add_eager_callback(lambda f: seen.append(("late", f.result())))  # already done: at once
        assert seen[-1] == ("late", 7)
        assert await fut == 7
    _run(go())


@pytest.mark.parametrize("complete", ["exception", "cancel"])
def test_eager_callbacks_run_on_exception_and_cancel(complete):
    async def go():
        fut = EagerFuture()
        seen = []
        fut.add_eager_callback(lambda f: seen.append(f.cancelled() or type(f.exception()).__name__))
        if complete == "exception":
            fut.set_exception(KeyError("x"))
        else:
            assert fut.cancel()
            assert not fut.cancel()  # a second cancel runs nothing again
        assert seen == (["KeyError"] if complete == "exception" else [True])
        with pytest.raises((KeyError, asyncio.CancelledError)):
            await fut
    _run(go())


def test_a_failing_eager_callback_is_reported_and_the_rest_still_run():
    async def go():
        loop = asyncio.get_running_loop()
        reported = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["exception"]))
        fut = EagerFuture()
        seen = []
        fut.add_eager_callback(lambda f: 1 / 0)
        fut.add_eager_callback(lambda f: seen.append(f.result()))
        fut.set_result("ok")  # does not raise into the caller
        assert seen == ["ok"] and isinstance(reported[0], ZeroDivisionError)
    _run(go())


def test_ordinary_done_callbacks_still_wait_for_the_loop():
    async def go():
        fut = EagerFuture()
        seen = []
        fut.add_done_callback(lambda f: seen.append("done"))
        fut.set_result(1)
        assert seen == []
        await asyncio.sleep(0)
        assert seen == ["done"]
    _run(go())


def test_when_done_is_eager_only_for_an_eager_future():
    async def go():
        plain, eager = asyncio.get_running_loop().create_future(), EagerFuture()
        seen = []
        when_done(plain, lambda f: seen.append("plain"))
        when_done(eager, lambda f: seen.append("eager"))
        plain.set_result(None)
        eager.set_result(None)
        assert seen == ["eager"]
        await asyncio.sleep(0)
        assert seen == ["eager", "plain"]
    _run(go())


def test_later_hands_its_value_over_in_the_call_that_sets_it_and_can_be_awaited():
    async def go():
        later, seen = Later(), []
        when_done(later, lambda v: seen.append(("a", v.result())))
        later.add_eager_callback(lambda v: 1 / 0)  # reported to the loop, the rest still run
        later.add_eager_callback(lambda v: seen.append(("b", v.result())))
        waiter = asyncio.ensure_future(_await(later))
        await asyncio.sleep(0)
        reported = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx["exception"]))
        assert not later.done() and not later.cancelled() and later.exception() is None
        with pytest.raises(asyncio.InvalidStateError):
            later.result()
        later.set_result(5)
        assert seen == [("a", 5), ("b", 5)] and [type(e) for e in reported] == [ZeroDivisionError]
        assert await waiter == 5 and await later == 5  # awaited before and after it was set
        later.add_eager_callback(lambda v: seen.append(("late", v.result())))
        assert seen[-1] == ("late", 5)
        with pytest.raises(asyncio.InvalidStateError):
            later.set_result(6)
    _run(go())


async def _await(awaitable):
    return await awaitable


def test_answers_made_together_leave_together_in_order():
    """Inside a together() block a Later's callbacks wait; they run, in the order their
    values were set, when the outermost block ends (a failing one is reported, the rest run)."""
    async def go():
        reported, seen = [], []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx["exception"]))
        a, b, c = Later(), Later(), Later()
        for name, later in (("a", a), ("b", b), ("c", c)):
            later.add_eager_callback(lambda v, name=name: seen.append((name, v.result())))
        b.add_eager_callback(lambda v: 1 / 0)
        with together():
            b.set_result(2)
            with together():
                a.set_result(1)
            assert seen == [] and a.done() and b.done()  # the inner block's end runs nothing
            c.set_result(3)
        assert seen == [("b", 2), ("a", 1), ("c", 3)] and [type(e) for e in reported] == [ZeroDivisionError]
        d = Later()
        d.add_eager_callback(lambda v: seen.append(("d", v.result())))
        d.set_result(4)  # outside a block: at once
        assert seen[-1] == ("d", 4)
    _run(go())


def test_in_turns_takes_one_step_per_turn_of_the_loop_and_always_sets_its_later():
    """Between two steps the loop runs what became ready (a callback added meanwhile goes
    before the next step); on_error's value when a step or on_done raises."""
    from hybridgnn.serving.core.eager import in_turns

    async def main():
        order = []

        def steps():
            for i in range(3):
                order.append(f"step {i}")
                asyncio.get_running_loop().call_soon(order.append, f"ready after step {i}")
                yield
            return 41

        later = in_turns(steps(), lambda v: v + 1, lambda exc: f"failed: {exc}")
        assert not later.done()
        assert await later == 42

        def failing():
            yield
            raise ValueError("bad step")

        assert await in_turns(failing(), lambda v: v, lambda exc: f"failed: {exc}") == "failed: bad step"
        none = in_turns(iter(()), lambda v: v + 1, lambda exc: type(exc).__name__)  # on_done raises
        assert await none == "TypeError"
        return order

    assert asyncio.run(main()) == ["step 0", "ready after step 0", "step 1", "ready after step 1", "step 2",
                                   "ready after step 2"]
