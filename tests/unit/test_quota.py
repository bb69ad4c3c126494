"""The quota middleware's decisions and messages, and the counting bookkeeping behind them.

The middleware runs against ``MemoryQuotaCounts`` (counts and quotas set by hand); the
reservation bookkeeping of the real counter (:class:`proxy.relay.counts.Tally`) is fed list and
watch events directly. The apiserver's own wording is checked against the real one in
tests/e2e/test_quota.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from proxy.app import section_parsers
from proxy.engine import telemetry
from proxy.engine.context import Deny, RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares.quota import (
    MemoryQuotaCounts,
    Quota,
    denial_message,
    generate_name,
)
from proxy.relay.counts import QuotaCounts, Tally, parse_count, selects
from proxy.relay.upstream import UpstreamConfig

CM = "/api/v1/namespaces/team-a/configmaps"
POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: team-quota}}
spec:
  mode: {mode}
  failure: {failure}
  quotas:
{quotas}
"""


def policies(quotas: str, *, mode: str = "enforce", failure: str = "closed") -> PolicySet:
    text = POLICY.format(mode=mode, failure=failure, quotas=quotas)
    return build_policy_set([("q.yaml", text.encode())], parsers=section_parsers())


def ctx_for(pset: PolicySet, path: str = CM, *, body: object = None, method: str = "POST",
            query: str = "", ctype: str = "application/json") -> RequestContext:
    ctx = RequestContext(info=parse_request_info(method, path, query), method=method, path=path,
                         query=query, headers={"Content-Type": ctype}, policies=pset)
    if body is not None:
        ctx.body = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ctx


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def decide(mw: Quota, ctx: RequestContext) -> object:
    async def go() -> object:
        decision = await mw.entry(ctx)
        return decision
    return run(go())


def denials(resource: str) -> float:
    return telemetry.REGISTRY.get_sample_value(
        "opgate_quota_denials_total", {"resource": resource}) or 0.0


SIMPLE = "    - {resources: [configmaps], namespaces: ['team-*'], max: 3}"


def test_below_the_limit_admits_and_reserves() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 2)
    mw = Quota(counts=counts)
    ctx = ctx_for(policies(SIMPLE), body={"metadata": {"name": "cm-3"}})
    assert decide(mw, ctx) is None
    assert counts.used("", "configmaps", "team-a") == 3  # reserved until it is seen
    run(_exit(mw, ctx, 201))
    assert counts.settled == [True]
    assert counts.used("", "configmaps", "team-a") == 3


async def _exit(mw: Quota, ctx: RequestContext, code: int) -> None:
    ctx.status_code = code
    await mw.exit(ctx)


def test_at_the_limit_denies_with_the_apiservers_words() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts)
    before = denials("configmaps")
    decision = decide(mw, ctx_for(policies(SIMPLE), body={"metadata": {"name": "cm-4"}}))
    assert isinstance(decision, Deny)
    assert decision.decision == "quota"
    status = decision.status
    assert (status.code, status.reason) == (403, "Forbidden")
    assert status.message == (
        'configmaps "cm-4" is forbidden: exceeded quota: team-quota, requested: '
        "count/configmaps=1, used: count/configmaps=3, limited: count/configmaps=3")
    assert status.details == {"name": "cm-4", "kind": "configmaps"}
    body = json.loads(status.body())
    assert (body["kind"], body["status"], body["code"]) == ("Status", "Failure", 403)
    assert denials("configmaps") == before + 1
    assert counts.reserved == {}  # a denied create reserves nothing


def test_a_burst_cannot_overshoot() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    ctxs = [ctx_for(pset, body={"metadata": {"name": f"cm-{i}"}}) for i in range(5)]

    async def burst() -> list[object]:
        return list(await asyncio.gather(*(mw.entry(c) for c in ctxs)))

    results = run(burst())
    assert [r is None for r in results] == [True, True, False, False, False]  # type: ignore[union-attr]
    # the first create failed (409): its room is free again
    run(_exit(mw, ctxs[0], 409))
    assert decide(mw, ctx_for(pset, body={"metadata": {"name": "late"}})) is None


def test_other_namespaces_resources_and_verbs_pass() -> None:
    counts = MemoryQuotaCounts()
    for ns in ("team-a", "default"):
        counts.set("", "configmaps", ns, 99)
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    assert decide(mw, ctx_for(pset, "/api/v1/namespaces/default/configmaps",
                              body={"metadata": {"name": "x"}})) is None
    assert decide(mw, ctx_for(pset, "/api/v1/namespaces/team-a/secrets",
                              body={"metadata": {"name": "x"}})) is None
    assert decide(mw, ctx_for(pset, CM + "/x", method="PUT",
                              body={"metadata": {"name": "x"}})) is None
    assert decide(mw, ctx_for(pset, CM + "/x", method="DELETE")) is None
    assert decide(mw, ctx_for(pset, "/api/v1/namespaces/team-a/pods/p/eviction",
                              body={"metadata": {"name": "p"}})) is None


def test_wants_body_only_for_matching_json_creates() -> None:
    mw = Quota(counts=MemoryQuotaCounts())
    pset = policies(SIMPLE)
    assert mw.wants_body(ctx_for(pset))
    assert not mw.wants_body(ctx_for(pset, ctype="application/vnd.kubernetes.protobuf"))
    assert not mw.wants_body(ctx_for(pset, "/api/v1/namespaces/default/configmaps"))
    assert not mw.wants_body(ctx_for(pset, CM + "/x", method="PUT"))
    assert not mw.wants_body(ctx_for(pset, "/api/v1/namespaces/team-a/secrets"))


def test_aligned_resource_quota_with_the_smaller_limit_names_itself() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 2)
    counts.add_quota("ResourceQuota", "rq-small", {"count/configmaps": 2, "configmaps": 4},
                     namespaces=["team-a"])
    counts.add_quota("ResourceQuota", "elsewhere", {"count/configmaps": 0},
                     namespaces=["team-b"])
    mw = Quota(counts=counts)
    aligned = policies("    - {resources: [configmaps], max: 10, "
                       "alignWith: [ResourceQuota, ClusterResourceQuota]}")
    decision = decide(mw, ctx_for(aligned, body={"metadata": {"name": "c"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'configmaps "c" is forbidden: exceeded quota: rq-small, requested: count/configmaps=1, '
        "used: count/configmaps=2, limited: count/configmaps=2")
    # without alignWith the same ResourceQuota is not looked at
    plain = policies("    - {resources: [configmaps], max: 10}")
    assert decide(mw, ctx_for(plain, body={"metadata": {"name": "c"}})) is None


def test_legacy_names_and_ties() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "secrets", "team-a", 4)
    counts.add_quota("ResourceQuota", "both", {"secrets": 4, "count/secrets": 4},
                     namespaces=["team-a"])
    mw = Quota(counts=counts)
    path = "/api/v1/namespaces/team-a/secrets"
    # the policy's own max wins a tie
    tie = policies("    - {resources: [secrets], max: 4, alignWith: [ResourceQuota]}")
    decision = decide(mw, ctx_for(tie, path, body={"metadata": {"name": "s"}}))
    assert isinstance(decision, Deny)
    assert "exceeded quota: team-quota, requested: count/secrets=1," in decision.status.message
    # the quota's both names, sorted, as the apiserver lists them
    bigger = policies("    - {resources: [secrets], max: 9, alignWith: [ResourceQuota]}")
    decision = decide(mw, ctx_for(bigger, path, body={"metadata": {"name": "s"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'secrets "s" is forbidden: exceeded quota: both, requested: count/secrets=1,secrets=1, '
        "used: count/secrets=4,secrets=4, limited: count/secrets=4,secrets=4")


def test_cluster_resource_quota_and_custom_resources() -> None:
    counts = MemoryQuotaCounts()
    counts.set("demo.opgate.dev", "widgets", "team-a", 1)
    counts.add_quota("ClusterResourceQuota", "crq", {"count/widgets.demo.opgate.dev": 1},
                     namespaces=["team-a"])
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [widgets], apiGroups: [demo.opgate.dev], max: 5,\n"
                    "       alignWith: [ClusterResourceQuota]}")
    path = "/apis/demo.opgate.dev/v1/namespaces/team-a/widgets"
    decision = decide(mw, ctx_for(pset, path, body={"metadata": {"name": "w"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'widgets.demo.opgate.dev "w" is forbidden: exceeded quota: crq, requested: '
        "count/widgets.demo.opgate.dev=1, used: count/widgets.demo.opgate.dev=1, limited: "
        "count/widgets.demo.opgate.dev=1")
    assert decision.status.details == {"name": "w", "group": "demo.opgate.dev", "kind": "widgets"}
    assert counts.interest["cluster_quotas"] and not counts.interest["resource_quotas"]


def test_generate_name_and_unknown_names() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts, rng=random.Random(7))
    pset = policies(SIMPLE)
    decision = decide(mw, ctx_for(pset, body={"metadata": {"generateName": "gen-"}}))
    assert isinstance(decision, Deny)
    assert re.match(r'configmaps "gen-[bcdfghjklmnpqrstvwxz2456789]{5}" is forbidden: ',
                    decision.status.message)
    protobuf = ctx_for(pset, body=b"k8s\x00...", ctype="application/vnd.kubernetes.protobuf")
    decision = decide(mw, protobuf)
    assert isinstance(decision, Deny)
    assert decision.status.message.startswith("configmaps is forbidden: exceeded quota: ")
    assert generate_name("x" * 70, random.Random(1)).startswith("x" * 58)
    assert len(generate_name("x" * 70)) == 63


def test_dryrun_warns_and_admits() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts)
    ctx = ctx_for(policies(SIMPLE, mode="dryrun"), body={"metadata": {"name": "cm-4"}})
    before = telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "quota"}) or 0.0
    assert decide(mw, ctx) is None
    (header,) = ctx.response_headers
    assert header[0] == "Warning"
    assert header[1].startswith('299 - "opgate: quota \\"team-quota\\" of policy \\"team-quota\\"'
                                ' would deny this create (dryrun): configmaps \\"cm-4\\" is '
                                "forbidden: exceeded quota: team-quota")
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "quota"}) == before + 1


def test_not_synced_fails_as_the_policy_says() -> None:
    counts = MemoryQuotaCounts()
    counts.unsync("", "configmaps")
    mw = Quota(counts=counts)
    closed = decide(mw, ctx_for(policies(SIMPLE), body={"metadata": {"name": "x"}}))
    assert isinstance(closed, Deny)
    assert closed.status.code == 503
    assert "not synced" in closed.status.message and "fails closed" in closed.status.message
    assert decide(mw, ctx_for(policies(SIMPLE, failure="open"),
                              body={"metadata": {"name": "x"}})) is None
    counts2 = MemoryQuotaCounts()
    counts2.quotas_synced = False
    aligned = policies("    - {resources: [configmaps], max: 9, alignWith: [ResourceQuota]}")
    decision = decide(Quota(counts=counts2), ctx_for(aligned, body={"metadata": {"name": "x"}}))
    assert isinstance(decision, Deny) and decision.status.code == 503


def test_dry_run_creates_are_checked_but_not_reserved() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    assert decide(mw, ctx_for(pset, query="dryRun=All", body={"metadata": {"name": "x"}})) is None
    assert counts.reserved == {}


def test_exit_outcomes() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    for code in (201, 403, 0, 504, 500):
        ctx = ctx_for(pset, body={"metadata": {"name": "x"}})
        assert decide(mw, ctx) is None
        run(_exit(mw, ctx, code))
    assert counts.settled == [True, False, None, None, False]


def test_track_tells_the_counter_what_to_watch() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts)
    mw.prepare(policies("    - {resources: [configmaps, secrets], namespaces: ['team-*'], "
                        "max: 3, alignWith: [ResourceQuota]}"))
    resources = counts.interest["resources"]
    assert sorted(resources) == [("", "configmaps"), ("", "secrets")]
    assert resources[("", "configmaps")]("team-x") and not resources[("", "configmaps")]("kube")
    assert counts.interest["resource_quotas"] and not counts.interest["cluster_quotas"]


def test_denial_message_without_group_or_name() -> None:
    assert denial_message("apps", "deployments", "", "q", [("count/deployments.apps", 2)], 2) == (
        "deployments.apps is forbidden: exceeded quota: q, requested: count/deployments.apps=1, "
        "used: count/deployments.apps=2, limited: count/deployments.apps=2")


# --- the counter's bookkeeping -------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tally_counts_from_list_and_events() -> None:
    tally = Tally()
    assert tally.used("a") is None  # not synced
    assert tally.replace([("a", "x"), ("a", "y"), ("b", "z")]) == {"a", "b"}
    assert (tally.used("a"), tally.used("b"), tally.used("c")) == (2, 1, 0)
    tally.added("a", "w")
    tally.deleted("b")
    assert (tally.used("a"), tally.used("b")) == (3, 0)
    assert tally.replace([("a", "x")]) == {"a"}


def test_reservation_lives_until_the_watch_shows_the_object() -> None:
    clock = Clock()
    tally = Tally(clock=clock, settle_seconds=60, inflight_seconds=600)
    tally.replace([])
    r = tally.reserve("a", "cm-1", "")
    assert tally.used("a") == 1
    tally.settle(r, True)  # 201, no event yet
    assert tally.used("a") == 1
    tally.added("a", "cm-1")  # the watch: now counted once, as an object
    assert tally.used("a") == 1
    assert tally.reserved == {}
    # the event may come first, while the create is still in flight
    r2 = tally.reserve("a", "cm-2", "")
    tally.added("a", "cm-2")
    tally.settle(r2, True)
    assert tally.used("a") == 2
    # a failed create frees its room
    r3 = tally.reserve("a", "cm-3", "")
    assert tally.used("a") == 3
    tally.settle(r3, False)
    assert tally.used("a") == 2
    # a created object the watch never showed expires
    r4 = tally.reserve("a", "cm-4", "")
    tally.settle(r4, None)
    clock.now += 61
    assert tally.used("a") == 2


def test_generate_name_reservations_end_with_a_new_object_of_that_prefix() -> None:
    tally = Tally()
    tally.replace([])
    r = tally.reserve("a", "", "gen-")
    tally.settle(r, True)
    tally.added("a", "other-1", "other-")
    assert tally.used("a") == 2
    tally.added("a", "gen-abcde", "gen-")
    assert tally.used("a") == 2 and tally.reserved == {}


def test_a_relist_ends_named_reservations() -> None:
    tally = Tally()
    tally.replace([])
    r = tally.reserve("a", "cm-1", "")
    tally.settle(r, True)
    tally.replace([("a", "cm-1")])
    assert tally.used("a") == 1


@pytest.mark.parametrize("raw, value", [
    ("10", 10), (7, 7), ("1k", 1000), ("2Ki", 2048), ("1.5", 2), ("500m", 1), ("1e3", 1000),
    ("abc", None), (True, None), ("-1", None), ("5X", None)])
def test_parse_count(raw: object, value: int | None) -> None:
    assert parse_count(raw) == value


def test_cluster_resource_quota_selectors() -> None:
    labels = {"team": "a", "tier": "prod"}
    assert selects({"labels": {"matchLabels": {"team": "a"}}}, labels, {})
    assert not selects({"labels": {"matchLabels": {"team": "b"}}}, labels, {})
    assert selects({"labels": {"matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["prod", "stage"]},
        {"key": "gone", "operator": "DoesNotExist"}]}}, labels, {})
    assert not selects({"labels": {"matchExpressions": [
        {"key": "tier", "operator": "NotIn", "values": ["prod"]}]}}, labels, {})
    assert selects({"annotations": {"openshift.io/requester": "me"}}, labels,
                   {"openshift.io/requester": "me"})
    assert not selects({"annotations": {"openshift.io/requester": "me"}}, labels, {})
    assert selects({"labels": {}}, labels, {})  # an empty selector selects every namespace
    assert not selects(None, labels, {})


def test_counter_answers_none_until_synced_and_settles_reservations() -> None:
    counts = QuotaCounts(UpstreamConfig(url="https://127.0.0.1:1"))
    counts.track({("", "configmaps"): lambda ns: True}, resource_quotas=True,
                 cluster_quotas=True)
    assert counts.used("", "configmaps", "a") is None
    assert counts.aligned("a", resource_quotas=True, cluster_quotas=False) is None
    assert counts.reserve("", "secrets", "a", "x", "") is None  # not tracked
    assert "configmaps=syncing" in counts.describe()
