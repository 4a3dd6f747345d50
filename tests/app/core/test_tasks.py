"""app.core.tasks: waiting on work that cannot be taken back through the caller's cancellations, which must still
end the caller once the work is done."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.core.tasks import outlast, to_thread_to_the_end


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.parametrize("cancels", [0, 1, 3])
def test_outlast_waits_through_every_cancellation_and_says_whether_there_was_one(cancels):
    async def main():
        work = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(outlast(work))
        for _ in range(cancels):
            await _settle()
            waiter.cancel()
        await _settle()
        assert not waiter.done(), "outlast returned before the work was done"
        work.set_exception(RuntimeError("the work's own error"))
        assert await waiter is (cancels > 0)
        assert not work.cancelled(), "the caller's cancellation reached the work"
        with pytest.raises(RuntimeError, match="own error"):
            work.result()  # left for the caller to read

    asyncio.run(main())


@pytest.mark.parametrize("cancels", [1, 2])
def test_a_thread_cancelled_meanwhile_is_seen_to_its_end_then_the_cancellation_goes_on(cancels):
    gate, done = threading.Event(), []

    def step():
        assert gate.wait(10)
        done.append(1)
        return "finished"

    async def main():
        task = asyncio.ensure_future(to_thread_to_the_end(step))
        for _ in range(cancels):
            await _settle()
            task.cancel()
        await _settle()
        assert not task.done() and not done
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done == [1]

    asyncio.run(main())


def test_a_thread_left_alone_returns_its_result_or_raises_its_error():
    async def main():
        assert await to_thread_to_the_end(lambda: "finished") == "finished"
        with pytest.raises(ZeroDivisionError):
            await to_thread_to_the_end(lambda: 1 / 0)

    asyncio.run(main())
