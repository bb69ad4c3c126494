"""A tiny watch upstream that stamps every event with the moment it was sent.

nginx cannot emit a watch stream, so the static upstream's nginx forwards the watch namespace
(``/api/v1/namespaces/watch/…``) to this server. ``GET …?watch=true&count=N&rate=R`` answers an
apiserver-shaped stream of ``N`` ``MODIFIED`` ConfigMap events (one JSON object per line, about
700 bytes each) at ``R`` events per second, each carrying ``CLOCK_MONOTONIC`` in nanoseconds at
the moment of writing (the clock is system-wide on Linux, so the client can subtract it from its
own), then ends; with ``idle=1`` it then holds the stream open without sending anything more
(the open watches of the memory measure: one event proves the stream is through) until the
client goes away.

It also answers the cluster-wide ``/api/v1/configmaps`` that the full chain's quota counter
lists and watches (metadata only): a list of one object, and a watch that sends nothing and
ends after its ``timeoutSeconds``, as an apiserver's would when nothing changes.

Run: ``python -m bench.watchserver PORT`` (loopback only).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from aiohttp import web

PAYLOAD = "x" * 400
STAMP = "bench.opgate.dev/sent-ns"


def event(seq: int) -> bytes:
    obj = {
        "type": "MODIFIED",
        "object": {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "watched", "namespace": "watch", "resourceVersion": str(seq),
                         "uid": "3f0c5a52-8e7e-4d8b-9c55-bench0000000",
                         "annotations": {STAMP: str(time.monotonic_ns())}},
            "data": {"payload": PAYLOAD},
        },
    }
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


COUNTED = "/api/v1/configmaps"  # every namespace: what a quota on configmaps counts
COUNTED_LIST = json.dumps({
    "kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
    "metadata": {"resourceVersion": "48211"},
    "items": [{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
               "metadata": {"name": "small", "namespace": "bench", "resourceVersion": "48211"}}],
})


async def counted(request: web.BaseRequest) -> web.StreamResponse:
    query = request.rel_url.query
    if query.get("watch") not in ("true", "1"):
        return web.Response(text=COUNTED_LIST, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await asyncio.sleep(float(query.get("timeoutSeconds", "300")))
    await resp.write_eof()
    return resp


async def handle(request: web.BaseRequest) -> web.StreamResponse:
    query = request.rel_url.query
    if request.path == COUNTED:
        return await counted(request)
    if query.get("watch") not in ("true", "1"):
        return web.Response(text='{"kind":"Status","code":404}', status=404,
                            content_type="application/json")
    count = int(query.get("count", "1"))
    rate = float(query.get("rate", "100"))
    resp = web.StreamResponse(headers={"Content-Type": "application/json",
                                       "Cache-Control": "no-cache, private"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for seq in range(1, count + 1):
        delay = start + seq / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await resp.write(event(seq))
    if query.get("idle") == "1":
        await asyncio.Event().wait()  # until the client goes away (the handler is cancelled)
    await resp.write_eof()
    return resp


async def main(port: int) -> None:
    server = web.Server(handle, handler_cancellation=True)
    runner = web.ServerRunner(server, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(int(sys.argv[1])))
    except KeyboardInterrupt:
        pass
