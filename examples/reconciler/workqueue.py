"""A work queue of object keys with per-key deduplication, as client-go's ``workqueue`` does it.

Watch events arrive far faster than reconciles finish; the queue collapses them so that

* a key waits in the queue at most once, however many events name it ("dirty" set);
* a key is never processed by two workers at once: one added while it is being processed is
  queued again only when that worker calls :meth:`WorkQueue.done`;
* a key that keeps failing is retried after a growing, per-key delay (:meth:`failure_delay`),
  reset by :meth:`forget` after a success.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from .retry import backoff_delay


class ShutDown(Exception):
    """The queue was shut down: a worker should return."""


class WorkQueue:
    def __init__(
        self,
        *,
        base_delay: float = 0.05,
        max_delay: float = 30.0,
        rand: Callable[[], float] | None = None,
    ) -> None:
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._failures: dict[str, int] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._rand = rand

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def processing(self) -> frozenset[str]:
        return frozenset(self._processing)

    def add(self, key: str) -> None:
        """Mark ``key`` as needing a reconcile; a no-op when it is already waiting."""
        if self._closed or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._wakeup.set()

    def add_after(self, key: str, delay: float) -> None:
        """Add ``key`` after ``delay`` seconds (needs a running event loop)."""
        if self._closed:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            if handle is not None:
                self._timers.discard(handle)
            self.add(key)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def get_nowait(self) -> str | None:
        """The next key to process, or ``None`` when none is waiting."""
        if self._closed:
            raise ShutDown
        if not self._queue:
            self._wakeup.clear()
            return None
        key = self._queue.popleft()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    async def get(self) -> str:
        """Wait for the next key; raises :class:`ShutDown` once the queue is shut down."""
        while True:
            key = self.get_nowait()
            if key is not None:
                return key
            await self._wakeup.wait()

    def done(self, key: str) -> None:
        """The worker is finished with ``key``; re-queue it if it was added meanwhile."""
        self._processing.discard(key)
        if key in self._dirty and not self._closed:
            self._queue.append(key)
            self._wakeup.set()

    def failure_delay(self, key: str) -> float:
        """Count a failure of ``key`` and return how long to wait before retrying it."""
        count = self._failures.get(key, 0)
        self._failures[key] = count + 1
        if self._rand is None:
            return backoff_delay(count, base=self._base_delay, cap=self._max_delay)
        return backoff_delay(count, base=self._base_delay, cap=self._max_delay, rand=self._rand)

    def failures(self, key: str) -> int:
        return self._failures.get(key, 0)

    def forget(self, key: str) -> None:
        """``key`` succeeded: its next failure starts the backoff from the beginning."""
        self._failures.pop(key, None)

    def shutdown(self) -> None:
        """Wake every waiting worker with :class:`ShutDown`; pending timers are dropped."""
        self._closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        self._wakeup.set()
