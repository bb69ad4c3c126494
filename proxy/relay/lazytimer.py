"""A deadline that is cheap to move: :class:`LazyTimer`.

Arming and cancelling an event-loop timer costs a few microseconds (``call_at`` then
``cancel``: ~3.5 µs under uvloop), which is a noticeable share of a relayed call when it is
done once per call. Yet nearly every call ends long before its deadline. A :class:`LazyTimer`
keeps the wanted deadline in an attribute and arms a real loop timer only when the armed one
(if any) would fire too late: moving the deadline later, or forgetting it, touches no loop
timer. When the loop timer fires, it looks at the deadline of that moment: none, and it
stops; a later one, and it re-arms for it; otherwise the callback runs. So an owner that sets
and clears a deadline of ``T`` seconds for many short calls in a row arms about one loop
timer per ``T`` seconds, not one per call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LazyTimer"]

CLOCK_RESOLUTION = 0.001  # seconds: libuv's timer granularity


class LazyTimer:
    """Calls ``callback`` once the deadline given to :meth:`set` has passed.

    Times are the loop's (``loop.time()``). The deadline is one-shot: it is forgotten just
    before ``callback`` runs, so the callback may :meth:`set` a new one.
    """

    __slots__ = ("_armed_at", "_callback", "_due", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._due: float | None = None  # the deadline wanted now (None: none)
        self._handle: asyncio.TimerHandle | None = None  # the loop timer armed, if any
        self._armed_at = 0.0  # when that loop timer fires

    @property
    def due(self) -> float | None:
        """The deadline set (loop time), or ``None``."""
        return self._due

    @property
    def armed(self) -> bool:
        """Whether a loop timer is armed (for tests: a cleared deadline may leave one)."""
        return self._handle is not None

    def set(self, due: float) -> None:
        """Run the callback at ``due`` (loop time), instead of any earlier-set deadline.

        A loop timer is armed only if none is, or if the armed one fires after ``due``."""
        self._due = due
        handle = self._handle
        if handle is None or due < self._armed_at:
            if handle is not None:
                handle.cancel()
            self._armed_at = due
            self._handle = self._loop.call_at(due, self._fire)

    def clear(self) -> None:
        """Forget the deadline. Cheap: an armed loop timer stays and, when it fires, stops."""
        self._due = None

    def close(self) -> None:
        """Forget the deadline and cancel the armed loop timer (its owner is gone)."""
        self._due = None
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()

    def _fire(self) -> None:
        self._handle = None
        due = self._due
        if due is None:  # cleared meanwhile: stop until the next set()
            return
        # moved later meanwhile: wait for it. Within a clock tick of the deadline counts as
        # passed, as asyncio's own timers do: uvloop fires up to ~1 ms early (libuv counts
        # whole milliseconds), and re-arming then would spin until the deadline.
        if due > self._loop.time() + CLOCK_RESOLUTION:
            self._armed_at = due
            self._handle = self._loop.call_at(due, self._fire)
            return
        self._due = None
        self._callback()
