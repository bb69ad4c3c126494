"""opgate's own client to the apiserver (proxy/relay/fast/client.py): whole calls, streams,
backpressure, timeouts, limits, credentials, and connections given back or closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.relay.endpoint import Endpoint, TokenSource
from proxy.relay.fast.client import Answer, ClientError, UpstreamClient, json_lines
from proxy.relay.upstream import UpstreamConfig
from tests.integration.fakes import AiohttpUpstream
from tests.unit.test_protometa import deep


def client_for(url: str, *, token: str | None = "t0k") -> UpstreamClient:
    endpoint = Endpoint.from_config(UpstreamConfig(url=url + "/prefix"), None)
    return UpstreamClient(endpoint, TokenSource(token=token), connect_timeout=2.0,
                          user_agent="opgate-test")


async def api(request: web.BaseRequest) -> web.StreamResponse:
    if request.path == "/prefix/api/v1/namespaces":
        return web.json_response({"kind": "NamespaceList", "items": [{"n": i} for i in range(3)]})
    if request.path == "/prefix/apis/authentication.k8s.io/v1/tokenreviews":
        review = await request.json()
        return web.json_response({"status": {"authenticated": True}, "echo": review}, status=201)
    if request.path == "/prefix/watch":
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(int(request.query.get("events", "3"))):
            await resp.write(b'{"type":"ADDED","n":%d}\n' % i)
            await asyncio.sleep(float(request.query.get("gap", "0")))
        if request.query.get("stall"):
            await asyncio.sleep(30)
        return resp
    return web.json_response({"kind": "Status", "message": "nope", "code": 404}, status=404)


@pytest.mark.asyncio
async def test_whole_calls_carry_the_token_and_reuse_one_connection() -> None:
    up = await AiohttpUpstream(api).start()
    client = client_for(up.url)
    try:
        answer = await client.call("GET", "/api/v1/namespaces")
        assert answer.status == 200 and len(answer.json()["items"]) == 3
        posted = await client.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                                   body={"spec": {"token": "x"}})
        assert posted.status == 201 and posted.json()["echo"] == {"spec": {"token": "x"}}
        missing = await client.call("GET", "/api/v1/nothing")
        assert missing.status == 404 and missing.message() == "nope"
    finally:
        client.close()
        await up.close()
    assert [s.headers["Authorization"] for s in up.seen] == ["Bearer t0k"] * 3
    assert {s.headers["User-Agent"] for s in up.seen} == {"opgate-test"}
    assert client.pool.opened == 1  # keep-alive: one connection for the three calls


@pytest.mark.asyncio
async def test_stream_hands_chunks_over_as_they_arrive() -> None:
    up = await AiohttpUpstream(api).start()
    client = client_for(up.url)
    loop = asyncio.get_running_loop()
    try:
        async with client.stream("/watch?events=3&gap=0.2") as (status, chunks):
            assert status == 200
            seen = []
            async for chunk in chunks:
                seen.append((loop.time(), chunk))
        events = b"".join(c for _, c in seen).splitlines()
        assert [json.loads(e)["n"] for e in events] == [0, 1, 2]
        assert seen[-1][0] - seen[0][0] > 0.3  # not buffered to the end
        async with client.stream("/watch?events=1") as (_, chunks):  # the connection is reused
            assert [c async for c in chunks]
    finally:
        client.close()
        await up.close()
    assert client.pool.opened == 1


@pytest.mark.asyncio
async def test_a_silent_stream_times_out_and_its_connection_is_closed() -> None:
    up = await AiohttpUpstream(api).start()
    client = client_for(up.url)
    try:
        with pytest.raises(TimeoutError):
            async with client.stream("/watch?events=1&stall=1", idle=0.3) as (_, chunks):
                async for _ in chunks:
                    pass
        answer = await client.call("GET", "/api/v1/namespaces")  # a fresh connection
        assert answer.status == 200
    finally:
        client.close()
        await up.close()
    assert client.pool.opened == 2


@pytest.mark.asyncio
async def test_a_slow_reader_pauses_the_connection() -> None:
    block = b"x" * 65536

    async def flood(request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(400):  # 25 MiB
            await resp.write(block)
            flood.sent += len(block)  # type: ignore[attr-defined]
        return resp

    flood.sent = 0  # type: ignore[attr-defined]
    up = await AiohttpUpstream(flood).start()
    client = client_for(up.url)
    try:
        async with client.stream("/flood") as (_, chunks):
            first = await anext(chunks)
            await asyncio.sleep(0.5)
            assert flood.sent < 16 * 1024 * 1024  # type: ignore[attr-defined]
            total = len(first) + sum([len(c) async for c in chunks])
        assert total == 400 * len(block)
    finally:
        client.close()
        await up.close()


@pytest.mark.asyncio
async def test_limits_and_unreachable_upstreams_are_client_errors() -> None:
    up = await AiohttpUpstream(api).start()
    client = client_for(up.url)
    try:
        with pytest.raises(ClientError, match="larger than 10 bytes"):
            await client.call("GET", "/api/v1/namespaces", limit=10)
    finally:
        client.close()
        await up.close()
    gone = client_for(up.url)
    with pytest.raises(OSError):
        await gone.call("GET", "/api/v1/namespaces", within=3)
    gone.close()


@pytest.mark.asyncio
async def test_json_lines_joins_split_events_and_bounds_them() -> None:
    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    events = [e async for e in json_lines(chunks(b'{"a":', b'1}\n\n{"b":2}\n{"c"', b":3}\n"))]
    assert events == [{"a": 1}, {"b": 2}, {"c": 3}]
    with pytest.raises(ClientError, match="larger than 8 bytes"):
        _ = [e async for e in json_lines(chunks(b'{"aaaa":', b'"bbbbbbbb"'), limit=8)]


@pytest.mark.asyncio
async def test_watch_events_and_lists_as_deep_as_the_apiserver_sends_them() -> None:
    """A custom resource stored 2,000 levels deep (preserve-unknown-fields) has managedFields as
    deep, even in metadata-only lists and watch events: beyond Python's json, read all the same
    (an informer that failed on it would never sync again)."""
    async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    meta = b'{"metadata":{"name":"b1","managedFields":[{"fieldsV1":' + deep(2000) + b"}]}}"
    event = b'{"type":"ADDED","object":' + meta + b"}\n"
    events = [e async for e in json_lines(chunks(event[:5000], event[5000:], b'{"b":2}\n'))]
    assert [events[0]["object"]["metadata"]["name"], events[1]] == ["b1", {"b": 2}]
    listed = Answer(200, b'{"kind":"PartialObjectMetadataList","items":[' + meta + b"]}").json()
    assert listed["items"][0]["metadata"]["name"] == "b1"
    with pytest.raises(ValueError, match="exceeded max depth"):
        _ = [e async for e in json_lines(chunks(b"[" * 10001 + b"]" * 10001 + b"\n"))]
