"""An upstream connection whose TLS layer keeps every byte the peer sent before its FIN.

A tunnel (exec, attach, port-forward) ends with the apiserver closing the connection right
after its last bytes (exec's output, then its status), and Go's ``tls.Conn`` sends its FIN
without waiting for our ``close_notify``. uvloop's TLS layer (the default loop's), when that FIN
arrives while the protocol has paused reading (the client reads slower than the apiserver
sends: a few MB of output to a busy pipe, or the aiohttp core's tunnel, whose reader pauses at
each 256 KiB), shuts the connection down at once and drops the records it has received but not
yet handed over (MagicStack/uvloop#661, open): ``kubectl exec`` got its output short by up to
256 KiB, with exit code 0. asyncio's own TLS layer (``asyncio.sslproto.SSLProtocol``, what
asyncio's loop runs) keeps them and reports the end only after they have been read, and it runs
on any loop's TCP transport, so tunnels use it on uvloop too. Calls whose responses are framed
(everything else) are done before a FIN can matter, and keep the loop's TLS layer. Reading
200 MB costs the two layers the same CPU (``bench/tls_layers.py``).
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto

__all__ = ["open_connection"]


async def open_connection(
    protocol: asyncio.BaseProtocol,
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    server_hostname: str | None,
) -> None:
    """Connect ``protocol`` over plain TCP, or over TLS with asyncio's layer (returns once
    the handshake is done); its ``connection_made`` gets the transport to use."""
    loop = asyncio.get_running_loop()
    if tls is None:
        await loop.create_connection(lambda: protocol, host, port)
        return
    handshake: asyncio.Future[None] = loop.create_future()
    layer = sslproto.SSLProtocol(loop, protocol, tls, handshake,
                                 server_hostname=server_hostname or host)
    raw, _ = await loop.create_connection(lambda: layer, host, port)
    try:
        await handshake
    except BaseException:
        raw.abort()
        raise
