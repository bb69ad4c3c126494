"""The list+watch loop's retry pace (proxy.relay.listwatch.ListWatch.run), without a server:
``path()`` fails as discovery does, and the loop's sleeps are recorded instead of slept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.relay import listwatch
from proxy.relay.listwatch import Absent, Failed, ListWatch


class _Done(Exception):
    """Ends the loop once enough sleeps are recorded."""


def _delays(monkeypatch: pytest.MonkeyPatch, failure: Exception, tries: int) -> list[float]:
    """The delays ``run`` sleeps between ``tries`` calls of a ``path()`` failing with
    ``failure``."""
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        if len(slept) >= tries:
            raise _Done

    async def path() -> str:
        raise failure

    monkeypatch.setattr(listwatch.asyncio, "sleep", sleep)
    loop = ListWatch(Any, Any, connect_timeout=1, user_agent="test", max_backoff=60.0)  # type: ignore[arg-type]
    with pytest.raises(_Done):
        asyncio.run(loop.run("test", path, replace=lambda items: None,
                             event=lambda kind, obj: None))
    return slept


def test_a_resource_not_served_yet_is_looked_for_again_every_few_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CRD installed after opgate started (an operator installing its own, a helm install
    racing the pod) is found within NOT_SERVED_RETRY seconds, however long it was missing: it
    was looked for again after a backoff doubling to 60 s, so the quota of its resource
    answered 503 for up to a minute after the CRD was served."""
    slept = _delays(monkeypatch, Absent("HTTP 404 for /apis/x.example.com"), tries=12)
    assert max(slept) <= listwatch.NOT_SERVED_RETRY <= 5.0
    assert slept[0] < slept[3]  # still a backoff at first


def test_other_failures_back_off_to_the_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _delays(monkeypatch, Failed("HTTP 500 for /apis"), tries=12)
    assert max(slept) > 30.0 and all(d <= 60.0 for d in slept)
