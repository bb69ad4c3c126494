"""A long length-framed body moved from the upstream's socket to the client's inside the kernel.

When neither side speaks TLS (there is nothing to decrypt or encrypt) and nobody looks at the
body (no capture), the rest of a body of at least ``LONG_BODY`` bytes need not pass through
Python: :class:`SplicePump` moves it with ``splice(2)``, socket → pipe → socket, so the pages
the upstream's packets arrived in go out to the client without being copied into a buffer of
ours and out of it again. Measured on loopback: about a third of the CPU per GB of a
``recv_into`` + ``send`` loop (``bench/README.md``, "LIST over plain HTTP").

While it runs, the upstream connection's transport is paused and the pump watches duplicates of
both sockets (an event loop refuses to watch a descriptor one of its transports owns), moving at
most ``BUDGET`` bytes per wake-up so other connections get their turn. The client's transport
is left alone: the pump starts only while its write buffer is empty (so nothing written before
can come after the spliced bytes) and nothing else writes to the client until the body ends.
Backpressure is the pipe's: when the client does not read, the pipe fills and the pump stops
reading the upstream. While the client's socket is full, the upstream is watched only if the
pipe is nearly empty (below ``REFILL``): a pump faster than its client otherwise wakes up for
each few kilobytes the upstream sends, and spends more CPU on waking than on moving bytes
(measured: ~0.45 s of CPU per GB that way, ~0.25 s this way).

Endings: the body's last byte out → the descriptors are closed and the connection ends its
response as after any other body (back to the pool, or closed; closed too when more bytes than
the body already wait in the upstream's socket). The upstream closing or
failing mid-body → the connection closes and the exchange is told (the relay cuts the client's
response short). The client failing → it is aborted, as if its transport had seen it go (the
relay then closes the upstream connection). The connection closed from outside (a deadline, a
cancelled call, shutdown) → :meth:`SplicePump.stop`.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.relay.fast.upstream import UpstreamConnection

__all__ = ["AVAILABLE", "BUDGET", "PIPE_SIZE", "REFILL", "SplicePump", "Spliced", "tcp_socket_fd"]

AVAILABLE = hasattr(os, "splice")  # Linux
PIPE_SIZE = 1024 * 1024  # asked of the kernel (its default: 64 KiB; /proc/sys/fs/pipe-max-size)
BUDGET = 2 * PIPE_SIZE  # bytes moved per wake-up at most, then the loop's other callbacks
REFILL = 4  # while the client is full, watch the upstream only below 1/REFILL of the pipe
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


class Spliced(Protocol):
    """The exchange whose body the pump moves."""

    def on_spliced(self, size: int) -> None:
        """``size`` more body bytes went to the client."""
        ...

    def on_lost(self, exc: BaseException) -> None: ...

    def abort_client(self) -> None:
        """The client's socket failed: abort its connection (the call then ends as for a
        client that went away)."""
        ...


def tcp_socket_fd(transport: asyncio.BaseTransport | None) -> int | None:
    """The descriptor of ``transport``'s socket when it is plain TCP (no TLS over it, not a Unix
    socket), else ``None``."""
    if transport is None or transport.is_closing():
        return None
    if transport.get_extra_info("sslcontext") is not None:
        return None
    if transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    fd = sock.fileno()
    return fd if fd >= 0 else None


class SplicePump:
    """Moves the rest of ``conn``'s length-framed body (``conn._left`` bytes) to ``client_fd``."""

    __slots__ = (
        "_cap", "_conn", "_dst", "_exchange", "_in_pipe", "_left", "_loop", "_pipe_r", "_pipe_w",
        "_reading", "_refill", "_src", "_writing",
    )

    def __init__(
        self, conn: UpstreamConnection, exchange: Spliced, transport: asyncio.Transport,
        client_fd: int,
    ) -> None:
        self._conn, self._exchange = conn, exchange
        self._loop = asyncio.get_running_loop()
        self._left = conn._left
        self._in_pipe = 0
        self._reading = self._writing = False
        self._src = self._dst = self._pipe_r = self._pipe_w = -1
        try:
            self._src = os.dup(transport.get_extra_info("socket").fileno())
            self._dst = os.dup(client_fd)
            self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._close_fds()
            raise
        try:
            fcntl.fcntl(self._pipe_w, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:  # over pipe-max-size, or the user's pipe pages spent: the default
            pass
        self._cap = fcntl.fcntl(self._pipe_w, _F_GETPIPE_SZ)
        self._refill = self._cap // REFILL
        conn.pump = self
        conn.pause_reading()  # the pump reads the socket now (the pool resumes it afterwards)
        self._pump()

    # --- moving bytes --------------------------------------------------------------
    def _pump(self) -> None:
        if self._src < 0:  # stopped meanwhile
            return
        moved = 0
        while moved < BUDGET:
            progress = False
            room = self._cap - self._in_pipe
            if self._left and room > 0:
                try:
                    n = os.splice(self._src, self._pipe_w, min(self._left, room), flags=_FLAGS)
                except BlockingIOError:
                    n = -1
                except OSError as e:
                    self._upstream_failed(e)
                    return
                if n == 0:
                    self._upstream_failed(ConnectionResetError(
                        f"the upstream closed the connection {self._left} bytes before the "
                        "body's end"))
                    return
                if n > 0:
                    self._left -= n
                    self._in_pipe += n
                    progress = True
            if self._in_pipe:
                try:
                    n = os.splice(self._pipe_r, self._dst, self._in_pipe, flags=_FLAGS)
                except BlockingIOError:
                    n = 0
                except OSError:
                    self._client_failed()
                    return
                if n > 0:
                    self._in_pipe -= n
                    moved += n
                    progress = True
                    self._exchange.on_spliced(n)
            if not self._left and not self._in_pipe:
                self._finish()
                return
            if not progress:
                break
        # level-triggered: each fires while its side is ready, so a spent budget resumes next
        # turn; bytes left in the pipe mean the client is full (or the budget spent)
        self._watch(read=self._left > 0 and self._in_pipe < self._refill, write=self._in_pipe > 0)

    def _watch(self, *, read: bool, write: bool) -> None:
        if read != self._reading:
            self._reading = read
            if read:
                self._loop.add_reader(self._src, self._pump)
            else:
                self._loop.remove_reader(self._src)
        if write != self._writing:
            self._writing = write
            if write:
                self._loop.add_writer(self._dst, self._pump)
            else:
                self._loop.remove_writer(self._dst)

    # --- endings -------------------------------------------------------------------
    def _finish(self) -> None:
        extra = self._more_queued()
        self.stop()
        self._conn.body_spliced(extra=extra)

    def _more_queued(self) -> bool:
        """Bytes past the body's end already wait in the upstream's socket (it sent more than
        its Content-Length): the pump took exactly the body, so the connection must not serve
        another call, which those bytes would answer (as a read past the end tells the
        :class:`~proxy.relay.fast.upstream.BodyReader`)."""
        sock = socket.socket(fileno=self._src)  # (the pump's duplicate, borrowed: detached)
        try:
            return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return False
        except OSError:  # reset after the body's end: unusable too
            return True
        finally:
            sock.detach()

    def _upstream_failed(self, exc: BaseException) -> None:
        conn, exchange = self._conn, self._exchange
        self.stop()
        conn.close()
        exchange.on_lost(exc)

    def _client_failed(self) -> None:
        """The client reset or closed: end as its own transport would on seeing it."""
        self.stop()
        self._exchange.abort_client()

    def stop(self) -> None:
        """Stop watching and close the pump's descriptors (the sockets stay their transports')."""
        if self._src < 0:
            return
        self._watch(read=False, write=False)  # before the duplicates close: the loop forgets them
        self._close_fds()
        if self._conn.pump is self:
            self._conn.pump = None

    def _close_fds(self) -> None:
        for fd in (self._src, self._dst, self._pipe_r, self._pipe_w):
            if fd >= 0:
                os.close(fd)
        self._src = self._dst = self._pipe_r = self._pipe_w = -1
