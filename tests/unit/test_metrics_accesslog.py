"""Metrics keep bounded labels; the access log writes one JSON line and never a token."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Identity
from proxy.engine.status import forbidden
from proxy.middlewares import metrics as metrics_mod
from proxy.middlewares.accesslog import AccessLog
from proxy.middlewares.metrics import Metrics
from tests.unit.test_chain import make_ctx


def _count(**labels: str) -> float:
    return telemetry.REGISTRY.get_sample_value("opgate_requests_total", labels) or 0.0


def test_request_counted_with_its_labels() -> None:
    ctx = make_ctx("GET", "/apis/apps/v1/namespaces/a/deployments/web")
    ctx.status_code, ctx.decision = 200, "allowed"
    labels = dict(verb="get", group="apps", resource="deployments", code="200",
                  decision="allowed")
    before = _count(**labels)
    asyncio.run(settle(Metrics().exit(ctx)))
    assert _count(**labels) == before + 1


def test_non_resource_paths_do_not_become_labels() -> None:
    ctx = make_ctx("GET", "/some/random/path/abc123")
    ctx.status_code = 404
    before = _count(verb="get", group="", resource="", code="404", decision="allowed")
    asyncio.run(settle(Metrics().exit(ctx)))
    assert _count(verb="get", group="", resource="", code="404", decision="allowed") == before + 1


def test_invented_resources_never_become_labels() -> None:
    """A resource is a label value once the apiserver served a call to it: paths a client
    invents get 404 (or 403 from RBAC, which checks before routing, or opgate's own answer)."""
    m = Metrics()
    before = _count(verb="list", group="other", resource="other", code="404",
                    decision="allowed")
    for i in range(10):
        for code in (404, 403):
            ctx = make_ctx("GET", f"/apis/g{i}.example/v1/things{i}")
            ctx.status_code = code
            asyncio.run(settle(m.exit(ctx)))
    denied = make_ctx("GET", "/apis/g.example/v1/invented")
    denied.status_code, denied.answer, denied.decision = 200, forbidden("no"), "denied"
    asyncio.run(settle(m.exit(denied)))
    assert m._resources == set()
    assert _count(verb="list", group="other", resource="other", code="404",
                  decision="allowed") == before + 10
    # served once: a label from then on, for its 404s too (a missing object)
    for code in (404, 200, 404):
        ctx = make_ctx("GET", "/apis/real.example/v1/things")
        ctx.status_code = code
        asyncio.run(settle(m.exit(ctx)))
    assert m._resources == {("real.example", "things")}
    assert _count(verb="list", group="real.example", resource="things", code="404",
                  decision="allowed") == 1


def test_served_resources_past_the_cap_are_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_mod, "MAX_RESOURCES", 3)
    m = Metrics()
    for i in range(10):
        ctx = make_ctx("GET", f"/apis/c{i}.example/v1/things{i}")
        ctx.status_code = 200
        asyncio.run(settle(m.exit(ctx)))
    assert len(m._resources) == 3
    assert _count(verb="list", group="other", resource="other", code="200",
                  decision="allowed") >= 7


def test_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    ctx = make_ctx("DELETE", "/api/v1/namespaces/team-a/configmaps/cfg")
    ctx.status_code, ctx.bytes_out = 200, 123
    ctx.identity = Identity(user="system:serviceaccount:ops:op")
    logger = logging.getLogger("opgate.access")
    logger.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="opgate.access"):
        asyncio.run(settle(AccessLog().exit(ctx)))
    [record] = [r for r in caplog.records if r.name == "opgate.access"]
    line = json.loads(record.getMessage())
    assert line["verb"] == "delete"
    assert line["resource"] == "configmaps"
    assert line["namespace"] == "team-a"
    assert line["name"] == "cfg"
    assert line["code"] == 200
    assert line["bytes_out"] == 123
    assert line["user"] == "system:serviceaccount:ops:op"
    assert line["time"].endswith("Z")
    assert "token" not in record.getMessage().lower()


@pytest.mark.parametrize("name", ['we"ird', "back\\slash", "ünïcode", "new\nline"])
def test_access_log_escapes_like_json(name: str) -> None:
    ctx = make_ctx("GET", f"/api/v1/namespaces/a/configmaps/{name}")
    ctx.status_code = 200
    line = json.loads(AccessLog().line(ctx))
    assert line["name"] == name


@pytest.mark.parametrize("field", ["name", "user", "instance", "error"])
def test_no_access_log_value_can_break_its_line(field: str) -> None:
    """What a request sent (a percent-decoded name, a user name, the instance header) may hold
    a line break JSON leaves as it is (U+2028, U+2029, NEL): a reader splitting lines as Python
    does (``str.splitlines``) read a line of the request's choosing there. They are escaped,
    as Go's encoding/json (the apiserver's audit log) escapes U+2028 and U+2029."""
    forged = 'x\u2028{"time":"2026-01-01T00:00:00.000Z","verb":"delete","name":"y\u2029z\x85'
    name = forged if field == "name" else "cfg"
    ctx = make_ctx("GET", f"/api/v1/namespaces/a/configmaps/{name}")
    ctx.status_code = 200
    if field == "user":
        ctx.identity = Identity(user=forged)
    if field == "instance":
        ctx.headers = {"opgate-instance": forged}
    if field == "error":
        ctx.error = forged
    line = AccessLog().line(ctx)
    assert len(line.splitlines()) == 1, line
    assert json.loads(line)[field] == forged


def test_writer_batches_and_flushes() -> None:
    """Lines that come close together are held for one write up to FLUSH_SECONDS after the
    first; a line after a quiet spell goes out at the end of the loop's turn, with the other
    lines of that turn, and no timer is left to wake the loop for it."""
    import io

    from proxy.middlewares import accesslog
    from proxy.middlewares.accesslog import AccessWriter

    out = io.StringIO()
    now = [100.0]

    async def main() -> None:
        writer = AccessWriter(out, clock=lambda: now[0])
        mw = AccessLog(writer=writer)

        def call(i: int) -> None:
            ctx = make_ctx("GET", f"/api/v1/namespaces/a/configmaps/c{i}")
            ctx.status_code = 200
            mw.exit(ctx)

        call(0)  # the first line: quiet before it
        call(1)  # the same turn
        assert out.getvalue() == ""  # not within the turn
        await asyncio.sleep(0)
        assert len(out.getvalue().splitlines()) == 2  # at its end
        assert writer._timer is None  # nothing left to wake the loop

        for i in range(2, 5):  # busy: each line less than SPARSE_SECONDS after the one before
            now[0] += accesslog.SPARSE_SECONDS / 2
            call(i)
            await asyncio.sleep(0)
        assert len(out.getvalue().splitlines()) == 2  # held for one write
        assert isinstance(writer._timer, asyncio.TimerHandle)
        await asyncio.sleep(accesslog.FLUSH_SECONDS * 4)
        assert len(out.getvalue().splitlines()) == 5  # written within FLUSH_SECONDS

        now[0] += accesslog.SPARSE_SECONDS * 2  # a quiet spell again
        call(5)
        await asyncio.sleep(0)
        assert len(out.getvalue().splitlines()) == 6
        writer.close()

    asyncio.run(main())
    names = [json.loads(x)["name"] for x in out.getvalue().splitlines()]
    assert names == [f"c{i}" for i in range(6)]


def test_a_writer_that_is_not_prompt_holds_even_a_lone_line() -> None:
    """The audit log's writer (each write wakes its thread) batches by time however quiet."""
    import io

    from proxy.middlewares import accesslog
    from proxy.middlewares.accesslog import AccessWriter

    out = io.StringIO()

    async def main() -> None:
        writer = AccessWriter(out, prompt=False)
        writer.write("one\n")
        await asyncio.sleep(0)
        assert out.getvalue() == ""
        assert isinstance(writer._timer, asyncio.TimerHandle)
        await asyncio.sleep(accesslog.FLUSH_SECONDS * 4)
        assert out.getvalue() == "one\n"

    asyncio.run(main())


def test_a_batch_of_flush_bytes_goes_out_at_once() -> None:
    """The batch is bounded in bytes, not lines: an audit line can hold a whole request
    object, and a batch that grew without bound would be dropped whole by the writer thread."""
    import io

    from proxy.middlewares.accesslog import FLUSH_BYTES, AccessWriter

    out = io.StringIO()
    big = "x" * (FLUSH_BYTES // 4 - 1) + "\n"

    async def main() -> None:
        writer = AccessWriter(out)
        for _ in range(3):
            writer.write(big)
        assert out.getvalue() == ""  # below FLUSH_BYTES: waits for the timer
        writer.write(big)  # FLUSH_BYTES reached: written now
        assert out.getvalue() == big * 4
        writer.write("next\n")
        writer.close()

    asyncio.run(main())
    assert out.getvalue().endswith(big + "next\n")


def test_each_write_is_whole_lines_of_at_most_pipe_buf_bytes() -> None:
    """``--workers N`` share one stdout, a pipe in a container: the kernel keeps a write of at
    most PIPE_BUF (4096) bytes whole, but lets another process's write into a longer one when
    the pipe is full, so two workers' 64 KiB batches cut each other's lines in two (seen with
    two writers and a slow reader). Every write is whole lines within PIPE_BUF bytes (as
    encoded); a longer line goes alone."""
    import select

    from proxy.middlewares.accesslog import AccessWriter

    class Pipe:
        encoding = "utf-8"

        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, data: str) -> None:
            self.writes.append(data)

        def flush(self) -> None:
            pass

    lines = [f'{{"trace":"{i}","name":"{"y" * (i % 300)}"}}\n' for i in range(400)]
    lines[7] = '{"name":"' + "\u00e9" * 3000 + '"}\n'  # 3 KB of characters, 6 KB as UTF-8
    lines[9] = '{"path":"/' + "z" * 9000 + '"}\n'
    out = Pipe()
    writer = AccessWriter(out, shared=True)  # no running loop: each line is written at once,
    # so batch it
    writer._lines, writer._size = list(lines), sum(map(len, lines))
    writer.flush()
    assert "".join(out.writes) == "".join(lines)
    for data in out.writes:
        assert data.endswith("\n")
        if data not in (lines[7], lines[9]):
            assert len(data.encode()) <= select.PIPE_BUF, len(data.encode())
    assert len(out.writes) <= 2 + 2 * sum(map(len, lines)) // select.PIPE_BUF  # still batched
    alone = Pipe()  # a stream of this process alone (no --workers): a batch in one write
    writer = AccessWriter(alone)
    writer._lines, writer._size = list(lines), sum(map(len, lines))
    writer.flush()
    assert alone.writes == ["".join(lines)]


def test_duration_ms_is_str_of_round() -> None:
    import random

    from proxy.middlewares.accesslog import duration_ms

    rnd = random.Random(5)
    values = [rnd.random() * 10 ** rnd.uniform(-7, 4) for _ in range(20000)]
    values += [i / 1e6 for i in range(3000)] + [i / 2**20 for i in range(3000)]
    values += [0.0, -0.0, 0.0005, 0.0015, 1.0625e-3, 59.9995, 3600.0]
    for seconds in values:
        assert duration_ms(seconds) == str(round(seconds * 1000, 3)), seconds
