"""When to call the apiserver again: ``Retry-After`` parsing, backoff with jitter, retry policy.

Pure functions, kept apart from the transport so the unit tests can pin them down with tables.
Two policies:

* one call (:func:`resend_delay`, used by ``kube.py``), as client-go's ``rest.Request``: sent
  again, whatever its verb, when the answer is a ``429`` or a ``5xx`` that carries
  ``Retry-After`` (the server did not do it and says when to come back); a ``GET`` also after
  its connection was reset or closed under it. Nothing else: a write whose connection went may
  have been applied (a create with ``generateName`` would make a second object), and a ``5xx``
  without ``Retry-After`` may have done the work; the caller's own backoff decides.
* a list/watch loop (:func:`retry_delay`, used by the informers): every failure is retried, after
  ``Retry-After`` when given, else after an exponential backoff with jitter, so that many
  workers do not hammer a recovering apiserver in lockstep.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# A server may ask for any delay; a controller that sleeps for an hour on a typo looks dead.
MAX_RETRY_AFTER = 60.0
BASE_DELAY = 0.2
MAX_DELAY = 30.0

# Status codes a list/watch is tried again for (``0`` stands for "no response at all").
RETRYABLE = frozenset({0, 429, 500, 502, 503, 504})
# client-go's fixed wait before sending a GET again after a reset connection.
CONNECTION_RETRY_DELAY = 1.0


def parse_retry_after(
    value: str | None, *, now: Callable[[], datetime] | None = None
) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP-date (RFC 9110).

    ``None`` when absent or unparseable; never negative; capped at :data:`MAX_RETRY_AFTER`.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        return min(float(int(text)), MAX_RETRY_AFTER)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    current = now() if now is not None else datetime.now(UTC)
    seconds = (when - current).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def backoff_delay(
    attempt: int,
    *,
    base: float = BASE_DELAY,
    cap: float = MAX_DELAY,
    rand: Callable[[], float] = random.random,
) -> float:
    """Exponential backoff with "equal jitter": half of ``min(cap, base * 2**attempt)`` fixed,
    the other half random, so a delay never collapses to zero yet retries spread out.
    """
    ceiling = min(cap, base * (2.0 ** max(attempt, 0)))
    return ceiling / 2 + rand() * ceiling / 2


def retry_delay(
    code: int,
    *,
    attempt: int,
    retry_after: float | None,
    rand: Callable[[], float] = random.random,
) -> float | None:
    """How long to wait before sending a failed request again, or ``None`` not to retry.

    ``code`` is the HTTP status (``0`` for a connection error). A server's ``Retry-After`` wins
    over the local backoff; 409 is not retried here: a conflict needs a fresh read first.
    """
    if code not in RETRYABLE:
        return None
    if retry_after is not None:
        return retry_after
    return backoff_delay(attempt, rand=rand)



def resend_delay(
    method: str,
    code: int,
    *,
    retry_after: float | None,
    reset: bool,
    reset_delay: float = CONNECTION_RETRY_DELAY,
) -> float | None:
    """How long to wait before sending one call again, or ``None`` not to: client-go's rule.

    ``code`` is the HTTP status, ``0`` when no answer came; ``reset`` says that the connection
    was reset or closed after the request went out (not a refused connection, not a timeout).
    """
    if code == 0:
        return reset_delay if reset and method.upper() == "GET" else None
    if (code == 429 or code >= 500) and retry_after is not None:
        return retry_after
    return None
