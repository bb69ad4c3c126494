"""Decisions remembered per (policy set, call shape, user) answer exactly as working them out.

Each middleware remembers what depends only on the call's shape (verbs, group, resource,
subresource, namespace) and its user; these tests repeat calls so that the remembered answer is
the one used, and change what it must not hide: the object name, the user, the policy set, a
token's expiry, a dryrun policy's warning, a SubjectAccessReview.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.engine.chain import settle
from proxy.engine.context import Deny, Identity, RequestContext
from proxy.engine.policies import EMPTY
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import accesslog as accesslog_mod
from proxy.middlewares import identity as identity_mod
from proxy.middlewares import identity_verify
from proxy.middlewares.accesslog import AccessLog
from proxy.middlewares.faults import Faults
from proxy.middlewares.identity import IdentityCheck
from proxy.middlewares.metrics import Metrics
from proxy.middlewares.ratelimit import RateLimit
from proxy.stores.memory import MemoryStore
from tests.unit import test_faults as tf
from tests.unit import test_identity as ti
from tests.unit import test_ratelimit as tr
from tests.unit.test_metrics_accesslog import _count

CM = "/api/v1/namespaces/team-a/configmaps"


def test_scoped_middlewares_do_nothing_without_their_section() -> None:
    """What ``sections`` promises the chain (it then skips their entry hooks)."""
    auth = ti.FakeAuth()
    for mw in (IdentityCheck(authenticator=auth), Faults(), RateLimit(store=MemoryStore())):
        ctx = RequestContext(info=parse_request_info("POST", CM), method="POST", path=CM,
                             query="", headers={}, policies=EMPTY)
        assert mw.sections and asyncio.run(settle(mw.entry(ctx))) is None
        assert (ctx.response_headers, ctx.identity, ctx.decision) == ([], None, "allowed")
    assert auth.calls == []


# --- identity ------------------------------------------------------------------------------


def test_identity_remembers_allowed_shapes_but_not_denials(tmp_path: Path) -> None:
    auth, token = ti.FakeAuth(), ti.sa_token()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    for _ in range(3):
        ctx = ti.ctx_for(policies, "GET", CM + "/a", token)
        assert ti.run(check, ctx) is None
        assert ctx.identity is not None and ctx.identity.user == "system:serviceaccount:ops:op"
        denied = ti.run(check, ti.ctx_for(policies, "POST", "/api/v1/namespaces/prod/configmaps",
                                          token))
        assert denied is not None and denied.decision == "denied"
    ctx = ti.ctx_for(policies, "GET", CM + "/b", token)  # another name, the same shape
    assert ti.run(check, ctx) is None and ctx.identity is not None
    assert ti.run(check, ti.ctx_for(policies, "GET", CM, None)) is not None  # no token: 401
    assert auth.calls == ["keys k1"]


def test_identity_forgets_allowed_shapes_with_the_policy_set(tmp_path: Path) -> None:
    auth, token = ti.FakeAuth(), ti.sa_token()
    check = IdentityCheck(authenticator=auth)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    loose = ti.policy_set(tmp_path / "a", ti.policy())
    reads = '      - {verbs: [get, list, watch], resources: ["*"]}\n'
    assert reads in ti.policy()
    strict = ti.policy_set(tmp_path / "b", ti.policy().replace(reads, ""))
    assert ti.run(check, ti.ctx_for(loose, "GET", CM + "/c", token)) is None
    assert ti.run(check, ti.ctx_for(loose, "GET", CM + "/c", token)) is None
    decision = ti.run(check, ti.ctx_for(strict, "GET", CM + "/c", token))
    assert decision is not None and "no rule" in ti.body(decision)["message"]


def test_identity_dryrun_warns_on_every_call(tmp_path: Path) -> None:
    token = ti.sa_token()
    check = IdentityCheck(authenticator=ti.FakeAuth())
    policies = ti.policy_set(tmp_path, ti.policy(mode="dryrun"))
    for _ in range(3):
        ctx = ti.ctx_for(policies, "POST", "/api/v1/namespaces/prod/configmaps", token)
        assert ti.run(check, ctx) is None
        [(name, value)] = ctx.response_headers
        assert name == "Warning" and "would deny (dryrun)" in value


def test_identity_asks_subject_access_review_per_object(tmp_path: Path) -> None:
    auth, token = ti.FakeAuth(), ti.sa_token()
    check = IdentityCheck(authenticator=auth)
    policies = ti.policy_set(tmp_path, ti.policy(sar=True))
    assert ti.run(check, ti.ctx_for(policies, "GET", CM + "/one", token)) is None
    auth.sar = (False, "no RBAC policy matched")
    decision = ti.run(check, ti.ctx_for(policies, "GET", CM + "/two", token))
    assert decision is not None and "the apiserver denies it" in ti.body(decision)["message"]
    assert auth.calls.count("sar") == 2


class _Clock:
    """``time.time`` and ``time.monotonic`` for the identity module, moved by hand."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def test_identity_verifies_again_once_a_token_expires(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified token is remembered until it stops being accepted (its exp plus the leeway
    it was verified with), then verified again: and refused, being expired."""
    clock = _Clock()
    monkeypatch.setattr(identity_mod, "time", clock)  # the cache's clock
    monkeypatch.setattr(identity_verify, "time", clock)  # the verdict's expiry, the claims' now
    auth = ti.FakeAuth()
    token = ti.sa_token(exp_in=10)
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    call = ti.ctx_for(policies, "GET", CM + "/c", token)
    assert ti.run(check, call) is None
    clock.advance(10 + identity_verify.LEEWAY - 3)  # past exp, within the leeway: remembered
    assert ti.run(check, ti.ctx_for(policies, "GET", CM + "/c", token)) is None
    assert auth.calls == ["keys k1"]
    clock.advance(5)
    decision = ti.run(check, ti.ctx_for(policies, "GET", CM + "/c", token))
    assert decision is not None and ti.body(decision)["code"] == 401
    assert auth.calls == ["keys k1"] * 2


@pytest.mark.parametrize("token", ["opaque", "one.dot", "a.b.c.d"])
def test_identity_tokens_that_are_no_jwt_go_to_tokenreview(tmp_path: Path, token: str) -> None:
    auth = ti.FakeAuth()
    admin = Identity(user="admin", groups=("system:masters",), source="tokenreview")
    auth.reviews[token] = (admin, ())
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    for _ in range(2):
        ctx = ti.ctx_for(policies, "GET", CM, token)
        assert ti.run(check, ctx) is None and ctx.identity == admin
    assert auth.calls == ["review"]


# --- faults --------------------------------------------------------------------------------

USERS_FAULT = """\
  identity:
    allow: [{group: system:authenticated}]
    rules: [{verbs: ['*'], resources: ['*']}]
  faults:
    - name: alice-conflicts
      match: {verbs: [update], resources: [widgets], users: [alice]}
      respond: {code: 409}
"""


def test_faults_match_per_user_and_policy_set(tmp_path: Path) -> None:
    mw = Faults()
    pset = tf.policies(tmp_path, USERS_FAULT)

    def fire(user: str, policies: Any = pset, path: str = tf.WIDGET) -> bool:
        ctx = tf.ctx_for(policies, "PUT", path)
        ctx.identity = Identity(user=user) if user else None
        return isinstance(asyncio.run(settle(mw.entry(ctx))), Deny)

    for _ in range(2):
        assert fire("alice") and not fire("bob") and not fire("")
        assert fire("alice", path=tf.WIDGET + "-2")
    assert not fire("alice", tf.policies(tmp_path, USERS_FAULT.replace("alice]", "carol]")))
    assert fire("alice")


def test_faults_roll_the_dice_on_every_call(tmp_path: Path) -> None:
    rolls = iter([0.9, 0.1, 0.9, 0.1])
    mw = Faults(rng=lambda: next(rolls))
    body = tf.CONFLICTS.replace("respond:", "probability: 0.5\n      respond:")
    pset = tf.policies(tmp_path, body)
    fired = [isinstance(asyncio.run(settle(mw.entry(tf.ctx_for(pset, "PUT", tf.WIDGET)))), Deny)
             for _ in range(4)]
    assert fired == [False, True, False, True]


def test_faults_on_every_resource_fire_on_discovery_and_no_other_path(tmp_path: Path) -> None:
    # one fault on every resource: discovery is about them (RBAC's system:discovery), /metrics
    # is not; a GET of either is one shape but for the discovery flag, so the memo keeps apart
    pset = tf.policies(tmp_path, "  faults:\n    - match: {verbs: [get], resources: ['*']}\n"
                                 "      respond: {code: 503}\n")
    mw = Faults()

    def fires(path: str) -> bool:
        return isinstance(asyncio.run(settle(mw.entry(tf.ctx_for(pset, "GET", path)))), Deny)

    for _ in range(2):
        assert [fires(p) for p in ("/api", "/metrics", "/apis/apps/v1", "/logs/", "/version",
                                   "/healthz", "/openapi/v3")] == [
            True, False, True, False, True, False, True]


# --- rate limits ---------------------------------------------------------------------------


def test_ratelimit_keys_with_a_name_or_user_keep_their_own_buckets() -> None:
    pset = tr.policies("""
- {name: per-object, match: {resources: [pods]}, key: "{namespace}/{name}", qps: 0.001, burst: 1}
- {name: per-user, match: {resources: [secrets]}, key: "{user}", qps: 0.001, burst: 1}
""")
    mw, store = tr.make()

    async def go(path: str, user: str = "alice") -> Any:
        return await settle(mw.entry(tr.ctx_for(pset, path=path, user=user)))

    async def calls() -> list[bool]:
        return [await go("/api/v1/namespaces/a/pods/p") is None,
                await go("/api/v1/namespaces/a/pods/q") is None,  # the same shape, another name
                await go("/api/v1/namespaces/a/pods/p") is None,
                await go("/api/v1/namespaces/a/secrets/s") is None,
                await go("/api/v1/namespaces/a/secrets/s", "bob") is None,
                await go("/api/v1/namespaces/a/secrets/t") is None]

    assert asyncio.run(calls()) == [True, True, False, True, True, False]
    assert store.calls == 6


def test_ratelimit_on_every_resource_spends_on_discovery_only() -> None:
    pset = tr.policies("- {name: reads, match: {verbs: [get], resources: ['*']}, qps: 0.001, "
                       "burst: 1}")
    mw, _ = tr.make()

    async def calls() -> list[bool]:
        return [await settle(mw.entry(tr.ctx_for(pset, path=path))) is None
                for path in ("/api", "/metrics", "/apis", "/metrics", "/logs/")]

    assert asyncio.run(calls()) == [True, True, False, True, True]


def test_ratelimit_dryrun_rules_warn_on_every_call() -> None:
    pset = tr.policies("""
- {name: enforced, match: {verbs: [get]}, qps: 1000, burst: 1000}
- {name: watched, match: {verbs: [get]}, mode: dryrun, qps: 0.001, burst: 1}
""")
    mw, _ = tr.make()

    async def calls() -> list[list[str]]:
        out = []
        for _ in range(3):
            ctx = tr.ctx_for(pset)
            assert await settle(mw.entry(ctx)) is None
            out.append([v for k, v in ctx.response_headers if k == "Warning"])
        return out

    first, second, third = asyncio.run(calls())
    assert first == [] and len(second) == 1 and len(third) == 1
    assert 'rate limit \\"watched\\"' in second[0]


def test_ratelimit_follows_the_policy_set() -> None:
    mw, _ = tr.make()
    tight = tr.policies("- {name: a, match: {verbs: [get]}, qps: 0.001, burst: 1}")
    other = tr.policies("- {name: a, match: {verbs: [list]}, qps: 0.001, burst: 1}")

    async def calls() -> list[bool]:
        return [await settle(mw.entry(tr.ctx_for(tight))) is None,
                await settle(mw.entry(tr.ctx_for(tight))) is None,
                await settle(mw.entry(tr.ctx_for(other))) is None,
                await settle(mw.entry(tr.ctx_for(tight))) is None]

    assert asyncio.run(calls()) == [True, False, True, False]


# --- metrics and the access log ------------------------------------------------------------


def test_metrics_series_per_code_and_decision_and_no_duration_for_watches() -> None:
    m = Metrics()
    labels = dict(verb="get", group="", resource="configmaps", decision="allowed")
    before = {code: _count(**labels, code=code) for code in ("200", "404")}
    for code in (200, 404, 200):
        ctx = tr.ctx_for(EMPTY, path=CM + "/c")
        ctx.status_code = code
        asyncio.run(settle(m.exit(ctx)))
    assert _count(**labels, code="200") == before["200"] + 2
    assert _count(**labels, code="404") == before["404"] + 1
    watch = tr.ctx_for(EMPTY, path=CM, query="watch=1")
    watch.status_code = 200
    (_counter, duration), _final = m._lookup(watch)
    assert duration is None


def test_access_log_lines_per_call_with_fields_escaped_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(accesslog_mod, "MEMO_SIZE", 2)
    log = AccessLog()
    names = ["a", 'we"ird', "b", "a", "c", 'we"ird']
    for name in names:
        ctx = tr.ctx_for(EMPTY, path=f"{CM}/{name}")
        ctx.status_code = 200
        line = json.loads(log.line(ctx))
        assert (line["name"], line["namespace"], line["resource"]) == (name, "team-a",
                                                                       "configmaps")
        assert line["user"] == "alice" and line["verb"] == "get"
    assert len(log._parts) <= 2


def test_access_log_writer_gets_the_line_the_logger_would() -> None:
    import io

    from proxy.middlewares.accesslog import AccessWriter

    out = io.StringIO()
    log = AccessLog(writer=AccessWriter(out))
    ctx = tr.ctx_for(EMPTY, path=f"{CM}/x")
    ctx.status_code, ctx.error = 503, "upstream refused"
    ctx.finished = ctx.started + 0.0123
    asyncio.run(settle(log.exit(ctx)))
    log._writer.close()  # type: ignore[union-attr]
    assert out.getvalue() == log.line(ctx) + "\n"
    assert json.loads(out.getvalue())["error"] == "upstream refused"
