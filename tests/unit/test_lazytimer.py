"""LazyTimer (proxy/relay/lazytimer.py), on real event loops (asyncio and uvloop), and how the
fast relay's exchanges share their upstream connection's timer (proxy/relay/fast/exchange.py).

The loop is wrapped to count the loop timers armed and to keep their handles: the point of the
primitive is how few it arms, and that the one it leaves armed is really cancelled on close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, cast

import pytest

from proxy.relay.fast.exchange import Exchange
from proxy.relay.fast.server import ClientConnection
from proxy.relay.fast.upstream import UpstreamConnection, UpstreamPool
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


# --- the fast relay's exchanges on one connection's timer -------------------------------


def lend(conn: UpstreamConnection, *, head: float) -> Exchange:
    """An exchange sent on ``conn`` with a head deadline (no bytes go anywhere)."""
    client = cast(ClientConnection, SimpleNamespace(loop=asyncio.get_running_loop()))
    exchange = Exchange(client, extra=(), defer_head=True, head_only=False, http11=True,
                        keep_alive=True)
    conn.exchange = exchange
    exchange.limits(conn, head=head, total=300.0)
    return exchange


def give_back(conn: UpstreamConnection) -> None:
    """What a complete response does to the connection (``on_message_complete``)."""
    conn.exchange = None
    conn.timer.clear()


def connection() -> UpstreamConnection:
    pool = UpstreamPool(host="127.0.0.1", port=1, tls=None, server_hostname=None,
                        connect_timeout=1.0)
    return UpstreamConnection(pool, asyncio.get_running_loop())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_finished_exchange_cannot_forget_the_next_calls_deadline(kind: str) -> None:
    async def main() -> None:
        conn = connection()
        first = lend(conn, head=30.0)
        give_back(conn)  # its response is complete; the task awaiting it has not run yet
        second = lend(conn, head=0.05)  # meanwhile another call got the connection
        first.cancel_timer()  # the first call's task ends: not its deadline to forget
        with pytest.raises(TimeoutError, match="no response head in time"):
            await asyncio.wait_for(second.head, 2)
        assert second.expired and not first.expired and not first.head.done()
        conn.close()

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_given_back_connection_ticks_no_exchange_and_its_timer_stops(kind: str) -> None:
    async def main() -> None:
        conn = connection()
        finished = lend(conn, head=0.03)
        give_back(conn)
        assert conn.timer.armed  # left armed (cheap), it fires once and stops
        await asyncio.sleep(0.15)
        assert not finished.head.done() and not finished.expired
        assert not conn.timer.armed

    run(kind, main())


@pytest.mark.parametrize("kind", LOOPS)
def test_closing_the_connection_cancels_its_timer(kind: str) -> None:
    async def main() -> None:
        conn = connection()
        exchange = lend(conn, head=0.03)
        assert conn.timer.armed
        conn.close()
        assert not conn.timer.armed and conn.timer.due is None
        await asyncio.sleep(0.1)
        assert not exchange.head.done()

    run(kind, main())
