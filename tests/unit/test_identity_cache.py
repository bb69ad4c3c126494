"""The identity middleware's token cache: its key, its hot path over the fast relay's headers,
expiry, negative answers, a new policy set, and its bound (second-chance eviction)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path
from typing import Any

import pytest

from proxy.engine.chain import settle
from proxy.engine.context import Identity, RequestContext
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import identity_tokens, identity_verify
from proxy.middlewares.identity import IdentityCheck
from proxy.relay.fast.wire import WireHeaders
from tests.unit import test_identity as ti

CM = "/api/v1/namespaces/team-a/configmaps"
ADMIN = Identity(user="admin", groups=("system:masters",), source="tokenreview")


def wire_ctx(policies: Any, value: bytes | None, method: str = "GET",
             path: str = CM) -> RequestContext:
    pairs = [(b"Host", b"h"), (b"Accept", b"application/json")]
    if value is not None:
        pairs.append((b"authorization", value))
    return RequestContext(info=parse_request_info(method, path), method=method, path=path,
                          query="", headers=WireHeaders(pairs), policies=policies)


@pytest.mark.parametrize("value", [
    b"Bearer abc", b"bearer abc", b"BEARER abc", b"  Bearer abc  ", b"Bearer  abc", b"Bearer",
    b"Bearer ", b"Basic abc", b"Bearerabc", b"", b"Bearer a b", b"\xa0Bearer abc\x85",
    b"Bearer \x1cabc\x1f", b"Bearer\tabc", b"Bearer \xe9t\xe9", b"\x0bBearer abc\x0c",
])
def test_the_bytes_token_is_the_str_token(value: bytes) -> None:
    headers = WireHeaders([(b"Authorization", value)])
    token = identity_tokens.bearer(headers)
    assert identity_tokens.bearer_bytes(headers) == (None if token is None
                                               else token.encode("latin-1"))


@pytest.mark.parametrize(("value", "token"), [
    (b"Bearer abc", b"abc"), (b" bearer abc ", b"abc"), (b"Bearer a b", b"a"),
    (b"Bearer  abc", None), (b"Bearer\tabc", None), (b"Bearer", None), (b"Bearer ", None),
    (b"Basic abc", None),
])
def test_the_token_is_the_one_the_apiserver_reads(value: bytes, token: bytes | None) -> None:
    """k8s.io/apiserver's bearertoken authenticator: TrimSpace, SplitN(" ", 3), parts[1]; an
    empty one is no token (two spaces: the apiserver runs the call as anonymous, so opgate
    must not credit it to the token after them)."""
    headers = WireHeaders([(b"Authorization", value)])
    assert identity_tokens.bearer_bytes(headers) == token
    assert identity_tokens.bearer({"Authorization": value.decode()}) == (
        None if token is None else token.decode())


def test_the_bytes_token_is_the_str_token_fuzzed() -> None:
    rnd = random.Random(7)
    alphabet = [*b" \t\r\x0b\x0c\x1c\x1f\x85\xa0\xe9Bb", *b"earERA xyz.-_"]
    for _ in range(5000):
        value = bytes(rnd.choice(alphabet) for _ in range(rnd.randrange(14)))
        for prefix in (b"", b"Bearer ", b" bEaReR"):
            headers = WireHeaders([(b"Authorization", prefix + value)])
            token = identity_tokens.bearer(headers)
            assert identity_tokens.bearer_bytes(headers) == (
                None if token is None else token.encode("latin-1")), prefix + value


def test_other_mappings_key_the_utf8_of_the_str_token() -> None:
    assert identity_tokens.bearer_bytes({"Authorization": " Bearer tok "}) == b"tok"
    assert identity_tokens.bearer_bytes({"authorization": "Bearer tok"}) == b"tok"
    assert identity_tokens.bearer_bytes({"Authorization": "Basic tok"}) is None
    assert identity_tokens.bearer_bytes({}) is None


def test_a_cached_token_over_the_fast_relays_headers(tmp_path: Path) -> None:
    auth, token = ti.FakeAuth(), ti.sa_token()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    for _ in range(3):
        ctx = wire_ctx(policies, b"Bearer " + token.encode())
        assert ti.run(check, ctx) is None
        assert ctx.identity is not None and ctx.identity.user == "system:serviceaccount:ops:op"
    for value in (None, b"Bearer ", b"Basic " + token.encode()):
        decision = ti.run(check, wire_ctx(policies, value))
        assert decision is not None and ti.body(decision)["code"] == 401
        assert "no bearer token" in ti.body(decision)["message"]
    denied = ti.run(check, wire_ctx(policies, b"Bearer " + token.encode(), "POST",
                                     "/api/v1/namespaces/prod/configmaps"))
    assert denied is not None and ti.body(denied)["code"] == 403
    assert auth.calls == ["keys k1"]
    [key] = check._tokens
    assert token.encode() not in key and len(key) == 32  # a digest, never the token
    assert key == hashlib.blake2b(token.encode(), digest_size=32).digest()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(identity_verify.time, "monotonic", clock)
    return clock


def opaque(auth: ti.FakeAuth, *names: str) -> None:
    for name in names:
        auth.reviews[name] = (ADMIN, ())


def test_a_cached_token_expires_on_the_memo_path(tmp_path: Path, clock: Clock) -> None:
    auth = ti.FakeAuth()
    opaque(auth, "tok")
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    for _ in range(2):
        assert ti.run(check, ti.ctx_for(policies, "GET", CM, "tok")) is None
    assert auth.calls == ["review"]
    clock.now += identity_verify.TOKEN_TTL - 1
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, "tok")) is None
    assert auth.calls == ["review"]
    clock.now += 1
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, "tok")) is None
    assert auth.calls == ["review", "review"]


def test_a_rejected_token_is_asked_again_after_the_negative_ttl(tmp_path: Path,
                                                                  clock: Clock) -> None:
    auth = ti.FakeAuth()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    for _ in range(2):
        decision = ti.run(check, ti.ctx_for(policies, "GET", CM, "nope"))
        assert decision is not None and ti.body(decision)["code"] == 401
    assert auth.calls == ["review"]
    clock.now += identity_verify.NEGATIVE_TTL
    opaque(auth, "nope")  # the apiserver accepts it now
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, "nope")) is None
    assert auth.calls == ["review", "review"]


def test_a_new_policy_set_verifies_again(tmp_path: Path) -> None:
    auth = ti.FakeAuth()
    opaque(auth, "tok")
    check = IdentityCheck(authenticator=auth)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ti.policy_set(tmp_path / "a", ti.policy())
    second = ti.policy_set(tmp_path / "b", ti.policy())
    for policies in (first, first, second, second):
        assert ti.run(check, ti.ctx_for(policies, "GET", CM, "tok")) is None
    assert auth.calls == ["review", "review"]


def test_the_cache_is_bounded_and_keeps_a_token_in_use(tmp_path: Path) -> None:
    auth = ti.FakeAuth()
    cold = [f"cold-{i}" for i in range(40)]
    opaque(auth, "hot", *cold)
    check = IdentityCheck(authenticator=auth, cache_size=4)
    policies = ti.policy_set(tmp_path, ti.policy())
    for name in cold:
        for token in ("hot", name):
            assert ti.run(check, ti.ctx_for(policies, "GET", CM, token)) is None
        assert len(check._tokens) <= 4
    assert auth.calls.count("review") == 41  # "hot" once: every pass over it found it used
    # a token nobody uses any more goes first, however recently it was verified
    for name in cold[-3:]:
        assert ti.run(check, ti.ctx_for(policies, "GET", CM, name)) is None
    assert auth.calls.count("review") == 41


def test_an_unused_token_is_evicted_oldest_first(tmp_path: Path) -> None:
    auth = ti.FakeAuth()
    names = [f"t{i}" for i in range(6)]
    opaque(auth, *names)
    check = IdentityCheck(authenticator=auth, cache_size=3)
    policies = ti.policy_set(tmp_path, ti.policy())
    for name in names:
        assert ti.run(check, ti.ctx_for(policies, "GET", CM, name)) is None
    assert len(check._tokens) == 3
    for name in names[-3:]:  # still cached
        assert ti.run(check, ti.ctx_for(policies, "GET", CM, name)) is None
    assert auth.calls.count("review") == 6
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, names[0])) is None
    assert auth.calls.count("review") == 7


def test_concurrent_first_calls_verify_once_over_wire_headers(tmp_path: Path) -> None:
    auth, token = ti.FakeAuth(), ti.sa_token()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())

    async def calls() -> None:
        await asyncio.gather(*(check.entry(wire_ctx(policies, b"Bearer " + token.encode()))
                               for _ in range(5)))

    asyncio.run(calls())
    assert auth.calls == ["keys k1"]


def test_a_verdict_under_way_at_a_reload_is_not_kept_for_the_new_set(tmp_path: Path) -> None:
    """A token whose verification began under the set in force before a reload (its claim
    mappings, say) is verified again under the new one, not answered from that verdict."""
    auth = ti.FakeAuth()
    opaque(auth, "tok")
    opaque(auth, "other")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ti.policy_set(tmp_path / "a", ti.policy())
    second = ti.policy_set(tmp_path / "b", ti.policy())
    check = IdentityCheck(authenticator=auth)

    async def go() -> None:
        release, begun = asyncio.Event(), asyncio.Event()
        review = auth.token_review

        async def slow_review(token: str) -> Any:
            if token == "tok" and not release.is_set():
                begun.set()
                await release.wait()
            return await review(token)

        auth.token_review = slow_review  # type: ignore[method-assign]
        under_way = asyncio.ensure_future(settle(check.entry(
            ti.ctx_for(first, "GET", CM, "tok"))))
        await asyncio.wait_for(begun.wait(), 10)
        assert await settle(check.entry(ti.ctx_for(second, "GET", CM, "other"))) is None
        release.set()
        assert await under_way is None
        assert await settle(check.entry(ti.ctx_for(second, "GET", CM, "tok"))) is None

    asyncio.run(go())
    assert auth.calls == ["review", "review", "review"]
