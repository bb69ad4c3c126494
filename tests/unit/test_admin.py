"""The admin listener's routes over a real socket: ``/readyz`` as the apiserver's (``?verbose``,
``?exclude=``), ``/metrics`` in the format the scraper asks for, and what a method other than
GET/HEAD gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin import (
    AdminListener,
    NamedCheck,
    build_admin_app,
    registry_metrics,
    serve_admin,
    worker_checks,
)


async def _passes() -> tuple[bool, str]:
    return True, ""


async def _fails() -> tuple[bool, str]:
    return False, "upstream /readyz answered 500"


async def _no_policies() -> dict[str, Any]:
    return {}


REGISTRY = CollectorRegistry()
Counter("opgate_requests_total", "Calls.", ["verb"], registry=REGISTRY).labels("get").inc(3)


@pytest.fixture
async def admin() -> AsyncIterator[AdminListener]:
    app = build_admin_app(checks=[NamedCheck("policies", _passes), NamedCheck("upstream", _fails)],
                          describe_policies=_no_policies,
                          render_metrics=registry_metrics(REGISTRY))
    listener = await serve_admin(app, listen="127.0.0.1:0")
    try:
        yield listener
    finally:
        await listener.cleanup()


async def call(listener: AdminListener, target: str, method: str = "GET",
               extra: str = "") -> tuple[str, str]:
    """The head and the body of the admin's answer to ``method target``."""
    host, _, port = listener.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\nHost: admin\r\nContent-Length: 0\r\n"
                     f"{extra}Connection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return head, body


async def test_readyz_exclude_skips_a_check_as_the_apiservers_does(admin: AdminListener) -> None:
    head, body = await call(admin, "/readyz")
    assert head.startswith("HTTP/1.1 503") and "[-]upstream failed: upstream /readyz" in body
    head, body = await call(admin, "/readyz?exclude=upstream")
    assert head.startswith("HTTP/1.1 200") and body == "ok"
    head, body = await call(admin, "/readyz?verbose&exclude=upstream&exclude=etcd")
    assert head.startswith("HTTP/1.1 200")
    assert body.splitlines() == [
        "[+]policies ok", "[+]upstream excluded: ok", "[+]shutdown ok",
        'warn: some health checks cannot be excluded: no matches for "etcd"',
        "readyz check passed"]


async def test_readyz_exclude_of_shutdown(admin: AdminListener) -> None:
    admin.shutting_down()
    head, body = await call(admin, "/readyz?exclude=upstream")
    assert head.startswith("HTTP/1.1 503") and "[-]shutdown failed: shutting down" in body
    head, _ = await call(admin, "/readyz?exclude=upstream&exclude=shutdown")
    assert head.startswith("HTTP/1.1 200")


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_other_methods_get_405_with_allow(admin: AdminListener, method: str) -> None:
    head, body = await call(admin, "/metrics", method)
    assert head.startswith("HTTP/1.1 405") and body == "method not allowed\n"
    assert "\r\nAllow: GET, HEAD" in head


def _samples(families: Any) -> dict[str, float]:
    return {sample.name: sample.value for family in families for sample in family.samples}


async def test_metrics_in_the_text_format_or_openmetrics_when_asked(admin: AdminListener) -> None:
    head, body = await call(admin, "/metrics")
    assert "\r\nContent-Type: text/plain; version=" in head
    assert _samples(text_string_to_metric_families(body)) == {"opgate_requests_total": 3.0}
    # Prometheus asks for OpenMetrics first; its parser refuses the text format's counters
    head, body = await call(admin, "/metrics", extra=(
        "Accept: application/openmetrics-text;version=1.0.0;q=0.5,"
        "text/plain;version=0.0.4;q=0.3\r\n"))
    assert "\r\nContent-Type: application/openmetrics-text; version=1.0.0" in head
    assert body.endswith("# EOF\n")
    assert _samples(openmetrics_families(body)) == {"opgate_requests_total": 3.0}


@dataclass
class FakeWorker:
    index: int
    socket: str
    last_exit: str = ""
    pid: int | None = 4242


async def test_supervisor_readyz_passes_exclude_on_to_the_workers(tmp_path: Path) -> None:
    """With --workers, the supervisor's /readyz asks each worker's: ``?exclude=upstream`` must
    reach them, or a probe that excludes a worker's check still fails on it."""
    sock = str(tmp_path / "worker-0.sock")
    worker = await serve_admin(build_admin_app(
        checks=[NamedCheck("policies", _passes), NamedCheck("upstream", _fails)],
        describe_policies=_no_policies, render_metrics=registry_metrics(REGISTRY)),
        listen=f"unix:{sock}")
    supervisor = await serve_admin(build_admin_app(
        checks=worker_checks([FakeWorker(0, sock)]), describe_policies=_no_policies,
        render_metrics=registry_metrics(REGISTRY)), listen="127.0.0.1:0")
    try:
        head, body = await call(supervisor, "/readyz")
        assert head.startswith("HTTP/1.1 503")
        assert "[-]worker-0 failed: pid 4242: [-]upstream" in body
        head, body = await call(supervisor, "/readyz?verbose&exclude=upstream")
        assert head.startswith("HTTP/1.1 200"), body
        assert body.splitlines() == ["[+]worker-0 ok: pid 4242", "[+]shutdown ok",
                                     "readyz check passed"]
    finally:
        await supervisor.cleanup()
        await worker.cleanup()
