"""``cancel_and_wait`` ends a task even when the task loses a cancellation: Python 3.11's
``asyncio.wait_for`` returns a result that arrived in the same loop iteration as the cancel
and drops the cancel (gh-86296), which is how a discovery heartbeat (a NATS request inside
``wait_for``) kept beating and its lease's close waited forever."""

from __future__ import annotations

import asyncio

import pytest

from services.common.service import cancel_all_and_wait, cancel_and_wait

pytestmark = pytest.mark.asyncio


async def test_a_cancel_lost_inside_wait_for_still_ends_the_task() -> None:
    reply = asyncio.get_running_loop().create_future()
    beats: list[int] = []

    async def heartbeat() -> None:
        while True:
            beats.append(await asyncio.wait_for(reply if not beats else asyncio.sleep(3600, 2), 10))

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)  # it waits for the first reply
    reply.set_result(1)  # the reply and the cancel land in the same iteration
    async with asyncio.timeout(20):
        await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_task_that_swallows_cancels_is_cancelled_again_until_it_ends() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed < 2:
                    swallowed += 1
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(20):
        await cancel_and_wait(task)
    assert task.cancelled() and swallowed == 2


async def test_a_task_that_failed_raises_its_error() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)


async def test_cancel_all_ends_every_task_even_one_that_loses_its_cancel() -> None:
    reply = asyncio.get_running_loop().create_future()

    async def beats() -> None:
        while True:
            await asyncio.wait_for(reply if not reply.done() else asyncio.sleep(3600), 10)

    async def fails() -> None:
        raise ValueError("boom")  # reported by its own task, not raised here

    tasks = [asyncio.create_task(beats()), asyncio.create_task(asyncio.sleep(3600)),
             asyncio.create_task(fails())]
    await asyncio.sleep(0)
    reply.set_result(None)
    async with asyncio.timeout(20):
        await cancel_all_and_wait(tasks)
    assert all(t.done() for t in tasks) and tasks[0].cancelled() and tasks[1].cancelled()
    assert isinstance(tasks[2].exception(), ValueError)
