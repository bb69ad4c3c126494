"""Rate-limit storage: a small protocol (:mod:`.base`) and its backends.

``build_store`` is what the CLI calls: with no Redis URL, in-process GCRA buckets (one replica's
view); with one, GCRA in Redis behind token leasing (:mod:`.lease`, used by rules with
``lease: true`` or by every rule with ``lease=True``) and a circuit breaker with an in-process
fallback (:mod:`.breaker`). The Redis password comes from the URL, else ``password``, else the
file named by ``password_file`` / ``$OPGATE_REDIS_PASSWORD_FILE`` (a mounted Secret), else
``$OPGATE_REDIS_PASSWORD``.
"""

from __future__ import annotations

import os
from pathlib import Path

from proxy.stores.base import BucketRequest, KeyVerdict, Store, StoreUnavailable, Verdict
from proxy.stores.memory import MemoryStore

__all__ = [
    "BucketRequest",
    "KeyVerdict",
    "MemoryStore",
    "Store",
    "StoreUnavailable",
    "Verdict",
    "build_store",
    "redis_password",
]


def redis_password(password: str | None = None, password_file: str | None = None) -> str | None:
    """The password to use when the URL has none (explicit, then file, then environment)."""
    if password:
        return password
    path = password_file or os.environ.get("OPGATE_REDIS_PASSWORD_FILE")
    if path:
        return Path(path).read_text("utf-8").strip() or None
    return os.environ.get("OPGATE_REDIS_PASSWORD") or None


def build_store(
    *,
    redis_url: str | None,
    password: str | None = None,
    password_file: str | None = None,
    timeout: float = 0.05,
    replicas: int = 1,
    lease: bool = False,
    breaker_failures: int = 3,
    breaker_reset: float = 1.0,
    prefix: str = "opgate:rl:",
) -> Store:
    """The store the rate-limit middleware decides with (see the module docstring).

    ``replicas`` is the number of opgate replicas sharing the limits: while Redis is down each
    one runs ``failure: open`` rules at ``qps / replicas``. Redis is not contacted here; the
    first decision connects (and the breaker copes if it cannot).
    """
    from proxy.stores.breaker import ResilientStore, set_backend_gauge

    if not redis_url:
        set_backend_gauge("local")
        return MemoryStore()
    from proxy.stores.lease import LeasingStore
    from proxy.stores.redis import RedisStore

    shared = RedisStore.from_url(
        redis_url, password=redis_password(password, password_file), timeout=timeout,
        prefix=prefix,
    )
    leased = LeasingStore(shared, replicas=replicas, lease_all=lease)
    return ResilientStore(leased, replicas=replicas, failures=breaker_failures,
                          reset_after=breaker_reset)
