"""Warnings that every call may meet (an upstream down, a flood of bad tokens): one line per
``LOG_EVERY`` seconds and kind, not one per call; the next line says how many were left out."""

from __future__ import annotations

import logging
import time

__all__ = ["LOG_EVERY", "log_limited"]

LOG_EVERY = 5.0  # seconds between two log lines of the same kind
_last_logged: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def log_limited(logger: logging.Logger, kind: str, message: str, *args: object) -> None:
    """``logger.warning(message, *args)``, unless a line of ``kind`` went out less than
    ``LOG_EVERY`` seconds ago (then it is counted, and the next one says so)."""
    now = time.monotonic()
    if now - _last_logged.get(kind, -LOG_EVERY) < LOG_EVERY:
        _suppressed[kind] = _suppressed.get(kind, 0) + 1
        return
    _last_logged[kind] = now
    more = _suppressed.pop(kind, 0)
    if more:
        message += " (and %d more like it)"
        args = (*args, more)
    logger.warning(message, *args)
