"""The relay: the only part of opgate that touches sockets and bodies.

It accepts API calls (:func:`serve_api`), runs them through the middleware chain and streams
them to and from the apiserver (:class:`FastRelay`, asyncio protocols + httptools, the default;
:class:`Relay`, aiohttp's client and server), tunnels upgrades, and keeps header hygiene. The
engine and the middlewares never import it; the CLI wires it up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.relay.calls import PolicyStoreLike, RelaySettings
from proxy.relay.fast import FastRelay
from proxy.relay.listen import Listener, serve_api
from proxy.relay.upstream import UpstreamConfig, UpstreamConfigError, resolve_upstream

if TYPE_CHECKING:
    from proxy.relay.handler import Relay


def relay_core(name: str) -> type[FastRelay] | type[Relay]:
    """The relay class ``--relay`` names; the aiohttp core is imported only when asked for."""
    if name == "fast":
        return FastRelay
    from proxy.relay.handler import Relay

    return Relay


def __getattr__(name: str) -> Any:
    """``Relay`` (the aiohttp core) is imported on first use: the default core needs no aiohttp."""
    if name == "Relay":
        from proxy.relay.handler import Relay

        return Relay
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FastRelay",
    "Listener",
    "PolicyStoreLike",
    "Relay",
    "RelaySettings",
    "UpstreamConfig",
    "UpstreamConfigError",
    "relay_core",
    "resolve_upstream",
    "serve_api",
]
