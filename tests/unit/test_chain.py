"""The chain runs hooks in order, stops at the first deny, and contains middleware crashes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from proxy.engine import telemetry
from proxy.engine.chain import Chain, is_retryable, settle
from proxy.engine.context import Delay, Deny, RequestContext
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.status import forbidden


class _Policies:
    allow_impersonation = False

    def section(self, key: str) -> tuple[Any, ...]:
        return ()


def make_ctx(method: str = "GET", path: str = "/api/v1/namespaces/a/configmaps") -> RequestContext:
    return RequestContext(info=parse_request_info(method, path, ""), method=method, path=path,
                          query="", headers={}, policies=_Policies())  # type: ignore[arg-type]


class Recorder:
    def __init__(self, name: str, calls: list[str], decision: Any = None, *,
                 crash: str = "", fail_open: bool = False) -> None:
        self.name, self.calls, self.decision, self.crash = name, calls, decision, crash
        self.needs_body = False
        self.fail_open = fail_open

    async def entry(self, ctx: RequestContext) -> Any:
        self.calls.append(f"{self.name}.entry")
        if self.crash == "entry":
            raise RuntimeError("boom")
        return self.decision

    async def exit(self, ctx: RequestContext) -> None:
        self.calls.append(f"{self.name}.exit")
        if self.crash == "exit":
            raise RuntimeError("boom")

    async def retry(self, ctx: RequestContext) -> None:
        self.calls.append(f"{self.name}.retry")


class ExitOnly:
    name = "exitonly"
    needs_body = True

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def exit(self, ctx: RequestContext) -> None:
        self.calls.append("exitonly.exit")


def test_hooks_run_in_order_and_missing_hooks_are_skipped() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls), ExitOnly(calls), Recorder("b", calls)])
    ctx = make_ctx()
    assert asyncio.run(settle(chain.entry(ctx))) is None
    ctx.status_code = 200
    asyncio.run(settle(chain.exit(ctx)))
    assert calls == ["a.entry", "b.entry", "a.exit", "exitonly.exit", "b.exit"]
    assert chain.needs_body is True


def test_first_deny_ends_the_chain() -> None:
    calls: list[str] = []
    denial = forbidden("no")
    chain = Chain([Recorder("a", calls, Deny(denial, "denied")), Recorder("b", calls)])
    ctx = make_ctx()
    assert asyncio.run(settle(chain.entry(ctx))) is denial
    assert ctx.decision == "denied"
    assert calls == ["a.entry"]


def test_delay_waits_then_goes_on() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls, Delay(0.05)), Recorder("b", calls)])
    started = time.monotonic()
    assert asyncio.run(settle(chain.entry(make_ctx()))) is None
    assert time.monotonic() - started >= 0.05
    assert calls == ["a.entry", "b.entry"]


@pytest.mark.parametrize(("fail_open", "expect_code", "expect_calls"), [
    (False, 500, ["crash.entry"]),
    (True, None, ["crash.entry", "b.entry"]),
])
def test_crash_in_entry_is_contained(fail_open: bool, expect_code: int | None,
                                     expect_calls: list[str]) -> None:
    calls: list[str] = []
    before = telemetry.REGISTRY.get_sample_value(
        "opgate_middleware_errors_total", {"middleware": "crash", "hook": "entry"}) or 0
    chain = Chain([Recorder("crash", calls, crash="entry", fail_open=fail_open),
                   Recorder("b", calls)])
    result = asyncio.run(settle(chain.entry(make_ctx())))
    assert (result.code if result else None) == expect_code
    assert calls == expect_calls
    after = telemetry.REGISTRY.get_sample_value(
        "opgate_middleware_errors_total", {"middleware": "crash", "hook": "entry"})
    assert after == before + 1


def test_crash_in_exit_does_not_stop_later_hooks() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls, crash="exit"), Recorder("b", calls)])
    ctx = make_ctx()
    ctx.status_code = 200
    asyncio.run(settle(chain.exit(ctx)))
    assert calls == ["a.exit", "b.exit"]


@pytest.mark.parametrize(("code", "retry"), [
    (200, False), (201, False), (404, False), (409, True), (422, False), (429, True),
    (500, True), (503, True), (504, True),
])
def test_retry_hooks_see_retryable_outcomes(code: int, retry: bool) -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls)])
    ctx = make_ctx()
    ctx.status_code = code
    asyncio.run(settle(chain.exit(ctx)))
    assert ("a.retry" in calls) is retry is is_retryable(code)


class _Sections:
    """A policy set holding only the named sections."""

    allow_impersonation = False

    def __init__(self, *present: str) -> None:
        self.present = present

    def section(self, key: str) -> tuple[Any, ...]:
        return ((object(), ()),) if key in self.present else ()


class Scoped(Recorder):
    sections = ("rateLimits", "quotas")


def test_entry_hooks_of_absent_sections_are_skipped() -> None:
    calls: list[str] = []
    chain = Chain([Recorder("a", calls), Scoped("scoped", calls), Recorder("b", calls)])

    def run(policies: object) -> list[str]:
        calls.clear()
        ctx = make_ctx()
        ctx.policies = policies  # type: ignore[assignment]
        assert asyncio.run(settle(chain.entry(ctx))) is None
        ctx.status_code = 200
        asyncio.run(settle(chain.exit(ctx)))  # exit hooks always run
        return calls[:]

    without, with_one = _Sections("faults"), _Sections("quotas")
    assert run(without) == ["a.entry", "b.entry", "a.exit", "scoped.exit", "b.exit"]
    assert run(with_one) == ["a.entry", "scoped.entry", "b.entry", "a.exit", "scoped.exit",
                             "b.exit"]
    assert run(without) == ["a.entry", "b.entry", "a.exit", "scoped.exit", "b.exit"]
    assert run(with_one)[:3] == ["a.entry", "scoped.entry", "b.entry"]


class Plain:
    """Hooks as plain functions (the hot-path form): ``wait`` makes one of them return a
    coroutine instead of answering at once (its slow path), ``crash`` raises either at once
    or inside that coroutine."""

    needs_body = False
    fail_open = False

    def __init__(self, name: str, calls: list[str], decision: Any = None, *, wait: str = "",
                 crash: str = "") -> None:
        self.name, self.calls, self.decision = name, calls, decision
        self.wait, self.crash = wait, crash

    async def _later(self, hook: str) -> Any:
        await asyncio.sleep(0)
        self.calls.append(f"{self.name}.{hook} (waited)")
        if self.crash == f"{hook} (waited)":
            raise RuntimeError("boom")
        return self.decision if hook == "entry" else None

    def entry(self, ctx: RequestContext) -> Any:
        if self.wait == "entry":
            return self._later("entry")
        self.calls.append(f"{self.name}.entry")
        if self.crash == "entry":
            raise RuntimeError("boom")
        return self.decision

    def exit(self, ctx: RequestContext) -> Any:
        if self.wait == "exit":
            return self._later("exit")
        self.calls.append(f"{self.name}.exit")
        if self.crash == "exit":
            raise RuntimeError("boom")
        return None


def test_plain_hooks_answer_without_a_coroutine() -> None:
    calls: list[str] = []
    denial = Deny(forbidden("no"), "denied")
    chain = Chain([Plain("a", calls), Plain("b", calls)])
    ctx = make_ctx()
    assert chain.entry(ctx) is None  # no coroutine to await: the answer itself
    ctx.status_code = 200
    assert chain.exit(ctx) is None
    assert calls == ["a.entry", "b.entry", "a.exit", "b.exit"]
    denying = Chain([Plain("a", calls, denial), Plain("b", calls)])
    ctx = make_ctx()
    assert denying.entry(ctx) is denial.status
    assert ctx.decision == "denied"


def test_a_waiting_hook_makes_the_chain_wait_and_keeps_the_order() -> None:
    calls: list[str] = []
    denial = Deny(forbidden("no"), "denied")
    chain = Chain([Plain("a", calls), Plain("b", calls, wait="entry"), Plain("c", calls),
                   Plain("d", calls, denial), Plain("e", calls)])
    ctx = make_ctx()
    waiting = chain.entry(ctx)
    assert asyncio.iscoroutine(waiting)
    assert calls == ["a.entry"]  # b's answer is not in yet: c has not run
    assert asyncio.run(settle(waiting)) is denial.status
    assert calls == ["a.entry", "b.entry (waited)", "c.entry", "d.entry"]
    assert ctx.decision == "denied"

    calls.clear()
    ctx.status_code = 200
    chain = Chain([Plain("a", calls), Plain("b", calls, wait="exit"), Plain("c", calls)])
    waiting = chain.exit(ctx)
    assert asyncio.iscoroutine(waiting) and calls == ["a.exit"]
    asyncio.run(settle(waiting))
    assert calls == ["a.exit", "b.exit (waited)", "c.exit"]


def test_hooks_of_other_verbs_are_skipped() -> None:
    """A middleware that declares ``verbs`` has its entry and exit run only for calls of those
    verbs (its retry hook is not concerned), under any policy set, with ``sections`` too."""
    calls: list[str] = []

    class Creates(Plain):
        verbs = ("create",)
        sections = ("quotas",)

        def retry(self, ctx: RequestContext) -> None:
            self.calls.append(f"{self.name}.retry")

    chain = Chain([Plain("a", calls), Creates("c", calls, wait="exit"), Plain("b", calls)])

    def run(method: str, policies: object, code: int = 200) -> list[str]:
        calls.clear()
        ctx = make_ctx(method)
        ctx.policies = policies  # type: ignore[assignment]
        assert asyncio.run(settle(chain.entry(ctx))) is None
        ctx.status_code = code
        asyncio.run(settle(chain.exit(ctx)))
        return calls[:]

    quotas, faults = _Sections("quotas"), _Sections("faults")
    for _ in range(2):  # the second time from what the chain remembered
        assert run("GET", quotas) == ["a.entry", "b.entry", "a.exit", "b.exit"]
        assert run("POST", quotas) == ["a.entry", "c.entry", "b.entry", "a.exit",
                                       "c.exit (waited)", "b.exit"]
        assert run("POST", faults) == ["a.entry", "b.entry", "a.exit", "c.exit (waited)",
                                       "b.exit"]
        assert run("DELETE", quotas, 500) == ["a.entry", "b.entry", "a.exit", "b.exit",
                                              "c.retry"]


def test_a_middleware_listed_twice_resumes_where_it_waited() -> None:
    """The chain finds where a hook had to wait by its own entry, not by the hook: the same
    object twice (hooks as plain attributes: one callable for both) resumes at the second."""
    calls: list[str] = []

    async def later(what: str) -> None:
        calls.append(f"{what} (waited)")

    class Twice:
        name, needs_body = "twice", False

        def __init__(self) -> None:
            self.seen = 0

            def hook(ctx: RequestContext) -> Any:
                self.seen += 1
                return later(f"twice#{self.seen}") if self.seen == 2 else calls.append(
                    f"twice#{self.seen}")

            self.entry = self.exit = hook

    for point in ("entry", "exit"):
        calls.clear()
        twice = Twice()
        chain = Chain([twice, Plain("b", calls), twice, Plain("c", calls)])
        ctx = make_ctx()
        ctx.status_code = 200
        waiting = getattr(chain, point)(ctx)
        assert asyncio.iscoroutine(waiting)
        assert asyncio.run(settle(waiting)) is None
        assert calls == ["twice#1", f"b.{point}", "twice#2 (waited)", f"c.{point}"]


def test_a_waiting_hook_that_denies_or_delays() -> None:
    calls: list[str] = []
    denial = Deny(forbidden("no"), "denied")
    chain = Chain([Plain("a", calls, denial, wait="entry"), Plain("b", calls)])
    assert asyncio.run(settle(chain.entry(make_ctx()))) is denial.status
    assert calls == ["a.entry (waited)"]
    calls.clear()
    chain = Chain([Plain("a", calls, Delay(0.05)), Plain("b", calls)])
    waiting = chain.entry(make_ctx())
    assert asyncio.iscoroutine(waiting)  # a delay is a wait too
    started = time.monotonic()
    assert asyncio.run(settle(waiting)) is None
    assert time.monotonic() - started >= 0.045
    assert calls == ["a.entry", "b.entry"]


@pytest.mark.parametrize("fail_open, expect_code", [(False, 500), (True, None)])
def test_crash_while_waiting_is_contained(fail_open: bool, expect_code: int | None) -> None:
    calls: list[str] = []
    crashing = Plain("a", calls, wait="entry", crash="entry (waited)")
    crashing.fail_open = fail_open
    chain = Chain([crashing, Plain("b", calls)])
    ctx = make_ctx()
    labels = {"middleware": "a", "hook": "entry"}
    before = telemetry.REGISTRY.get_sample_value("opgate_middleware_errors_total", labels) or 0
    result = asyncio.run(settle(chain.entry(ctx)))
    after = telemetry.REGISTRY.get_sample_value("opgate_middleware_errors_total", labels)
    assert after == before + 1
    if expect_code is None:
        assert result is None and calls == ["a.entry (waited)", "b.entry"]
    else:
        assert result is not None and result.code == expect_code and ctx.decision == "error"
        assert calls == ["a.entry (waited)"]

    calls.clear()
    chain = Chain([Plain("a", calls, crash="exit"), Plain("b", calls, wait="exit",
                                                           crash="exit (waited)"),
                   Plain("c", calls)])
    asyncio.run(settle(chain.exit(ctx)))  # every exit hook runs, crashes or not
    assert calls == ["a.exit", "b.exit (waited)", "c.exit"]


def test_entry_in_two_parts_around_a_body_read() -> None:
    """The hooks ahead of the first body reader, then the rest: together what entry runs, in
    its order; a refusal in the first part leaves the rest (and the body read) out."""
    calls: list[str] = []
    reader = Recorder("reader", calls)
    reader.needs_body = True
    chain = Chain([Recorder("who", calls), Recorder("faults", calls), reader,
                   ExitOnly(calls), Recorder("last", calls)])
    ctx = make_ctx("POST")
    assert asyncio.run(settle(chain.entry_before_body(ctx))) is None
    assert calls == ["who.entry", "faults.entry"]
    assert asyncio.run(settle(chain.entry_after_body(ctx))) is None
    assert calls == ["who.entry", "faults.entry", "reader.entry", "last.entry"]
    calls.clear()
    assert asyncio.run(settle(chain.entry(make_ctx("POST")))) is None
    assert calls == ["who.entry", "faults.entry", "reader.entry", "last.entry"]

    calls.clear()
    denying = Chain([Recorder("who", calls, Deny(forbidden("no"))), reader])
    status = asyncio.run(settle(denying.entry_before_body(make_ctx("POST"))))
    assert status is not None and status.code == 403
    assert calls == ["who.entry"]
