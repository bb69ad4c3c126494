"""What a value of an ``opgate`` flag may be: argparse ``type=`` parsers with one-line errors.

Each says what it expected and what it got (``expected a number >= 1 or auto, got 'x'``);
:mod:`proxy.cli_env` names the ``OPGATE_*`` variable when the value came from one. The checks of
a listener, the Host guard and a Redis URL are the relay's and the store's own (imported when a
value is parsed, as ``serve``'s are only when that command runs).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from proxy.cpus import available_cpus

__all__ = ["LOG_LEVELS", "LOOPS", "RELAYS", "accept_hosts", "listen_address", "log_level",
           "loop_name", "non_negative", "positive_int", "positive_seconds", "redis_url",
           "relay_name", "seconds", "worker_count"]

LOOPS = ("auto", "asyncio", "uvloop")
RELAYS = ("fast", "aiohttp")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _whole_number(minimum: int, *, alternative: str = "") -> Callable[[str], int]:
    """A flag's parser of whole numbers >= ``minimum`` (naming ``alternative`` words in the
    error, e.g. ``auto``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a number >= {minimum}{alternative}, got {text!r}")
        return value

    return parse


non_negative = _whole_number(0)  # a rotation flag (--audit-log-maxsize …)
positive_int = _whole_number(1)  # --replicas
_worker_number = _whole_number(1, alternative=" or auto")


def worker_count(text: str) -> int:
    """``--workers``: a positive number, or ``auto`` for one per CPU the process may use
    (:func:`proxy.cpus.available_cpus`: a pod's CPU limit, not the node's count)."""
    if text.strip().lower() == "auto":
        return available_cpus()
    return _worker_number(text)


def _seconds(*, zero: bool) -> Callable[[str], float]:
    """A flag's parser of a finite number of seconds, 0 allowed (``zero``: it means none)
    or not."""
    bound = ">= 0" if zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {text!r}")
        return value

    return parse


seconds = _seconds(zero=True)  # a timeout flag where 0 means none
positive_seconds = _seconds(zero=False)  # --redis-timeout


def _parsed_by(parse: Callable[[str], object], text: str) -> str:
    """``text`` when ``parse`` (the relay's own reading of it) takes it; its ``ValueError`` is
    the flag's error."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def listen_address(text: str) -> str:
    """``--listen`` / ``--admin-listen``: ``HOST:PORT``, ``[V6]:PORT`` or ``unix:/path``."""
    from proxy.relay.listen import parse_listen

    return _parsed_by(parse_listen, text)


def accept_hosts(text: str) -> str:
    """``--accept-hosts``: comma-separated regular expressions that compile."""
    from proxy.relay.hostguard import parse_accept_hosts

    return _parsed_by(parse_accept_hosts, text)


def redis_url(text: str) -> str:
    """``--redis-url``: a URL of a scheme opgate knows, with a host and a numeric port."""
    from proxy.stores import redis_url_problem

    problem = redis_url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _redacted_url(text: str) -> str:
    """How an error shows a bad ``OPGATE_REDIS_URL`` (often from a Secret): no password."""
    from proxy.stores.base import redacted_url

    return redacted_url(text)


redis_url.redact = _redacted_url  # type: ignore[attr-defined]  # read by cli_env._env_aware


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A flag's parser of one of ``choices``, in any case."""
    def parse(text: str) -> str:
        name = text.strip().lower()
        if name not in choices:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(choices)}, got {text!r}")
        return name

    return parse


log_level = _choice(LOG_LEVELS)
loop_name = _choice(LOOPS)
relay_name = _choice(RELAYS)
