"""LazyTimer (proxy/relay/lazytimer.py), on real event loops (asyncio and uvloop).

The loop is wrapped to count the loop timers armed and to keep their handles: the point of the
primitive is how few it arms, and that the one it leaves armed is really cancelled on close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest

from proxy.relay.lazytimer import LazyTimer

uvloop = pytest.importorskip("uvloop")

LOOPS = ["asyncio", "uvloop"]


def run(kind: str, coro: Coroutine[Any, Any, None]) -> None:
    if kind == "uvloop":
        uvloop.run(coro)
    else:
        asyncio.run(coro)


class CountingLoop:
    """The running loop, with every ``call_at`` counted and its handle kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.handles: list[asyncio.TimerHandle] = []

    def time(self) -> float:
        return self.loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        handle = self.loop.call_at(when, callback)
        self.handles.append(handle)
        return handle

    @property
    def arms(self) -> int:
        return len(self.handles)


def make_timer() -> tuple[LazyTimer, CountingLoop, list[float]]:
    counting = CountingLoop(asyncio.get_running_loop())
    fired: list[float] = []
    timer = LazyTimer(cast(asyncio.AbstractEventLoop, counting),
                      lambda: fired.append(counting.time()))
    return timer, counting, fired


@pytest.mark.parametrize("kind", LOOPS)
def test_fires_once_at_the_deadline_then_forgets_it(kind: str) -> None:
    async def main() -> None:
        timer, loop, fired = make_timer()
        due = loop.time() + 0.05
        timer.set(due)
        assert timer.due == due and timer.armed
        await asyncio.sleep(0.2)
        assert len(fired) == 1 and fired[0] >= due - 0.002
        assert timer.due is None and not timer.armed
        assert loop.arms == 1

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_deadline_moved_later_arms_nothing_then_rearms_for_it_when_the_first_fires(
    kind: str,
) -> None:
    async def main() -> None:
        timer, loop, fired = make_timer()
        start = loop.time()
        timer.set(start + 0.05)
        for step in range(1, 101):  # many calls in a row, each moving the deadline later
            timer.clear()
            timer.set(start + 0.05 + step * 0.002)
        assert loop.arms == 1  # no loop timer per move
        await asyncio.sleep(0.1)
        assert fired == []  # the first loop timer fired early: it re-armed for the deadline
        assert loop.arms == 2 and timer.armed
        await asyncio.sleep(0.25)
        assert len(fired) == 1 and fired[0] >= start + 0.25 - 0.002
        assert loop.arms == 2

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_cleared_it_does_nothing_when_the_loop_timer_fires_and_does_not_rearm(kind: str) -> None:
    async def main() -> None:
        timer, loop, fired = make_timer()
        timer.set(loop.time() + 0.05)
        timer.clear()
        assert timer.due is None and timer.armed  # clear() cancels nothing
        await asyncio.sleep(0.15)
        assert fired == [] and not timer.armed and loop.arms == 1
        timer.set(loop.time() + 0.03)  # and it arms again when needed
        await asyncio.sleep(0.1)
        assert len(fired) == 1 and loop.arms == 2

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_deadline_set_earlier_than_the_armed_one_rearms_earlier(kind: str) -> None:
    async def main() -> None:
        timer, loop, fired = make_timer()
        timer.set(loop.time() + 30)
        first = loop.handles[0]
        due = loop.time() + 0.05
        timer.set(due)
        assert loop.arms == 2 and first.cancelled()  # not two loop timers armed
        await asyncio.sleep(0.2)
        assert len(fired) == 1 and fired[0] >= due - 0.002

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_close_cancels_the_armed_loop_timer(kind: str) -> None:
    async def main() -> None:
        timer, loop, fired = make_timer()
        timer.set(loop.time() + 0.05)
        timer.close()
        assert loop.handles[0].cancelled() and not timer.armed and timer.due is None
        await asyncio.sleep(0.15)
        assert fired == [] and loop.arms == 1

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_the_callback_may_set_the_next_deadline(kind: str) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []

        def again() -> None:
            fired.append(loop.time())
            if len(fired) < 3:
                timer.set(loop.time() + 0.02)

        timer = LazyTimer(loop, again)
        timer.set(loop.time() + 0.02)
        await asyncio.sleep(0.3)
        assert len(fired) == 3 and not timer.armed

    run(kind, main())
