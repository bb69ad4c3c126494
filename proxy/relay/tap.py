"""The aiohttp core's side of ``ctx.tap`` (see :class:`~proxy.engine.context.BodyTap`): the
request body and the response body stream through these wrappers, so the tap sees each chunk
as it is forwarded. Only calls with a tap are wrapped; the others pay nothing per chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import StreamReader

from proxy.engine.context import BodyTap

__all__ = ["tee_read", "tee_stream"]


async def tee_stream(content: StreamReader, tap: BodyTap) -> AsyncIterator[bytes]:
    """The request body as it arrives, each chunk shown to ``tap`` on its way upstream."""
    while chunk := await content.readany():
        tap.request_body(chunk)
        yield chunk


def tee_read(read: Callable[[], Awaitable[bytes]],
             tap: BodyTap) -> Callable[[], Awaitable[bytes]]:
    """``read`` (a response body's ``readany``) that shows each chunk to ``tap``."""
    async def tapped() -> bytes:
        chunk = await read()
        if chunk:
            tap.response_body(chunk)
        return chunk

    return tapped
