"""Which ``Host`` names the API listener answers: the guard against DNS rebinding.

opgate relays a call that carries no token with its own credentials (``--token-file``, the
pod's token, the kubeconfig's user), as ``kubectl proxy`` does. A web page can make a browser
call ``http://evil.example:8001/...`` after pointing ``evil.example`` at 127.0.0.1: the call
reaches opgate's loopback port, with ``Host: evil.example:8001``, and the page reads the answer
as its own origin's. So, as ``kubectl proxy --accept-hosts`` does (with the same default), a
call whose ``Host`` name (without its port) matches none of ``--accept-hosts`` is refused
``403`` and nothing is relayed. A request without ``Host`` (HTTP/1.0: no browser sends one) and
a Unix-socket listener (no browser reaches one) are not checked. The refusal is one of opgate's
own answers, recorded as the others are (a ``denied`` call in the metrics, the access and the
audit logs, with its ``Audit-Id``), so an attempt shows; no entry hook runs for it.

A controller sends the same ``Host`` value on every call, so each distinct value is matched
once and remembered (up to ``MEMO`` of them): a call costs one dict lookup.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.engine.status import StatusError

__all__ = ["DEFAULT_ACCEPT_HOSTS", "HostGuard", "parse_accept_hosts"]

# kubectl proxy's --accept-hosts default
DEFAULT_ACCEPT_HOSTS = r"^localhost$,^127\.0\.0\.1$,^\[::1\]$"
MEMO = 256


def parse_accept_hosts(text: str) -> tuple[str, ...]:
    """``--accept-hosts``: comma-separated regular expressions (``ValueError`` for one that does
    not compile, or for none at all)."""
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise ValueError("no pattern given (use '.*' to accept any Host)")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
    return patterns


def host_name(value: str) -> str:
    """The name of a ``Host`` value, without its port: ``localhost``, ``127.0.0.1``, ``[::1]``."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal keeps its brackets, as the default names it
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    name, _, _ = value.partition(":")
    return name


class HostGuard:
    """``accepts(value)``: whether a ``Host`` value (bytes as received) names an accepted host.
    ``refusal(value)`` is the Status for one that does not."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        self._compiled = tuple(re.compile(p) for p in self.patterns)
        self._memo: dict[bytes, bool] = {}

    def accepts(self, value: bytes) -> bool:
        known = self._memo.get(value)
        if known is not None:
            return known
        name = host_name(value.decode("latin-1"))
        ok = any(p.search(name) for p in self._compiled)
        if len(self._memo) < MEMO:
            self._memo[value] = ok
        return ok

    @staticmethod
    def refusal(value: bytes) -> StatusError:
        # (the value holds only the bytes a host and port may hold: malformed_host came first)
        name = host_name(value.decode("latin-1"))
        return StatusError(403, f'opgate: Host "{name}" is not accepted here (--accept-hosts: a '
                                "guard against DNS rebinding)", "Forbidden")
