"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration import fakes


@pytest.fixture(params=fakes.RELAYS)
def each_relay(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once per relay core: ``running_proxy`` then builds that relay."""
    kind: str = request.param
    saved, fakes.default_relay = fakes.default_relay, kind
    try:
        yield kind
    finally:
        fakes.default_relay = saved
