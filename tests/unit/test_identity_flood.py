"""The identity middleware under a flood of tokens: at most ``REVIEWS_IN_FLIGHT`` TokenReviews
at once, a 429 (or the call on, under ``failure: open``) when none is free in time, and a
rejected token asked once however often it is repeated."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from proxy.engine import limitlog, telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Deny, Identity
from proxy.middlewares import identity_verify as identity
from proxy.middlewares.identity import IdentityCheck
from tests.unit import test_identity as ti

CM = "/api/v1/namespaces/team-a/configmaps"
ADMIN = Identity(user="admin", groups=("system:masters",), source="tokenreview")


class CountingAuth(ti.FakeAuth):
    """A fake apiserver whose TokenReviews take ``delay`` s; counts those in flight."""

    def __init__(self, delay: float = 0.01) -> None:
        super().__init__()
        self.delay = delay
        self.in_flight = 0
        self.peak = 0

    async def token_review(self, token: str) -> tuple[Identity, tuple[str, ...]] | None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return await super().token_review(token)
        finally:
            self.in_flight -= 1


def flood(check: IdentityCheck, policies: Any, tokens: list[str]) -> list[Deny | None]:
    """Every token's call at once (one event loop), their decisions in order."""
    async def calls() -> list[Any]:
        return await asyncio.gather(*(settle(check.entry(ti.ctx_for(policies, "GET", CM, t)))
                                      for t in tokens))

    return asyncio.run(calls())


def reviews(result: str) -> float:
    return float(telemetry.TOKEN_REVIEWS.labels(result)._value.get())


def test_a_hundred_distinct_tokens_at_once_get_at_most_the_bound_of_reviews(
        tmp_path: Path) -> None:
    auth = CountingAuth()
    tokens = [f"opaque-{i}" for i in range(100)]
    for token in tokens[::2]:  # half of them the apiserver accepts
        auth.reviews[token] = (ADMIN, ())
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    before = {r: reviews(r) for r in ("authenticated", "rejected", "busy")}
    decisions = flood(check, policies, tokens)
    assert auth.peak == identity.REVIEWS_IN_FLIGHT  # the bound, and used to the full
    assert auth.calls.count("review") == 100  # each waited its turn: none refused
    assert decisions[::2] == [None] * 50
    assert [ti.body(d)["code"] for d in decisions[1::2] if d is not None] == [401] * 50
    assert reviews("authenticated") == before["authenticated"] + 50
    assert reviews("rejected") == before["rejected"] + 50
    assert reviews("busy") == before["busy"]
    assert check._verifier._review_slots._value == identity.REVIEWS_IN_FLIGHT  # all given back


def test_a_call_with_no_review_free_in_time_gets_429(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The apiserver answers slower than a call may wait: the first REVIEWS_IN_FLIGHT tokens are
    reviewed, every other call gets the 429 the apiserver sheds load with (Retry-After: 1),
    and none of those busy answers is cached: the same token is reviewed when asked again."""
    monkeypatch.setattr(identity, "REVIEW_WAIT", 0.05)
    auth = CountingAuth(delay=0.3)
    tokens = [f"opaque-{i}" for i in range(100)]
    for token in tokens:
        auth.reviews[token] = (ADMIN, ())
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    busy = reviews("busy")
    caplog.set_level(logging.WARNING, logger="opgate.identity")
    monkeypatch.setattr(limitlog, "_last_logged", {})  # no earlier test's line holds it back
    monkeypatch.setattr(limitlog, "_suppressed", {})
    decisions = flood(check, policies, tokens)
    # one warning for the whole flood, not one per refused call
    assert len([r for r in caplog.records if "too many TokenReviews" in r.getMessage()]) == 1
    assert auth.peak == identity.REVIEWS_IN_FLIGHT
    assert decisions[:identity.REVIEWS_IN_FLIGHT] == [None] * identity.REVIEWS_IN_FLIGHT
    refused = decisions[identity.REVIEWS_IN_FLIGHT:]
    assert all(d is not None and d.decision == "throttled" for d in refused)
    status = refused[0]
    assert status is not None
    assert ("Retry-After", "1") in status.status.response_headers()
    got = ti.body(status)
    assert (got["code"], got["reason"], got["details"]) == (
        429, "TooManyRequests", {"retryAfterSeconds": 1})
    assert got["message"].startswith("opgate: too many tokens to verify at once (policy ")
    assert "opaque-" not in json.dumps(got)
    assert reviews("busy") == busy + 100 - identity.REVIEWS_IN_FLIGHT
    assert auth.calls.count("review") == identity.REVIEWS_IN_FLIGHT
    assert check._verifier._review_slots._value == identity.REVIEWS_IN_FLIGHT
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, tokens[-1])) is None
    assert auth.calls.count("review") == identity.REVIEWS_IN_FLIGHT + 1


@pytest.mark.parametrize("mode", ["open", "dryrun"])
def test_no_review_free_in_time_under_failure_open_or_dryrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(identity, "REVIEW_WAIT", 0.05)
    auth = CountingAuth(delay=0.3)
    tokens = [f"opaque-{i}" for i in range(20)]
    doc = ti.policy(failure="open") if mode == "open" else ti.policy(mode="dryrun")
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, doc)
    contexts = [ti.ctx_for(policies, "GET", CM, t) for t in tokens]

    async def calls() -> list[Any]:
        return await asyncio.gather(*(settle(check.entry(c)) for c in contexts))

    assert asyncio.run(calls())[identity.REVIEWS_IN_FLIGHT:] == [None] * 12
    assert auth.peak == identity.REVIEWS_IN_FLIGHT
    last = contexts[-1]
    assert last.identity is None  # let on unverified, as when the apiserver cannot be asked
    if mode == "dryrun":
        assert any("could not verify the caller" in v for _, v in last.response_headers)


def test_a_repeated_bad_token_costs_one_review(tmp_path: Path) -> None:
    """The same rejected token, 100 calls at once and 100 after: one TokenReview (its refusal
    is cached by digest for NEGATIVE_TTL), and every call a 401."""
    auth = CountingAuth()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    decisions = flood(check, policies, ["bad-token"] * 100)
    decisions += [ti.run(check, ti.ctx_for(policies, "GET", CM, "bad-token"))
                  for _ in range(100)]
    assert auth.calls == ["review"]
    assert {ti.body(d)["code"] for d in decisions if d is not None} == {401}
    assert None not in decisions
    [key] = check._tokens
    assert b"bad-token" not in key and check._tokens[key].identity is None


def test_a_failing_review_gives_its_slot_back(tmp_path: Path) -> None:
    auth = CountingAuth()
    auth.fail = OSError("connection refused")
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    errors = reviews("error")
    decisions = flood(check, policies, [f"opaque-{i}" for i in range(30)])
    assert {ti.body(d)["code"] for d in decisions if d is not None} == {503}
    assert reviews("error") == errors + 30
    assert check._verifier._review_slots._value == identity.REVIEWS_IN_FLIGHT
    assert auth.peak == identity.REVIEWS_IN_FLIGHT


def test_a_call_read_as_a_review_answers_waits_for_that_review(tmp_path: Path) -> None:
    """A call with the token of a TokenReview that is just answering, read in the same turn
    of the event loop (the order the real relay saw under load: the same bad token from 8
    clients made 2 TokenReviews at once, and 2 more every 10 s): the verdict left the calls
    under way before the first of them cached it, so the new call found neither and asked the
    apiserver again. It gets the verdict that was just given."""
    auth = ti.FakeAuth()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    second: list[asyncio.Future[Any]] = []

    async def go() -> list[Any]:
        loop, arrived = asyncio.get_running_loop(), asyncio.Event()
        answer = ti.FakeAuth.token_review

        async def token_review(token: str) -> tuple[Identity, tuple[str, ...]] | None:
            def arrive() -> None:  # the second call's request, read as the answer comes
                second.append(asyncio.ensure_future(
                    settle(check.entry(ti.ctx_for(policies, "GET", CM, "bad-token")))))
                arrived.set()

            if not second:
                loop.call_soon(arrive)
            return await answer(auth, token)

        auth.token_review = token_review  # type: ignore[method-assign]
        first = await settle(check.entry(ti.ctx_for(policies, "GET", CM, "bad-token")))
        await arrived.wait()
        return [first, await second[0]]

    decisions = asyncio.run(go())
    assert [ti.body(d)["code"] for d in decisions] == [401, 401]
    assert auth.calls == ["review"]
