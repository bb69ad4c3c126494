"""Where the audit log's lines go: a writer thread, so that writing never blocks a call.

:class:`~proxy.middlewares.audit.Audit` hands each event's line to an
:class:`~proxy.middlewares.accesslog.AccessWriter` (batched, as the access log); for a file, its
batches go to a writer thread through :class:`QueuedStream`, which drops whole batches (counted
in ``opgate_audit_dropped_total``) rather than hold more than ``MAX_PENDING_BYTES``.
:class:`~proxy.engine.logfile.RotatingFile` rotates by size as the apiserver's
``--audit-log-maxsize`` / ``--audit-log-maxbackup`` do (backups named
``audit-2006-01-02T15-04-05.000.log``, UTC).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

from proxy.engine import telemetry
from proxy.engine.logfile import BackgroundWriter, RotatingFile

__all__ = ["MAX_PENDING_BYTES", "QueuedStream"]

MAX_PENDING_BYTES = 8 * 1024 * 1024  # events waiting for the writer thread, at most


class QueuedStream:
    """A stream for :class:`~proxy.middlewares.accesslog.AccessWriter` whose ``write`` never
    blocks: batches go to a writer thread; past ``max_pending`` bytes waiting, a batch is dropped
    and its lines counted in ``opgate_audit_dropped_total`` (as are lines a failed write lost)."""

    def __init__(self, target: RotatingFile | IO[str], *,
                 max_pending: int = MAX_PENDING_BYTES) -> None:
        self._target = target
        self._writer: BackgroundWriter[str] = BackgroundWriter(
            self._write_batch, name="opgate-audit-writer", max_pending=max_pending,
            dropped=lambda data: telemetry.AUDIT_DROPPED.inc(data.count("\n")))

    def write(self, data: str) -> None:
        self._writer.put(data, len(data))

    def flush(self) -> None:
        """Nothing: the writer thread flushes after each batch."""

    def _write_batch(self, batch: Sequence[str]) -> None:
        data = "".join(batch)
        try:
            self._target.write(data)
            self._target.flush()
        except (OSError, ValueError) as exc:
            telemetry.AUDIT_DROPPED.inc(data.count("\n"))
            self._writer.complain("cannot write the audit log: %s (events dropped)", exc)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (``timeout`` at most), then close the target."""
        if self._writer.close(timeout):
            close = getattr(self._target, "close", None)
            if close is not None:
                close()
