"""The rate-limit middleware over the in-process store: responses, modes, matching, waiting."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest

from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Deny, Identity, RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares.ratelimit import MemoryInstanceOverrides, RateLimit, parse_section
from proxy.stores.base import BucketRequest, StoreUnavailable, Verdict
from proxy.stores.breaker import ResilientStore
from proxy.stores.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policies(rules: str, *, mode: str = "enforce", failure: str = "closed",
             name: str = "op") -> PolicySet:
    indented = "\n".join("    " + line for line in rules.strip("\n").splitlines())
    doc = (f"apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {{name: {name}}}\n"
           f"spec:\n  mode: {mode}\n  failure: {failure}\n  rateLimits:\n{indented}\n")
    return build_policy_set([("rl.yaml", doc.encode())], parsers={"rateLimits": parse_section})


def ctx_for(pset: PolicySet, method: str = "GET", path: str = "/api/v1/namespaces/a/pods/p",
            query: str = "", *, user: str = "alice", headers: dict[str, str] | None = None,
            ) -> RequestContext:
    return RequestContext(info=parse_request_info(method, path, query), method=method, path=path,
                          query=query, headers=headers or {}, policies=pset,
                          identity=Identity(user=user) if user else None)


def decisions(policy: str, result: str) -> float:
    value = telemetry.REGISTRY.get_sample_value(
        "opgate_ratelimit_decisions_total", {"policy": policy, "result": result})
    return value or 0.0


def headers_of(ctx: RequestContext) -> dict[str, str]:
    return dict(ctx.response_headers)


def make(clock: Clock | None = None, **kw: Any) -> tuple[RateLimit, MemoryStore]:
    store = MemoryStore(clock=clock or Clock())
    return RateLimit(store=store, **kw), store


def test_429_status_shape_and_headers() -> None:
    pset = policies("- {name: reads, match: {verbs: [get]}, qps: 0.5, burst: 2}", name="shape")
    mw, _ = make()
    before = decisions("shape", "denied")

    async def go() -> list[Any]:
        return [await settle(mw.entry(c)) for c in [ctx_for(pset) for _ in range(3)]]

    first, second, third = asyncio.run(go())
    assert first is None and second is None
    assert isinstance(third, Deny) and third.decision == "throttled"
    status = third.status
    assert status.code == 429 and status.reason == "TooManyRequests"
    body = json.loads(status.body())
    assert body["kind"] == "Status" and body["code"] == 429
    assert body["details"] == {"retryAfterSeconds": 2}
    assert 'rate limit "reads" of policy "shape" (rl.yaml:' in body["message"]
    headers = dict(status.response_headers())
    assert headers["Retry-After"] == "2"
    assert headers["RateLimit-Limit"] == "2"
    assert headers["RateLimit-Remaining"] == "0"
    assert headers["RateLimit-Reset"] == "2"
    assert decisions("shape", "denied") == before + 1


def test_admitted_calls_get_ratelimit_headers() -> None:
    pset = policies("- {name: r, qps: 10, burst: 5}")
    mw, _ = make()
    ctx = ctx_for(pset)
    assert asyncio.run(settle(mw.entry(ctx))) is None
    assert headers_of(ctx) == {"RateLimit-Limit": "5", "RateLimit-Remaining": "4",
                               "RateLimit-Reset": "1"}


def test_no_matching_rule_makes_no_store_call() -> None:
    pset = policies("- {name: w, match: {verbs: [create]}, qps: 1}")
    mw, store = make()
    for _ in range(5):
        ctx = ctx_for(pset)
        assert asyncio.run(settle(mw.entry(ctx))) is None
        assert ctx.response_headers == []
    assert store.calls == 0
    empty = build_policy_set([], parsers={"rateLimits": parse_section})
    assert asyncio.run(settle(mw.entry(ctx_for(empty)))) is None and store.calls == 0


@pytest.mark.parametrize("where", ["policy", "rule", "policy-over-rule"])
def test_dryrun_warns_counts_and_never_denies(where: str) -> None:
    # a rule's own mode: dryrun trials it in an enforce policy; in a dryrun policy, which never
    # denies (DESIGN), a rule's mode: enforce does not make it deny either
    own = {"policy": "", "rule": ", mode: dryrun", "policy-over-rule": ", mode: enforce"}[where]
    rule = "- {name: dr, qps: 1, burst: 1" + own + "}"
    pset = policies(rule, mode="enforce" if where == "rule" else "dryrun", name=f"dry-{where}")
    mw, _ = make()
    dry_before = telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "ratelimit"}) or 0.0
    contexts = [ctx_for(pset) for _ in range(3)]
    for ctx in contexts:
        assert asyncio.run(settle(mw.entry(ctx))) is None
    assert not any(name == "Warning" for name, _ in contexts[0].response_headers)
    for ctx in contexts[1:]:
        warnings = [v for name, v in ctx.response_headers if name == "Warning"]
        assert len(warnings) == 1
        assert warnings[0].startswith('299 - "opgate: rate limit \\"dr\\"')
        assert "would reject this call (dryrun)" in warnings[0]
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "ratelimit"}) == dry_before + 2
    assert decisions(f"dry-{where}", "dryrun") == 2


@pytest.mark.parametrize(("qps", "said"), [
    # the next token 0.5 s away, within maxWait: enforce would hold the call, then let it on
    ("2", 'would delay this call (dryrun): 2 requests/s, burst 1; onExceed: wait, the next token '
          "in 0.5s (maxWait 2s)"),
    # 10 s away, past maxWait: enforce would answer the 429 (at once: the wait cannot succeed)
    ("0.1", "would reject this call (dryrun): 0.1 requests/s, burst 1, retry after 10s "
            "(onExceed: wait, but the next token is 10s away, past maxWait 2s)"),
])
def test_dryrun_of_a_wait_rule_says_what_enforce_would_do(qps: str, said: str) -> None:
    # it said "would reject this call" for a wait rule whose enforce only delays the call
    pset = policies("- {name: w, qps: " + qps + ", burst: 1, onExceed: wait, maxWait: 2s}",
                    mode="dryrun", name=f"dry-wait-{qps}")
    mw, _ = make()
    dry_before = telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "ratelimit"}) or 0.0
    first, second = ctx_for(pset), ctx_for(pset)
    assert asyncio.run(settle(mw.entry(first))) is None
    assert asyncio.run(settle(mw.entry(second))) is None
    warnings = [v for name, v in second.response_headers if name == "Warning"]
    assert warnings == ['299 - "opgate: rate limit \\"w\\" of policy \\"dry-wait-' + qps
                        + '\\" ' + said.replace('"', '\\"') + '"'], warnings
    rejects = qps == "0.1"  # only a would-be 429 is a would-be denial
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "ratelimit"}) == dry_before + rejects
    assert decisions(f"dry-wait-{qps}", "dryrun") == rejects


def test_dryrun_rule_does_not_block_enforced_rule() -> None:
    pset = policies("""
- {name: enforced, qps: 1, burst: 3}
- {name: trial, qps: 1, burst: 1, mode: dryrun}
""")
    mw, _ = make()
    results = [asyncio.run(settle(mw.entry(ctx_for(pset)))) for _ in range(4)]
    assert [r is None for r in results] == [True, True, True, False]


def test_watch_counts_once_and_is_not_excluded() -> None:
    pset = policies("- {name: watches, match: {verbs: [watch]}, qps: 1, burst: 2}")
    mw, store = make()
    ctx = ctx_for(pset, "GET", "/api/v1/namespaces/a/pods", "watch=true")
    assert ctx.info.verb == "watch" and ctx.info.is_long_running
    assert asyncio.run(settle(mw.entry(ctx))) is None
    assert store.calls == 1
    assert headers_of(ctx)["RateLimit-Remaining"] == "1"  # one token for the whole watch
    assert not hasattr(mw, "exit")  # nothing counts per event or at the end of the stream


@pytest.mark.parametrize("method, path, query", [
    ("POST", "/api/v1/namespaces/a/pods/p/exec", "command=ls"),
    ("GET", "/api/v1/namespaces/a/pods/p/exec", "command=ls"),  # WebSocket exec
    ("POST", "/api/v1/namespaces/a/pods/p/attach", ""),
    ("POST", "/api/v1/namespaces/a/pods/p/portforward", ""),
    ("GET", "/api/v1/namespaces/a/pods/p/log", "follow=true"),
])
def test_long_running_calls_excluded_unless_named(method: str, path: str, query: str) -> None:
    wide = policies("- {name: all, qps: 1, burst: 1}")
    mw, store = make()
    for _ in range(3):
        assert asyncio.run(settle(mw.entry(ctx_for(wide, method, path, query)))) is None
    assert store.calls == 0
    sub = path.rsplit("/", 1)[1]
    named = policies(f"- {{name: conn, match: {{resources: [pods/{sub}]}}, qps: 1, burst: 1}}")
    assert asyncio.run(settle(mw.entry(ctx_for(named, method, path, query)))) is None
    assert isinstance(asyncio.run(settle(mw.entry(ctx_for(named, method, path, query)))), Deny)


def test_all_matching_rules_must_pass_atomically() -> None:
    pset = policies("""
- {name: wide, match: {verbs: [get, list]}, qps: 1, burst: 5}
- {name: narrow, match: {verbs: [get]}, qps: 1, burst: 1}
""")
    mw, store = make()
    assert asyncio.run(settle(mw.entry(ctx_for(pset)))) is None
    denied = asyncio.run(settle(mw.entry(ctx_for(pset))))
    assert isinstance(denied, Deny) and '"narrow"' in denied.status.message
    assert store.calls == 2  # both rules in one store call each time
    listing = ctx_for(pset, "GET", "/api/v1/namespaces/a/pods")  # only "wide" matches a list
    assert asyncio.run(settle(mw.entry(listing))) is None
    assert headers_of(listing)["RateLimit-Remaining"] == "3"  # the denied call took nothing


def test_key_template_separates_buckets() -> None:
    pset = policies("- {name: per-ns, key: '{namespace}/{resource}', qps: 1, burst: 1}")
    mw, store = make()
    def entry(path: str) -> object:
        return asyncio.run(settle(mw.entry(ctx_for(pset, path=path))))

    assert entry("/api/v1/namespaces/a/pods/p") is None
    assert entry("/api/v1/namespaces/b/pods/p") is None
    assert entry("/api/v1/namespaces/a/configmaps/c") is None
    assert isinstance(entry("/api/v1/namespaces/a/pods/q"), Deny)
    assert sorted(store._tats) == ["op/per-ns/a/configmaps", "op/per-ns/a/pods", "op/per-ns/b/pods"]


@pytest.mark.parametrize(("key", "calls"), [
    # a namespace and a name are DNS names: both may hold the template's "-"
    ("{namespace}-{name}", [("alice", "a-b", "c"), ("alice", "a", "b-c")]),
    # placeholders side by side: the same text, split in two places
    ("{namespace}{name}", [("alice", "ab", "c"), ("alice", "a", "bc")]),
    # a user name (an OIDC issuer's, a ServiceAccount's) and an object's name may hold "."
    ("{user}.{name}", [("bob.smith", "ns", "x"), ("bob", "ns", "smith.x")]),
], ids=["dash", "side-by-side", "dot"])
def test_calls_that_differ_never_share_a_bucket(
        key: str, calls: list[tuple[str, str, str]]) -> None:
    """A bucket is one caller's (or object's): two calls whose values differ get two buckets,
    whatever characters the values hold. They shared one when a value held the template's own
    text ("a-b"+"c" and "a"+"b-c" both rendered "a-b-c"): one caller spent another's tokens."""
    pset = policies(f"- {{name: k, key: '{key}', qps: 1, burst: 1}}")
    mw, store = make()
    for user, namespace, name in calls:
        ctx = ctx_for(pset, path=f"/api/v1/namespaces/{namespace}/pods/{name}", user=user)
        assert asyncio.run(settle(mw.entry(ctx))) is None, (user, namespace, name)
    assert len(store._tats) == 2


class Recording(MemoryStore):
    def __init__(self) -> None:
        super().__init__(clock=Clock())
        self.seen: list[list[BucketRequest]] = []

    async def acquire(self, requests: Sequence[BucketRequest], now: float | None = None) -> Verdict:
        self.seen.append(list(requests))
        return await super().acquire(requests, now)


def test_instance_header_annotation_override_and_shards() -> None:
    pset = policies("""
- name: per-instance
  key: "{user}/{instance}"
  qps: 2
  burst: 1
  instanceAnnotation: opgate.dev/qps
  maxQps: 5
""")
    overrides = MemoryInstanceOverrides()
    overrides.set("a", "Widget", "slow", {"opgate.dev/qps": "0.5"})
    overrides.set("a", "Widget", "greedy", {"opgate.dev/qps": "100"})
    overrides.set("a", "Widget", "bad", {"opgate.dev/qps": "fast"})
    # below what a bucket can hold (Redis refused its expiry: the breaker tripped for everyone)
    overrides.set("a", "Widget", "tiny", {"opgate.dev/qps": "1e-300"})
    store = Recording()
    mw = RateLimit(store=store, overrides=overrides)
    for instance in ("a/Widget/slow", "a/Widget/greedy", "a/Widget/bad", "a/Widget/tiny",
                     "a/Widget/none"):
        ctx = ctx_for(pset, headers={"Opgate-Instance": instance})
        assert asyncio.run(settle(mw.entry(ctx))) is None
        assert "opgate-instance" in ctx.drop_request_headers
    asyncio.run(settle(mw.entry(ctx_for(pset, headers={"Opgate-Instance": "not-an-instance"}))))
    asyncio.run(settle(mw.entry(ctx_for(pset, user=""))))
    seen = [call[0] for call in store.seen]
    assert [(r.key, r.rate) for r in seen] == [
        ("op/per-instance/alice/a%2FWidget%2Fslow", 0.5),
        ("op/per-instance/alice/a%2FWidget%2Fgreedy", 5.0),  # bounded by maxQps
        ("op/per-instance/alice/a%2FWidget%2Fbad", 2.0),
        ("op/per-instance/alice/a%2FWidget%2Ftiny", 2.0),  # ignored, as "fast" is
        ("op/per-instance/alice/a%2FWidget%2Fnone", 2.0),
        ("op/per-instance/alice/-", 2.0),
        ("op/per-instance/-/-", 2.0),
    ]
    assert [r.shard for r in seen] == ["alice"] * 6 + ["-"]


@pytest.mark.parametrize("mode", ["enforce", "dryrun"])
def test_a_429_names_the_qps_the_instance_got(mode: str) -> None:
    """An instance annotated down to 0.5/s is throttled at 0.5/s: its 429 (or dryrun warning)
    must say so, not the rule's 2/s, which the caller never reached."""
    pset = policies("""
- name: per-instance
  key: "{instance}"
  qps: 2
  burst: 1
  instanceAnnotation: opgate.dev/qps
""", mode=mode)
    overrides = MemoryInstanceOverrides()
    overrides.set("a", "Widget", "slow", {"opgate.dev/qps": "0.5"})
    mw, _ = make(overrides=overrides)
    calls = [ctx_for(pset, headers={"Opgate-Instance": "a/Widget/slow"}) for _ in range(2)]
    results = [asyncio.run(settle(mw.entry(c))) for c in calls]
    if mode == "enforce":
        denied = results[1]
        assert isinstance(denied, Deny), results
        text = denied.status.message
        assert dict(denied.status.headers)["Retry-After"] == "2"
    else:
        assert results == [None, None]
        text = " ".join(v for k, v in calls[1].response_headers if k == "Warning")
    assert "0.5 requests/s" in text and "2 requests/s" not in text, text


def test_instance_without_header_gets_its_own_qps() -> None:
    """The ownerReference of a JSON create, and the object itself, find the annotated qps."""
    pset = policies("""
- name: per-instance
  key: "{instance}"
  qps: 1
  burst: 5
  instanceAnnotation: opgate.dev/qps
  maxQps: 10
""")
    overrides = MemoryInstanceOverrides()
    overrides.watch("demo.opgate.dev", "widgets", "Widget")
    overrides.set("a", "Widget", "w1", {"opgate.dev/qps": "20"})
    store = Recording()
    mw = RateLimit(store=store, overrides=overrides)
    owned = json.dumps({"metadata": {"name": "cm", "ownerReferences": [
        {"kind": "Widget", "name": "w1", "controller": True}]}}).encode()
    create = ctx_for(pset, "POST", "/api/v1/namespaces/a/configmaps",
                     headers={"Content-Type": "application/json"})
    assert mw.wants_body(create)
    create.body = owned
    itself = ctx_for(pset, "PUT", "/apis/demo.opgate.dev/v1/namespaces/a/widgets/w1/status",
                     headers={"Content-Type": "application/vnd.kubernetes.protobuf"})
    assert not mw.wants_body(itself)
    for ctx in (create, itself, ctx_for(pset)):
        assert asyncio.run(settle(mw.entry(ctx))) is None
    assert [(c[0].key, c[0].rate) for c in store.seen] == [
        ("op/per-instance/a/Widget/w1", 10.0), ("op/per-instance/a/Widget/w1", 10.0),
        ("op/per-instance/-", 1.0)]


def test_one_flooding_instance_does_not_slow_another() -> None:
    pset = policies("- {name: inst, key: '{instance}', qps: 5, burst: 5}")
    clock = Clock()
    mw, _ = make(clock)
    admitted = {"a/W/flood": 0, "a/W/calm": 0}
    for step in range(100):  # 10 s in 0.1 s steps: flood sends 20 per step, calm 1 per step
        clock.now += 0.1
        for instance, count in (("a/W/flood", 20), ("a/W/calm", 1 if step % 2 else 0)):
            for _ in range(count):
                ctx = ctx_for(pset, headers={"Opgate-Instance": instance})
                admitted[instance] += asyncio.run(settle(mw.entry(ctx))) is None
    assert admitted["a/W/calm"] == 50
    assert 5 + 5 * 10 - 2 <= admitted["a/W/flood"] <= 5 + 5 * 10


def test_wait_mode_queues_fifo_then_rejects_past_max_wait() -> None:
    pset = policies("- {name: w, qps: 20, burst: 2, onExceed: wait, maxWait: 400ms}")
    mw, _ = make(clock=time.monotonic)  # type: ignore[arg-type]

    async def call(i: int, order: list[int]) -> Any:
        result = await settle(mw.entry(ctx_for(pset)))
        if result is None:
            order.append(i)
        return result

    async def go() -> tuple[list[Any], list[int], float]:
        order: list[int] = []
        start = time.monotonic()
        results = await asyncio.gather(*(call(i, order) for i in range(16)))
        return results, order, time.monotonic() - start

    results, order, elapsed = asyncio.run(go())
    admitted = [r is None for r in results]
    # 2 at once, then one per 50 ms for 400 ms: about 10 in all (fewer when a busy machine
    # wakes the waiters late: 5 leaves 200 ms for that); the rest 429 at the deadline
    assert 5 <= sum(admitted) <= 11
    assert admitted == sorted(admitted, reverse=True)  # first come, first served
    assert order == sorted(order)
    assert all(isinstance(r, Deny) and r.status.code == 429 for r in results if r is not None)
    assert elapsed < 2.0
    assert not mw._queues  # queues are dropped when empty


def test_a_waiting_call_that_a_reject_rule_then_denies_is_rejected_at_once() -> None:
    """Waiting is for the rules that say ``wait``: a call queued on its own bucket, which
    then finds a shared ``onExceed: reject`` rule empty (another caller took its last token
    meanwhile), gets that rule's 429 then, instead of waiting on for a rule that rejects."""
    pset = policies("""
- {name: per-user, key: "{user}", qps: 10, burst: 1, onExceed: wait, maxWait: 3s}
- {name: shared, key: all, qps: 1, burst: 2}
""")
    mw, _ = make(clock=time.monotonic)  # type: ignore[arg-type]

    async def go() -> tuple[Any, float]:
        assert await settle(mw.entry(ctx_for(pset))) is None
        start = time.monotonic()
        waiting = asyncio.ensure_future(settle(mw.entry(ctx_for(pset))))
        await asyncio.sleep(0)  # alice waits for her own bucket (100 ms) …
        assert not waiting.done()
        assert await settle(mw.entry(ctx_for(pset, user="bob"))) is None  # … bob empties shared
        result = await waiting
        return result, time.monotonic() - start

    result, elapsed = asyncio.run(go())
    assert isinstance(result, Deny) and result.status.code == 429, result
    assert '"shared"' in result.status.message
    assert elapsed < 0.9  # (generous) not the ~1 s until shared has a token again


def test_wait_mode_bounded_queue() -> None:
    pset = policies("- {name: w, qps: 20, burst: 1, onExceed: wait, maxWait: 1s, maxQueue: 2}")
    mw, _ = make(clock=time.monotonic)  # type: ignore[arg-type]

    async def go() -> list[Any]:
        return await asyncio.gather(*(mw.entry(ctx_for(pset)) for _ in range(5)))

    results = asyncio.run(go())
    assert [r is None for r in results] == [True, True, True, False, False]


class Down:
    backend = "redis"

    async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
        raise StoreUnavailable("connection refused")

    def health(self) -> dict[str, object]:
        return {}

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("wrapped", [False, True])
def test_store_down_open_admits_closed_answers_503(wrapped: bool) -> None:
    suffix = str(wrapped).lower()
    pset = policies("""
- {name: lenient, match: {verbs: [get]}, qps: 1, failure: open}
- {name: strict, match: {verbs: [list]}, qps: 1}
""", name=f"down-{suffix}")
    store: Any = ResilientStore(Down(), failures=1) if wrapped else Down()
    mw = RateLimit(store=store)
    assert asyncio.run(settle(mw.entry(ctx_for(pset)))) is None
    denied = asyncio.run(settle(mw.entry(ctx_for(pset, path="/api/v1/namespaces/a/pods"))))
    assert isinstance(denied, Deny) and denied.decision == "unavailable"
    assert denied.status.code == 503 and denied.status.reason == "ServiceUnavailable"
    assert '"strict"' in denied.status.message and "fails closed" in denied.status.message
    # client-go retries a 5xx only when told when: this one is over once the store is back
    assert dict(denied.status.headers)["Retry-After"] == "1"
    assert denied.status.details == {"retryAfterSeconds": 1}
    assert decisions(f"down-{suffix}", "unavailable") == 1
    dry = policies("- {name: strict, qps: 1, mode: dryrun}", name=f"dry-down-{suffix}")
    ctx = ctx_for(dry)
    assert asyncio.run(settle(mw.entry(ctx))) is None
    assert any("would answer 503 (dryrun)" in v for _, v in ctx.response_headers)


def test_plan_is_rebuilt_only_for_a_new_policy_set() -> None:
    first = policies("- {name: a, qps: 1, burst: 1}")
    mw, _ = make()
    asyncio.run(settle(mw.entry(ctx_for(first))))
    plan = mw._plan
    asyncio.run(settle(mw.entry(ctx_for(first))))
    assert mw._plan is plan
    asyncio.run(settle(mw.entry(ctx_for(policies("- {name: a, qps: 1, burst: 5}")))))
    assert mw._plan is not plan


def test_a_reload_raising_qps_lets_a_throttled_caller_on_at_the_new_rate() -> None:
    """An operator throttled at 0.1/s (burst 5: 50 s of debt) gets its rule raised to 50/s:
    it must be let on one token of the new rate after its first call under it, not after the
    old debt has cleared (Retry-After: 50)."""
    clock = Clock()
    mw, _ = make(clock)
    slow = policies("- {name: writes, qps: 0.1, burst: 5}")
    results = [asyncio.run(settle(mw.entry(ctx_for(slow)))) for _ in range(6)]
    assert results[:5] == [None] * 5 and isinstance(results[5], Deny)
    assert dict(results[5].status.headers)["Retry-After"] == "10"
    fast = policies("- {name: writes, qps: 50, burst: 50}")
    denied = asyncio.run(settle(mw.entry(ctx_for(fast))))
    assert isinstance(denied, Deny)  # an empty bucket at the new rate, not a full one …
    assert dict(denied.status.headers)["Retry-After"] == "1"
    assert "retry after 1s" in denied.status.message
    clock.now += 0.02  # … whose next token comes 1/50 s later
    assert asyncio.run(settle(mw.entry(ctx_for(fast)))) is None
    assert isinstance(asyncio.run(settle(mw.entry(ctx_for(fast)))), Deny)


def test_a_leased_token_is_taken_without_the_store_round_trip_and_answers_the_same() -> None:
    """With leasing, a call whose token this replica holds takes it synchronously
    (``take_local``): the same decisions, headers and store state as the full acquire."""
    import random

    from proxy.stores.lease import LeasingStore

    # GET: one rule, decided in entry; LIST: two rules (acquire); DELETE: one rule whose key is
    # rendered per call (the leased token is taken in _enforce)
    pset = policies("- {name: hot, match: {verbs: [get, list]}, qps: 300, burst: 60, lease: true}\n"
                    "- {name: cold, match: {verbs: [list]}, qps: 5, burst: 2, lease: true}\n"
                    "- {name: named, match: {verbs: [delete]}, key: '{user}/{name}', qps: 200,"
                    " burst: 40, lease: true}")
    paths = {"GET": "/api/v1/namespaces/a/pods/p", "LIST": "/api/v1/namespaces/a/pods",
             "DELETE": "/api/v1/namespaces/a/pods/p"}

    def replay(fast: bool) -> tuple[list[Any], dict[str, int], int]:
        rnd, clock = random.Random(5), Clock()
        inner = MemoryStore(clock=clock)
        store = ResilientStore(LeasingStore(inner, window=0.1, ttl=0.5, clock=clock), clock=clock)
        mw = RateLimit(store=store)
        if not fast:
            mw._take = None
        taken = dict.fromkeys(paths, 0)
        out: list[Any] = []

        async def go() -> None:
            for _ in range(4000):
                clock.now += rnd.choice([0.0, 0.0005, 0.002, 0.05])
                method = rnd.choice(["GET", "GET", "GET", "LIST", "DELETE", "DELETE"])
                ctx = ctx_for(pset, "GET" if method == "LIST" else method, paths[method])
                before = store.primary.local_hits  # type: ignore[attr-defined]
                result = await settle(mw.entry(ctx))
                taken[method] += store.primary.local_hits - before  # type: ignore[attr-defined]
                out.append((None if result is None else result.status.code, headers_of(ctx)))

        asyncio.run(go())
        return out, taken, len(inner)

    fast, slow = replay(True), replay(False)
    assert fast[0] == slow[0] and fast[2] == slow[2]
    assert fast[1]["GET"] > 1000 and fast[1]["DELETE"] > 500  # most took a held token
    codes = [code for code, _ in fast[0]]
    assert None in codes and 429 in codes  # both admitted and throttled calls were compared


@pytest.mark.parametrize("held", [(0, 0.0), (5, 0.2), (7, 63.0), (7, 63.2), (9, 64.0),
                                  (3, 1000.5), (-1, 0.0)])
@pytest.mark.parametrize("key", ["{user}", "{user}/{name}"])
def test_a_held_token_admits_with_the_headers_of_its_verdict(
    held: tuple[int, float], key: str,
) -> None:
    """A token ``take_local`` hands out is admitted (``allowed`` counted) with the headers
    ``_admit`` gives its ``KeyVerdict``: in ``entry`` (a key known per shape) and in
    ``_enforce`` (a key rendered per call) alike."""
    from proxy.middlewares.ratelimit import _headers

    class Holding(MemoryStore):
        def take_local(self, r: BucketRequest) -> tuple[int, float]:
            return held

    name = "held-" + key.replace("{", "").replace("}", "").replace("/", "-")
    pset = policies(f"- {{name: r, key: '{key}', qps: 10, burst: 50, lease: true}}", name=name)
    store = Holding(clock=Clock())
    mw = RateLimit(store=store)
    before = decisions(name, "allowed")
    ctx = ctx_for(pset)
    assert asyncio.run(settle(mw.entry(ctx))) is None
    assert ctx.response_headers == list(_headers(50, *held))
    assert decisions(name, "allowed") == before + 1
    assert store.calls == 0


def test_a_store_tripped_at_start_sends_no_call_to_the_primary() -> None:
    """The start-up probe found Redis away (``trip``): the circuit is open at once, so no call
    waits on the store (each would wait for its timeout to fail) and the gauge says so."""
    from proxy.engine import telemetry

    class Counting(Down):
        calls = 0

        async def acquire(self, requests: Sequence[BucketRequest]) -> Verdict:
            self.calls += 1
            return await super().acquire(requests)

    primary = Counting()

    async def go() -> None:
        store = ResilientStore(primary, reset_after=60)
        store.trip("unreachable (connection refused)")
        store.trip("unreachable again")  # already open: still one trip, the latest reason
        verdict = await store.acquire([BucketRequest(key="k", rate=10, burst=5, fail_open=True)])
        assert verdict.allowed and verdict.backend == "fallback"
        assert primary.calls == 0
        health = store.health()
        assert (health["breaker"], health["trips"]) == ("open", 1)
        assert health["last_error"] == "unreachable again"
        assert telemetry.REGISTRY.get_sample_value(
            "opgate_ratelimit_backend", {"backend": "fallback"}) == 1
        await store.close()

    asyncio.run(go())


def test_no_leased_token_is_taken_while_the_breaker_is_open() -> None:
    from proxy.stores.lease import LeasingStore

    clock = Clock()
    store = ResilientStore(LeasingStore(MemoryStore(clock=clock), clock=clock), clock=clock)
    hot = BucketRequest(key="k", rate=1000, burst=100, lease=True)

    async def warm() -> None:  # demand seen: the refills lease tokens ahead
        for _ in range(50):
            clock.now += 0.001
            await store.acquire([hot])

    asyncio.run(warm())
    assert store.take_local(hot) is not None
    for _ in range(3):
        store.breaker.failure("down")
    assert store.take_local(hot) is None  # the open breaker's fallback decides instead


def test_stop_waiting_answers_every_queued_call_at_once() -> None:
    """At shutdown (``stop_waiting``, on SIGTERM) a call queued by ``onExceed: wait`` gets its
    429 now, as the apiserver answers calls during its drain (``--shutdown-send-retry-after``),
    not after its ``maxWait`` of 30 s, which outlasts the grace: the call would be cut with no
    answer. The one waiting for the next token, those behind it and any that comes later."""
    pset = policies("- {name: w, qps: 0.1, burst: 1, onExceed: wait, maxWait: 30s}")
    mw, _ = make(clock=time.monotonic)  # type: ignore[arg-type]

    async def go() -> tuple[list[Any], Any, float]:
        assert await settle(mw.entry(ctx_for(pset))) is None
        waiting = [asyncio.ensure_future(settle(mw.entry(ctx_for(pset)))) for _ in range(3)]
        await asyncio.sleep(0)  # each runs until it waits
        assert len(mw._queues["op/w/alice"]) == 3
        start = time.monotonic()
        mw.stop_waiting()
        results = await asyncio.gather(*waiting)
        elapsed = time.monotonic() - start
        return results, await settle(mw.entry(ctx_for(pset))), elapsed

    results, later, elapsed = asyncio.run(go())
    for result in (*results, later):
        assert isinstance(result, Deny) and result.status.code == 429, result
        assert int(dict(result.status.response_headers())["Retry-After"]) >= 1
    assert elapsed < 1.0
    assert not mw._queues


def test_a_call_whose_client_leaves_while_queued_is_recorded_as_throttled() -> None:
    """A queued call whose client gives up (client-go's context deadline) is cancelled; the
    access log, the audit event and ``requests_total`` then show it as ``throttled`` (what kept
    it), not ``allowed``, which read as a slow apiserver. One admitted after waiting stays
    ``allowed``."""
    pset = policies("- {name: w, qps: 20, burst: 1, onExceed: wait, maxWait: 5s}")
    mw, _ = make(clock=time.monotonic)  # type: ignore[arg-type]

    async def go() -> tuple[RequestContext, RequestContext]:
        assert await settle(mw.entry(ctx_for(pset))) is None
        admitted, left = ctx_for(pset), ctx_for(pset)
        waiting = asyncio.ensure_future(settle(mw.entry(admitted)))
        leaving = asyncio.ensure_future(settle(mw.entry(left)))
        await asyncio.sleep(0)  # both queued
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await waiting is None
        return admitted, left

    admitted, left = asyncio.run(go())
    assert left.decision == "throttled"
    assert admitted.decision == "allowed"
    assert not mw._queues
