"""The quota middleware's decisions and messages, and the counting bookkeeping behind them.

The middleware runs against ``MemoryQuotaCounts`` (objects and quotas set by hand) and the
in-process store's reservations; the bookkeeping of the real counter
(:class:`proxy.relay.tally.Tally`) is fed list and watch events directly. The apiserver's own
wording is checked against the real one in tests/e2e/test_quota.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from proxy.app import section_parsers
from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.context import Deny, RequestContext
from proxy.engine.policies import PolicySet, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.status import gateway_timeout, service_unavailable
from proxy.middlewares.quota import Quota
from proxy.middlewares.quota_counts import MemoryQuotaCounts
from proxy.middlewares.quota_limits import denial_message, format_count, generate_name
from proxy.relay.counts import QuotaCounts
from proxy.relay.quotaobjects import Count, parse_limit, selects
from proxy.relay.tally import Tally
from proxy.relay.upstream import UpstreamConfig
from proxy.stores.base import Reservation
from proxy.stores.memory import MemoryStore

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
        decision = await settle(mw.entry(ctx))
        return decision
    return run(go())


def denials(resource: str) -> float:
    return telemetry.REGISTRY.get_sample_value(
        "opgate_quota_denials_total", {"resource": resource}) or 0.0


SIMPLE = "    - {resources: [configmaps], namespaces: ['team-*'], max: 3}"
SCOPE = "/configmaps/team-a"


def used(mw: Quota, counts: MemoryQuotaCounts, namespace: str = "team-a") -> int:
    """What the next create in the namespace would be checked against (objects + reservations
    not seen), asked of the middleware's store as it asks it."""
    observed = counts.observed("", "configmaps", namespace)
    assert observed is not None
    store = mw.store
    assert isinstance(store, MemoryStore)
    return store.reserve_now(Reservation(
        scope=f"/configmaps/{namespace}", member="probe|x", observed=observed, limit=-1, ttl=1,
        seen=tuple(counts.seen("", "configmaps", namespace)), check_only=True)).used


def reservations(mw: Quota, scope: str = SCOPE) -> dict[str, float]:
    store = mw.store
    assert isinstance(store, MemoryStore)
    return store.reservations(scope)


def test_below_the_limit_admits_and_reserves() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 2)
    mw = Quota(counts=counts)
    ctx = ctx_for(policies(SIMPLE), body={"metadata": {"name": "cm-3"}})
    assert decide(mw, ctx) is None
    assert used(mw, counts) == 3  # reserved until it is seen
    (member,) = reservations(mw)
    assert member.startswith("cm-3|")
    run(_exit(mw, ctx, 201))
    assert counts.settled == [True]
    assert used(mw, counts) == 3
    counts.add("", "configmaps", "team-a", "cm-3")  # the watch shows it: counted once
    assert used(mw, counts) == 3
    assert counts.observed("", "configmaps", "team-a") == 3


async def _exit(mw: Quota, ctx: RequestContext, code: int) -> None:
    ctx.status_code = code
    await settle(mw.exit(ctx))


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
    assert reservations(mw) == {}  # a denied create reserves nothing


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
    # the first create failed (422, invalid): its room is free again
    run(_exit(mw, ctxs[0], 422))
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


def test_wants_body_only_for_matching_json_and_protobuf_creates() -> None:
    mw = Quota(counts=MemoryQuotaCounts())
    pset = policies(SIMPLE)
    assert mw.wants_body(ctx_for(pset))
    assert mw.wants_body(ctx_for(pset, ctype="application/vnd.kubernetes.protobuf"))
    assert not mw.wants_body(ctx_for(pset, ctype="application/cbor"))
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


def test_counts_are_printed_as_the_apiserver_prints_quantities() -> None:
    """The apiserver prints a count as a canonical quantity: 1000 is "1k" (its controller's
    ``used``, and an entry's own ``max`` as a ResourceQuota's ``hard: 1000`` would be), and an
    aligned quota's limit as its ``hard`` reads ("1Ki", "1500m")."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1000)
    mw = Quota(counts=counts)
    own = policies("    - {resources: [configmaps], max: 1000}")
    decision = decide(mw, ctx_for(own, body={"metadata": {"name": "c"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'configmaps "c" is forbidden: exceeded quota: team-quota, requested: count/configmaps=1, '
        "used: count/configmaps=1k, limited: count/configmaps=1k")
    counts.set("", "configmaps", "team-a", 1024)
    counts.add_quota("ResourceQuota", "binary", {"count/configmaps": Count(1024, "1Ki")},
                     namespaces=["team-a"])
    aligned = policies("    - {resources: [configmaps], alignWith: [ResourceQuota]}")
    decision = decide(mw, ctx_for(aligned, body={"metadata": {"name": "c"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message.endswith(
        "used: count/configmaps=1024, limited: count/configmaps=1Ki")


@pytest.mark.parametrize("count, text", [
    (0, "0"), (1, "1"), (999, "999"), (1000, "1k"), (1500, "1500"), (2000, "2k"),
    (10000, "10k"), (1_000_000, "1M"), (3 * 10**9, "3G"), (1234000, "1234k")])
def test_format_count(count: int, text: str) -> None:
    assert format_count(count) == text


PODS = "/api/v1/namespaces/team-a/pods"


def pod_create(pset: PolicySet, name: str) -> RequestContext:
    return ctx_for(pset, PODS, body={"metadata": {"name": name}})


def test_a_legacy_pods_limit_does_not_count_pods_that_finished() -> None:
    """The apiserver's pod evaluator: ``count/pods`` counts every pod in storage, the legacy
    ``pods`` only those not Succeeded or Failed. Completed pods lingering must not make opgate
    deny a create that the apiserver admits; a create takes room in both counts."""
    counts = MemoryQuotaCounts()
    counts.set("", "pods", "team-a", 3)
    counts.finish("", "pods", "team-a", "existing-0")  # Succeeded: 2 pods still count
    counts.add_quota("ResourceQuota", "rq-pods", {"pods": 3}, namespaces=["team-a"])
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [pods], alignWith: [ResourceQuota]}")
    assert decide(mw, pod_create(pset, "p-3")) is None
    decision = decide(mw, pod_create(pset, "p-4"))  # p-3's reservation takes the last room
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'pods "p-4" is forbidden: exceeded quota: rq-pods, requested: pods=1, used: pods=3, '
        "limited: pods=3")
    # count/pods counts the finished pod too: no room at all
    counts.quotas.clear()
    counts.add_quota("ResourceQuota", "rq-count", {"count/pods": 3}, namespaces=["team-a"])
    decision = decide(mw, pod_create(pset, "p-5"))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'pods "p-5" is forbidden: exceeded quota: rq-count, requested: count/pods=1, '
        "used: count/pods=4, limited: count/pods=3")


def test_both_pod_counts_of_one_quota_each_say_their_own_used() -> None:
    """Over both limits of one ResourceQuota, the apiserver lists each key with its own used:
    ``used: count/pods=3,pods=2``; over only one, only that one."""
    counts = MemoryQuotaCounts()
    counts.set("", "pods", "team-a", 3)
    counts.finish("", "pods", "team-a", "existing-1")
    counts.add_quota("ResourceQuota", "both", {"count/pods": 3, "pods": 2},
                     namespaces=["team-a"])
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [pods], alignWith: [ResourceQuota]}")
    decision = decide(mw, pod_create(pset, "p"))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'pods "p" is forbidden: exceeded quota: both, requested: count/pods=1,pods=1, '
        "used: count/pods=3,pods=2, limited: count/pods=3,pods=2")
    counts.quotas.clear()
    counts.add_quota("ResourceQuota", "roomy", {"count/pods": 9, "pods": 2},
                     namespaces=["team-a"])
    decision = decide(mw, pod_create(pset, "p"))
    assert isinstance(decision, Deny)
    assert decision.status.message.endswith(
        "requested: pods=1, used: pods=2, limited: pods=2")


def test_an_entrys_own_max_on_pods_counts_every_pod() -> None:
    """opgate's own ``max`` is an object count, as for any resource (and as its 403 says,
    ``count/pods``): finished pods are objects the apiserver stores."""
    counts = MemoryQuotaCounts()
    counts.set("", "pods", "team-a", 3)
    counts.finish("", "pods", "team-a", "existing-0")
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [pods], max: 3, alignWith: [ResourceQuota]}")
    counts.add_quota("ResourceQuota", "rq-pods", {"pods": 5}, namespaces=["team-a"])
    decision = decide(mw, pod_create(pset, "p"))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'pods "p" is forbidden: exceeded quota: team-quota, requested: count/pods=1, '
        "used: count/pods=3, limited: count/pods=3")


def test_a_cluster_resource_quotas_pods_count_leaves_out_finished_pods_everywhere() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "pods", "team-a", 1)
    counts.set("", "pods", "team-b", 3)
    for name in ("existing-0", "existing-1"):
        counts.finish("", "pods", "team-b", name)
    counts.add_quota("ClusterResourceQuota", "crq", {"pods": 3, "count/pods": 6},
                     namespaces=["team-a", "team-b"])
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [pods], alignWith: [ClusterResourceQuota]}")
    assert decide(mw, pod_create(pset, "p-1")) is None  # 1 + 1 running, and this one
    decision = decide(mw, pod_create(pset, "p-2"))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'pods "p-2" is forbidden: exceeded quota: crq, requested: pods=1, used: pods=3, '
        "limited: pods=3")


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


def test_a_cluster_resource_quota_limits_all_its_namespaces_together() -> None:
    """OpenShift checks a ClusterResourceQuota against its status.total, the objects of every
    namespace it selects: the objects elsewhere take room here, and the 403 says their sum."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    counts.set("", "configmaps", "team-b", 3)
    counts.set("", "configmaps", "other", 9)  # not selected
    counts.add_quota("ClusterResourceQuota", "crq-team", {"count/configmaps": 5},
                     namespaces=["team-a", "team-b"])
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [configmaps], max: 4, alignWith: [ClusterResourceQuota]}")
    assert decide(mw, ctx_for(pset, body={"metadata": {"name": "c-1"}})) is None  # 5 of 5
    decision = decide(mw, ctx_for(pset, body={"metadata": {"name": "c-2"}}))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'configmaps "c-2" is forbidden: exceeded quota: crq-team, requested: count/configmaps=1, '
        "used: count/configmaps=5, limited: count/configmaps=5")
    counts.set("", "configmaps", "team-b", 9)  # over already: no room at all, and no error
    decision = decide(mw, ctx_for(pset, body={"metadata": {"name": "c-3"}}))
    assert isinstance(decision, Deny)
    assert "used: count/configmaps=11, limited: count/configmaps=5" in decision.status.message


def test_the_counter_sums_a_cluster_resource_quotas_namespaces() -> None:
    counts = QuotaCounts(UpstreamConfig(url="http://127.0.0.1:9"))
    counts.track({("", "configmaps"): lambda ns: True}, resource_quotas=False,
                 cluster_quotas=True)
    fed: dict[str, dict[str, object]] = {}

    async def capture(label: str, path: object, replace: object, event: object, *,
                      metadata_only: bool) -> None:
        fed[label] = {"replace": replace, "event": event}

    async def discover(path: str) -> dict[str, object]:
        if path == "/apis/quota.openshift.io":
            return {"preferredVersion": {"version": "v1"}}
        return {"resources": [{"name": "clusterresourcequotas"}]}

    counts._list_watch = capture  # type: ignore[method-assign]
    counts._get_json = discover  # type: ignore[method-assign]

    async def start() -> None:
        counts._started = True
        await counts._run_crq()
        await counts._run_namespaces()
        await counts._run_counted(counts._counted[("", "configmaps")])

    run(start())

    def ns(name: str, team: str) -> dict[str, object]:
        return {"metadata": {"name": name, "labels": {"team": team}}}

    fed["namespaces"]["replace"]([ns("a", "x"), ns("b", "x"), ns("c", "y")])  # type: ignore[operator]
    fed["clusterresourcequotas"]["replace"]([{  # type: ignore[operator]
        "metadata": {"name": "crq"},
        "spec": {"selector": {"labels": {"matchLabels": {"team": "x"}}},
                 "quota": {"hard": {"count/configmaps": "10"}}}}])
    fed["configmaps"]["replace"]([  # type: ignore[operator]
        {"metadata": {"namespace": n, "name": f"{n}-{i}"}}
        for n, k in (("a", 1), ("b", 2), ("c", 4)) for i in range(k)])
    assert counts.beyond("", "configmaps", "a", "crq") == 2
    assert counts.beyond("", "configmaps", "b", "crq") == 1
    fed["configmaps"]["event"]("ADDED", {"metadata": {"namespace": "b", "name": "b-9"}})  # type: ignore[operator]
    assert counts.beyond("", "configmaps", "a", "crq") == 3
    fed["namespaces"]["event"]("MODIFIED", ns("c", "x"))  # type: ignore[operator]
    assert counts.beyond("", "configmaps", "a", "crq") == 7
    assert counts.beyond("", "configmaps", "a", "gone") == 0
    assert counts.beyond("", "secrets", "a", "crq") == 0


TERMINAL = "fieldSelector=status.phase%21%3DPending%2Cstatus.phase%21%3DRunning%2C" \
    "status.phase%21%3DUnknown"


def test_the_counter_watches_the_pods_that_finished() -> None:
    """Pods get a second metadata-only list+watch, of those in a terminal phase (a field
    selector; a pod that reaches Succeeded arrives ADDED there): ``finished`` counts the pods
    of the first watch that this one shows, whichever of the two is behind."""
    counts = QuotaCounts(UpstreamConfig(url="http://127.0.0.1:9"))
    counts.track({("", "pods"): lambda ns: True, ("", "secrets"): lambda ns: True},
                 resource_quotas=False, cluster_quotas=False)
    fed: dict[str, dict[str, object]] = {}

    async def capture(label: str, path: object, replace: object, event: object, *,
                      metadata_only: bool, query: str = "") -> None:
        fed[label] = {"replace": replace, "event": event, "query": query,
                      "metadata_only": metadata_only}

    async def discover(path: str) -> dict[str, object]:
        return {"resources": [{"name": "pods", "namespaced": True},
                              {"name": "secrets", "namespaced": True}]}

    counts._list_watch = capture  # type: ignore[method-assign]
    counts._get_json = discover  # type: ignore[method-assign]
    pods = counts._counted[("", "pods")]

    async def start() -> None:
        counts._started = True
        await counts._run_counted(pods)
        await counts._run_terminal(pods)
        await counts._run_counted(counts._counted[("", "secrets")])

    run(start())
    assert sorted(fed) == ["pods", "pods (terminal)", "secrets"]
    assert fed["pods (terminal)"]["query"] == TERMINAL
    assert fed["pods (terminal)"]["metadata_only"] and fed["pods"]["query"] == ""

    def meta(name: str, namespace: str = "a") -> dict[str, object]:
        return {"metadata": {"namespace": namespace, "name": name}}

    fed["pods"]["replace"]([meta("p-0"), meta("p-1"), meta("p-2"), meta("q-0", "b")])  # type: ignore[operator]
    assert counts.observed("", "pods", "a") is None  # until both are listed
    assert "pods=syncing" in counts.describe()
    # p-9: finished before the pods' watch showed it (that one is behind)
    fed["pods (terminal)"]["replace"]([meta("p-0"), meta("p-9")])  # type: ignore[operator]
    assert counts.observed("", "pods", "a") == 3 and "pods=synced" in counts.describe()
    assert counts.finished("", "pods", "a") == 1 and counts.finished("", "pods", "b") == 0
    terminal, event = fed["pods (terminal)"]["event"], fed["pods"]["event"]
    event("ADDED", meta("p-9"))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 2
    terminal("ADDED", meta("p-1"))  # type: ignore[operator]
    terminal("ADDED", meta("p-1"))  # the same event again (a re-watch) counts once
    assert counts.finished("", "pods", "a") == 3
    event("DELETED", meta("p-1"))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 2
    event("ADDED", meta("p-1"))  # created again, Pending, before the other watch's DELETED
    assert counts.finished("", "pods", "a") == 2
    terminal("DELETED", meta("p-1"))  # type: ignore[operator]
    terminal("DELETED", meta("p-0"))  # deleted: the other watch will say so too
    assert counts.finished("", "pods", "a") == 1
    assert counts.finished("", "secrets", "a") == 0  # only pods have an end of life
    fed["pods"]["replace"]([meta("p-9"), meta("p-3")])  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 1


def test_pods_stuck_terminating_past_their_grace_period_count_as_finished() -> None:
    """The apiserver's pod evaluator leaves out of ``pods`` a pod whose deletionTimestamp plus
    its grace period has passed (stuck terminating on a lost node: its replacement must fit);
    both are in the metadata the pods' watch already gets."""
    wall = Clock()
    counts = QuotaCounts(UpstreamConfig(url="http://127.0.0.1:9"))
    counts.track({("", "pods"): lambda ns: True}, resource_quotas=False, cluster_quotas=False)
    fed: dict[str, dict[str, object]] = {}

    async def capture(label: str, path: object, replace: object, event: object, *,
                      metadata_only: bool, query: str = "") -> None:
        fed[label] = {"replace": replace, "event": event}

    counts._list_watch = capture  # type: ignore[method-assign]
    pods = counts._counted[("", "pods")]
    pods.path = "/api/v1/pods"
    finished = pods.tally.finished
    assert finished is not None
    finished.wall = wall
    wall.now = 1_700_000_000.0  # 2023-11-14T22:13:20Z

    async def start() -> None:
        counts._started = True
        await counts._run_counted(pods)
        await counts._run_terminal(pods)

    run(start())

    def meta(name: str, deleting: str = "", grace: int | None = None) -> dict[str, object]:
        m: dict[str, object] = {"namespace": "a", "name": name}
        if deleting:
            m["deletionTimestamp"] = deleting
        if grace is not None:
            m["deletionGracePeriodSeconds"] = grace
        return {"metadata": m}

    fed["pods"]["replace"]([meta("p-0", "2023-11-14T22:13:00Z", 30),  # type: ignore[operator]
                            meta("p-1"), meta("p-2")])
    fed["pods (terminal)"]["replace"]([])  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 0  # deleted 20 s ago, 30 s of grace: counts
    wall.now += 10
    assert counts.finished("", "pods", "a") == 0  # at the moment itself: still counts
    wall.now += 0.5
    assert counts.finished("", "pods", "a") == 1
    event, terminal = fed["pods"]["event"], fed["pods (terminal)"]["event"]
    event("MODIFIED", meta("p-1", "2023-11-14T22:13:30Z", 0))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 2
    event("MODIFIED", meta("p-2", "2023-11-14T23:00:00Z", 30))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 2  # its time has not come
    terminal("ADDED", meta("p-1"))  # and Failed: counted once  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 2
    event("DELETED", meta("p-0"))  # type: ignore[operator]
    event("DELETED", meta("p-1"))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 0
    event("ADDED", meta("p-0"))  # created again: a new pod  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 0
    event("MODIFIED", meta("p-3", "not a time", 5))  # type: ignore[operator]
    assert counts.finished("", "pods", "a") == 0  # unreadable: counts (the safe side)


def _pb(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128 and number < 16  # one-byte varints
    return bytes([number << 3 | 2, len(payload)]) + payload


def configmap_protobuf(name: str = "", generate_name: str = "") -> bytes:
    """What client-go's typed clients send: ``k8s\0`` + runtime.Unknown{typeMeta, raw}, raw
    a ConfigMap whose metadata (1) has name (1), generateName (2), namespace (3), then data."""
    meta = _pb(1, name.encode()) + _pb(2, generate_name.encode()) + _pb(3, b"team-a")
    meta += bytes([0x38, 0x96, 0x01])  # generation (7) = 150, a varint field: skipped
    raw = _pb(1, meta) + _pb(2, _pb(1, b"k") + _pb(2, b"v"))
    return b"k8s\x00" + _pb(1, _pb(1, b"v1") + _pb(2, b"ConfigMap")) + _pb(2, raw)


def test_protobuf_creates_are_named_and_counted_once() -> None:
    """client-go sends protobuf by default: the name is read from it, so the 403 names the
    object as the apiserver's does, and the reservation ends when the watch shows the object
    (unnamed, it was counted a second time, next to the object, until it expired)."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    proto = "application/vnd.kubernetes.protobuf"
    ctx = ctx_for(pset, body=configmap_protobuf("pb-1"), ctype=proto)
    assert decide(mw, ctx) is None
    (member,) = reservations(mw)
    assert member.startswith("pb-1|")
    run(_exit(mw, ctx, 201))
    counts.add("", "configmaps", "team-a", "pb-1")  # the watch shows it: counted once
    assert used(mw, counts) == 2
    assert decide(mw, ctx_for(pset, body=configmap_protobuf("pb-2"), ctype=proto)) is None
    denied = decide(mw, ctx_for(pset, body=configmap_protobuf("pb-3"), ctype=proto))
    assert isinstance(denied, Deny) and denied.status.message.startswith(
        'configmaps "pb-3" is forbidden: exceeded quota: team-quota, ')
    gen = decide(mw, ctx_for(pset, body=configmap_protobuf(generate_name="pb-"), ctype=proto))
    assert isinstance(gen, Deny) and re.match(r'configmaps "pb-[a-z0-9]{5}" is forbidden',
                                              gen.status.message)


def test_generate_name_and_unknown_names() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts, rng=random.Random(7))
    pset = policies(SIMPLE)
    decision = decide(mw, ctx_for(pset, body={"metadata": {"generateName": "gen-"}}))
    assert isinstance(decision, Deny)
    assert re.match(r'configmaps "gen-[bcdfghjklmnpqrstvwxz2456789]{5}" is forbidden: ',
                    decision.status.message)
    # a body opgate does not read (CBOR) names no object; a protobuf one it cannot read is the
    # apiserver's 400 (test_a_body_the_apiserver_cannot_decode_is_its_400_not_a_quota_403)
    cbor = ctx_for(pset, body=b"\xd9\xd9\xf7\xa0", ctype="application/cbor")
    decision = decide(mw, cbor)
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
    assert dict(closed.status.headers)["Retry-After"] == "1"  # (client-go waits and retries)
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
    assert reservations(mw) == {}


@pytest.mark.parametrize(("query", "dry"), [
    ("dryRun=All", True),
    ("fieldManager=kubectl&dryRun=All", True),
    ("dry%52un=All", True),  # Go's url.ParseQuery decodes the key: a dry run
    ("dryRun", True),  # 422 from the apiserver (not 'All'): nothing is made either
    ("xdryRun=All", False),  # another parameter: the apiserver creates the object
    ("fieldManager=dryRun=All", False),  # a value
    ("dryRun=All;x=1", False),  # Go skips a pair holding ';': a real create
    ("dryRun=%zz", False),  # Go skips a pair whose escape is malformed: a real create
])
def test_a_dry_run_is_what_the_apiserver_takes_for_one(query: str, dry: bool) -> None:
    """The parameter is read as the apiserver reads the query (Go's url.ParseQuery): opgate
    looked for 'dryRun=' anywhere in it, so a create the apiserver makes for real reserved no
    room (creates at once could pass the limit together), and a dry run it makes nothing of
    held room for 30 s (the next creates could be denied early)."""
    mw = Quota(counts=MemoryQuotaCounts())
    assert decide(mw, ctx_for(policies(SIMPLE), query=query,
                              body={"metadata": {"name": "x"}})) is None
    assert (reservations(mw) == {}) is dry


def test_exit_outcomes() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts, settle_seconds=30, reserve_seconds=60)
    pset = policies("    - {resources: [configmaps], namespaces: ['team-*'], max: 10}")
    for code in (201, 403, 0, 504, 500):
        ctx = ctx_for(pset, body={"metadata": {"name": f"x-{code}"}})
        assert decide(mw, ctx) is None
        run(_exit(mw, ctx, code))
    assert counts.settled == [True, False, None, None, False]
    # created (or unknown): kept until the watch shows it, at most settle_seconds; failed: gone
    left = reservations(mw)
    assert sorted(m.partition("|")[0] for m in left) == ["x-0", "x-201", "x-504"]
    now = mw.store.now_us()  # type: ignore[attr-defined]
    assert all(now < expiry <= now + 30_000_000 for expiry in left.values())


def test_opgates_own_answers_say_whether_the_apiserver_saw_the_create() -> None:
    """A 503 the relay answers once the call went out (the apiserver closed the connection
    before its answer) may have made the object, as a 504 may: its room is kept until the watch
    shows the object or the reservation settles. One answered with ``Retry-After`` never left
    opgate (connection refused, a connect timeout): nothing was made, the room is free at once.
    The apiserver's own 503 is a failed create, as before."""
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts, settle_seconds=30, reserve_seconds=60)
    pset = policies("    - {resources: [configmaps], namespaces: ['team-*'], max: 10}")
    cases = [("sent-503", 503, service_unavailable("opgate: the apiserver is unavailable")),
             ("unsent-503", 503, service_unavailable("opgate: refused", retry_after=1)),
             ("unsent-504", 504, gateway_timeout("opgate: connect timed out", retry_after=1)),
             ("apiserver-503", 503, None)]
    for name, code, answer in cases:
        ctx = ctx_for(pset, body={"metadata": {"name": name}})
        assert decide(mw, ctx) is None
        ctx.answer = answer
        run(_exit(mw, ctx, code))
    assert counts.settled == [None, False, False, False]
    assert [m.partition("|")[0] for m in reservations(mw)] == ["sent-503"]


APPLY = "application/apply-patch+yaml"


def test_server_side_apply_that_creates_is_checked_like_a_create() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)  # existing-0 … existing-2: full
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    decision = decide(mw, ctx_for(pset, CM + "/new", method="PATCH", ctype=APPLY,
                                  query="fieldManager=me"))
    assert isinstance(decision, Deny)
    assert decision.status.message == (
        'configmaps "new" is forbidden: exceeded quota: team-quota, requested: '
        "count/configmaps=1, used: count/configmaps=3, limited: count/configmaps=3")
    assert decision.status.details == {"name": "new", "kind": "configmaps"}
    # an apply to an object that exists is an update: not counted, nothing reserved
    for ctype in (APPLY, "application/apply-patch+json", "application/apply-patch+cbor"):
        assert decide(mw, ctx_for(pset, CM + "/existing-1", method="PATCH", ctype=ctype)) is None
    # other patches are never creates, nor is an apply to a subresource
    assert decide(mw, ctx_for(pset, CM + "/new", method="PATCH",
                              ctype="application/merge-patch+json")) is None
    assert decide(mw, ctx_for(pset, "/api/v1/namespaces/team-a/pods/p/status", method="PATCH",
                              ctype=APPLY)) is None
    assert reservations(mw) == {}
    assert not mw.wants_body(ctx_for(pset, CM + "/new", method="PATCH", ctype=APPLY))


def test_server_side_apply_reserves_and_settles() -> None:
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    created = ctx_for(pset, CM + "/a1", method="PATCH", ctype=APPLY)
    assert decide(mw, created) is None
    (member,) = reservations(mw)
    assert member.startswith("a1|")
    run(_exit(mw, created, 201))  # created: kept until the watch shows it
    assert used(mw, counts) == 2
    # an apply the counts took for a create, but that the apiserver answered 200: it existed
    updated = ctx_for(pset, CM + "/a2", method="PATCH", ctype=APPLY)
    assert decide(mw, updated) is None
    assert used(mw, counts) == 3
    run(_exit(mw, updated, 200))
    assert used(mw, counts) == 2
    assert counts.settled == [True, False]
    # full now (1 object + a1 reserved + one more): the fourth is denied
    assert decide(mw, ctx_for(pset, CM + "/a3", method="PATCH", ctype=APPLY)) is None
    assert isinstance(decide(mw, ctx_for(pset, CM + "/a4", method="PATCH", ctype=APPLY)), Deny)


def test_an_apply_racing_the_create_it_follows_is_not_refused() -> None:
    """A create took the last room and the watch does not show its object yet: an apply to
    the same name right after (an update, or the same create) needs no more room."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 2)  # SIMPLE: at most 3
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    assert decide(mw, ctx_for(pset, body={"metadata": {"name": "last"}})) is None
    apply = ctx_for(pset, CM + "/last", method="PATCH", ctype=APPLY, query="fieldManager=op")
    assert decide(mw, apply) is None
    assert [m.partition("|")[0] for m in reservations(mw)] == ["last"]  # nothing added
    # another name still finds the quota full
    assert isinstance(decide(mw, ctx_for(pset, CM + "/other", method="PATCH", ctype=APPLY)),
                      Deny)


def test_a_create_that_lost_the_race_for_its_name_keeps_the_room_of_the_winner() -> None:
    """Two creates of one name at once: the first reserved the room, the second was let
    through on it (the same object). When the second reaches the apiserver first, the first
    gets 409 AlreadyExists: the object exists, but the watch may not show it yet, so the
    first's reservation keeps its room until it does; it was dropped, and the next create
    got the room a second time. A 409 for an object the watch shows is just gone."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 2)  # SIMPLE: at most 3
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    first = ctx_for(pset, body={"metadata": {"name": "same"}})
    second = ctx_for(pset, body={"metadata": {"name": "same"}})
    assert decide(mw, first) is None
    assert decide(mw, second) is None
    run(_exit(mw, second, 201))
    run(_exit(mw, first, 409))
    assert used(mw, counts) == 3
    assert isinstance(decide(mw, ctx_for(pset, body={"metadata": {"name": "other"}})), Deny)
    counts.add("", "configmaps", "team-a", "same")  # the watch shows it: counted once
    assert used(mw, counts) == 3
    # a create of a name the watch already shows: 409, and no room held for it
    again = ctx_for(pset, body={"metadata": {"name": "existing-0"}})
    counts.set("", "configmaps", "team-a", 1)
    assert decide(mw, again) is None
    run(_exit(mw, again, 409))
    assert [m.partition("|")[0] for m in reservations(mw)] == ["same"]


def test_a_yaml_create_is_named_and_counted_once() -> None:
    """``Content-Type: application/yaml`` (the apiserver accepts it): its name was not read,
    so its denial named no object and its reservation was counted next to its object until it
    ended."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    body = b"apiVersion: v1\ndata: {k: v}\nkind: ConfigMap\nmetadata:\n  name: y-1\n"
    made = ctx_for(pset, body=body, ctype="application/yaml")
    assert mw.wants_body(made)
    assert decide(mw, made) is None
    assert [m.partition("|")[0] for m in reservations(mw)] == ["y-1"]
    run(_exit(mw, made, 201))
    counts.add("", "configmaps", "team-a", "y-1")
    assert used(mw, counts) == 2  # the object, once
    assert decide(mw, ctx_for(pset, body={"metadata": {"name": "j-2"}})) is None
    denied = decide(mw, ctx_for(pset, body=b"metadata: {name: y-3}", ctype="application/yaml"))
    assert isinstance(denied, Deny)
    assert denied.status.message.startswith('configmaps "y-3" is forbidden: exceeded quota')
    assert denied.status.details == {"name": "y-3", "kind": "configmaps"}


@pytest.mark.parametrize("group", ["", "events.k8s.io"])
def test_aligned_quotas_do_not_limit_events(group: str) -> None:
    """The apiserver's quota ignores events (``DefaultIgnoredResources``: neither its admission
    nor its controller counts them, whatever ``count/events`` says), so aligning with a
    ResourceQuota or ClusterResourceQuota denied events the apiserver admits. The entry's own
    ``max`` still counts them; with ``alignWith`` only nothing limits them."""
    counts = MemoryQuotaCounts()
    counts.set(group, "events", "team-a", 2)
    counts.add_quota("ResourceQuota", "rq", {"count/events": 1, "count/events.events.k8s.io": 1},
                     namespaces=["team-a"])
    counts.add_quota("ClusterResourceQuota", "crq", {"count/events": 0,
                                                     "count/events.events.k8s.io": 0})
    mw = Quota(counts=counts)
    aligned = f"alignWith: [ResourceQuota, ClusterResourceQuota], apiGroups: ['{group}']"
    pset = policies(f"    - {{resources: [events], namespaces: ['team-*'], max: 3, {aligned}}}\n"
                    f"    - {{name: only-aligned, resources: [events], namespaces: ['team-*'], "
                    f"{aligned}}}")
    base = f"/apis/{group}/v1" if group else "/api/v1"
    path = f"{base}/namespaces/team-a/events"
    assert decide(mw, ctx_for(pset, path, body={"metadata": {"name": "e-2"}})) is None
    denied = decide(mw, ctx_for(pset, path, body={"metadata": {"name": "e-3"}}))
    assert isinstance(denied, Deny)
    key = f"count/events.{group}" if group else "count/events"
    assert f"exceeded quota: team-quota, requested: {key}=1, used: {key}=3, limited: " \
           f"{key}=3" in denied.status.message
    counts.quotas_synced = False  # nor do they wait for the quotas' sync
    assert isinstance(decide(mw, ctx_for(pset, path, body={"metadata": {"name": "e-4"}})),
                      Deny)


UPSERTS = """\
    - {resources: [services, endpoints, limitranges, events, configmaps], namespaces: ['team-*'],
       max: 1}
    - {resources: [leases], apiGroups: [coordination.k8s.io], namespaces: ['team-*'], max: 1}
    - {resources: [events], apiGroups: [events.k8s.io], namespaces: ['team-*'], max: 1}"""
UPSERTING = [("", "services"), ("", "endpoints"), ("", "limitranges"), ("", "events"),
             ("coordination.k8s.io", "leases"), ("events.k8s.io", "events")]


def _named(group: str, resource: str, name: str, namespace: str = "team-a") -> str:
    base = f"/apis/{group}/v1" if group else "/api/v1"
    return f"{base}/namespaces/{namespace}/{resource}/{name}"


@pytest.mark.parametrize(("group", "resource"), UPSERTING)
def test_a_put_that_creates_is_checked_like_a_create(group: str, resource: str) -> None:
    """The apiserver creates a service, an endpoints, a limitrange, a lease or an event on a
    PUT to a name that does not exist (their strategies allow create on update), and its
    ResourceQuota admission charges it as a create: opgate let every such PUT through, so
    creates went past the limit that way (client-go's leader election and endpoints
    controllers create with Update). A PUT to an object the watch shows is an update."""
    counts = MemoryQuotaCounts()
    counts.set(group, resource, "team-a", 1)  # existing-0: full
    mw = Quota(counts=counts)
    pset = policies(UPSERTS)
    put = ctx_for(pset, _named(group, resource, "new"), method="PUT",
                  body={"metadata": {"name": "new"}})
    decision = decide(mw, put)
    assert isinstance(decision, Deny), resource
    key = f"count/{resource}.{group}" if group else f"count/{resource}"
    shown = f"{resource}.{group}" if group else resource
    assert decision.status.message == (
        f'{shown} "new" is forbidden: exceeded quota: team-quota, requested: {key}=1, '
        f"used: {key}=1, limited: {key}=1")
    update = ctx_for(pset, _named(group, resource, "existing-0"), method="PUT",
                     body={"metadata": {"name": "existing-0"}})
    assert decide(mw, update) is None
    assert not mw.wants_body(put)  # the name is the path's


def test_a_put_that_cannot_create_is_never_counted() -> None:
    """configmaps (and pods, secrets, custom resources…) answer 404 to a PUT of a name that
    does not exist: an update only; nor is a PUT to a subresource a create."""
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    counts.set("", "services", "team-a", 1)
    mw = Quota(counts=counts)
    pset = policies(UPSERTS)
    assert decide(mw, ctx_for(pset, _named("", "configmaps", "new"), method="PUT")) is None
    assert decide(mw, ctx_for(pset, _named("", "services", "new") + "/status",
                              method="PUT")) is None
    assert reservations(mw, "/configmaps/team-a") == reservations(mw, "/services/team-a") == {}


def test_a_put_that_creates_reserves_and_an_update_after_all_frees_it() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts)
    pset = policies("    - {resources: [services], namespaces: ['team-*'], max: 2}")
    made = ctx_for(pset, _named("", "services", "s1"), method="PUT")
    assert decide(mw, made) is None
    (member,) = reservations(mw, "/services/team-a")
    assert member.startswith("s1|")
    run(_exit(mw, made, 201))  # created: kept until the watch shows it
    # one the counts took for a create that the apiserver answered 200: it existed
    updated = ctx_for(pset, _named("", "services", "s2"), method="PUT")
    assert decide(mw, updated) is None
    run(_exit(mw, updated, 200))
    assert counts.settled == [True, False]
    assert [m.partition("|")[0] for m in reservations(mw, "/services/team-a")] == ["s1"]
    assert decide(mw, ctx_for(pset, _named("", "services", "s3"), method="PUT")) is None
    assert isinstance(decide(mw, ctx_for(pset, _named("", "services", "s4"), method="PUT")),
                      Deny)


def test_not_synced_names_fail_a_put_that_may_create_as_the_policy_says() -> None:
    counts = MemoryQuotaCounts()
    counts.unsync("", "services")
    pset = policies("    - {resources: [services], namespaces: ['team-*'], max: 2}")
    closed = decide(Quota(counts=counts), ctx_for(pset, _named("", "services", "x"),
                                                  method="PUT"))
    assert isinstance(closed, Deny) and closed.status.code == 503


def test_not_synced_names_fail_an_apply_as_the_policy_says() -> None:
    counts = MemoryQuotaCounts()
    counts.unsync("", "configmaps")
    closed = decide(Quota(counts=counts), ctx_for(policies(SIMPLE), CM + "/x", method="PATCH",
                                                  ctype=APPLY))
    assert isinstance(closed, Deny) and closed.status.code == 503


def test_the_watch_showing_the_object_lets_its_reservation_go_soon() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts, linger_seconds=5, settle_seconds=30)
    pset = policies(SIMPLE)

    async def go() -> dict[str, float]:
        ctx = ctx_for(pset, body={"metadata": {"name": "cm-1"}})
        assert await settle(mw.entry(ctx)) is None
        counts.add("", "configmaps", "team-a", "cm-1")  # the event may come before the answer
        await asyncio.sleep(0)  # the settlement runs as a task
        ctx.status_code = 201
        await settle(mw.exit(ctx))  # 201: "at most 30 s more" does not lengthen the 5 s
        return reservations(mw)

    (expiry,) = run(go()).values()
    now = mw.store.now_us()  # type: ignore[attr-defined]
    assert now < expiry <= now + 5_000_000
    assert used(mw, counts) == 1  # the object, once: its reservation is "seen"


def test_generate_name_creates_are_not_counted_twice_by_their_replica() -> None:
    counts = MemoryQuotaCounts()
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    ctx = ctx_for(pset, body={"metadata": {"generateName": "gen-"}})
    assert decide(mw, ctx) is None
    (member,) = reservations(mw)
    assert member.startswith("|")  # no name yet: the token alone
    run(_exit(mw, ctx, 201))
    counts.add("", "configmaps", "team-a", "other-x1", "other-")  # not ours
    assert used(mw, counts) == 2
    counts.add("", "configmaps", "team-a", "gen-abcde", "gen-")  # ours: the token is "seen"
    assert used(mw, counts) == 2
    assert counts.seen("", "configmaps", "team-a")[-1] == member[member.index("|"):]


class DownStore:
    """A shared store that cannot answer (Redis down)."""

    calls = 0

    async def reserve(self, request: Reservation) -> object:
        self.calls += 1
        from proxy.stores.base import StoreUnavailable
        raise StoreUnavailable("redis: ConnectionError: refused")

    async def settle(self, scope: str, member: str, ttl: float | None) -> None:
        from proxy.stores.base import StoreUnavailable
        raise StoreUnavailable("redis: ConnectionError: refused")

    def health(self) -> dict[str, object]:
        return {}

    async def close(self) -> None:
        return None


def test_store_down_reserves_locally_when_open_and_answers_503_when_closed() -> None:
    from proxy.stores.breaker import ResilientStore

    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 1)
    down = DownStore()
    store = ResilientStore(down, failures=2, reset_after=60)  # type: ignore[arg-type]
    mw = Quota(counts=counts, store=store)
    before = telemetry.REGISTRY.get_sample_value(
        "opgate_quota_reservations_total", {"backend": "fallback"}) or 0.0
    closed = decide(mw, ctx_for(policies(SIMPLE), body={"metadata": {"name": "c"}}))
    assert isinstance(closed, Deny)
    assert (closed.status.code, closed.decision) == (503, "unavailable")
    assert "quota store is unavailable" in closed.status.message
    assert "fails closed" in closed.status.message
    assert dict(closed.status.headers)["Retry-After"] == "1"  # (client-go waits and retries)
    # failure: open: reserved in-process, still exact for this replica
    pset = policies(SIMPLE, failure="open")
    ctxs = [ctx_for(pset, body={"metadata": {"name": f"o-{i}"}}) for i in range(3)]
    results = [decide(mw, c) for c in ctxs]
    assert [r is None for r in results] == [True, True, False]
    assert isinstance(results[2], Deny) and results[2].status.code == 403
    assert store.breaker.state == "open" and down.calls == 2  # no more calls once open
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_quota_reservations_total", {"backend": "fallback"}) == before + 2
    run(_exit(mw, ctxs[0], 422))  # settles the in-process reservation; Redis is skipped
    assert decide(mw, ctx_for(pset, body={"metadata": {"name": "o-3"}})) is None


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
    assert denial_message("apps", "deployments", "", "q", [("count/deployments.apps", 2, 2)]) == (
        "deployments.apps is forbidden: exceeded quota: q, requested: count/deployments.apps=1, "
        "used: count/deployments.apps=2, limited: count/deployments.apps=2")


# --- the counter's bookkeeping -------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tally_counts_names_from_list_and_events() -> None:
    tally = Tally()
    assert tally.observed("a") is None and tally.exists("a", "x") is None  # not synced
    assert tally.replace([("a", "x"), ("a", "y"), ("b", "z")]) == {"a", "b"}
    assert (tally.observed("a"), tally.observed("b"), tally.observed("c")) == (2, 1, 0)
    assert tally.exists("a", "x") and not tally.exists("a", "z")
    assert tally.seen("a") == ()  # the first list is not "lately"
    tally.added("a", "w")
    tally.added("a", "w")  # the same event again (a re-watch) counts once
    tally.deleted("b", "z")
    assert (tally.observed("a"), tally.observed("b")) == (3, 0)
    assert tally.seen("a") == ("w",)
    assert tally.replace([("a", "x"), ("a", "v")]) == {"a"}
    assert tally.seen("a") == ("/w", "v")  # w is gone; v appeared while the watch was down
    assert not tally.exists("a", "w")


def test_a_name_deleted_and_created_again_counts_until_the_watch_shows_it() -> None:
    """A name that appeared lately is "seen" (its reservation already counted as an object)
    only while its object exists: once deleted, a create of the same name again must count,
    or a burst recreating deleted names overshoots the limit."""
    counts = QuotaCounts(UpstreamConfig(url="https://127.0.0.1:1"))  # not started: no watch
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    mw.prepare(pset)
    tally = counts._counted[("", "configmaps")].tally
    tally.replace([])
    for name in ("a", "b", "c"):
        tally.added("team-a", name)
    assert tally.seen("team-a") == ("a", "b", "c")
    for name in ("a", "b"):
        tally.deleted("team-a", name)
    tally.replace([])  # c deleted while the watch was down
    assert tally.seen("team-a") == ("/a", "/b", "/c") and tally.observed("team-a") == 0
    results = [decide(mw, ctx_for(pset, body={"metadata": {"name": n}})) for n in "abcde"]
    assert [r is None for r in results] == [True, True, True, False, False]
    assert isinstance(results[3], Deny) and results[3].status.message.endswith(
        "used: count/configmaps=3, limited: count/configmaps=3")


def test_deleting_what_this_replica_created_frees_its_room_at_once() -> None:
    """The other side of the test above: a create's reservation lingers a few seconds after
    the watch showed its object; deleting the object then must free the room, not count the
    lingering reservation again (its creator marked it shown: the name's "/<name>" says its
    object is gone). Also on a second replica, whose watch saw the object come and go."""
    counts = QuotaCounts(UpstreamConfig(url="https://127.0.0.1:1"))  # not started: no watch
    mw = Quota(counts=counts)
    pset = policies(SIMPLE)
    mw.prepare(pset)
    tally = counts._counted[("", "configmaps")].tally
    tally.replace([])
    other = QuotaCounts(UpstreamConfig(url="https://127.0.0.1:1"))  # a second replica
    mw2 = Quota(counts=other, store=mw.store)
    mw2.prepare(pset)
    tally2 = other._counted[("", "configmaps")].tally
    tally2.replace([])

    async def shown(name: str) -> None:  # both watches show it; the creator marks it (a task)
        tally.added("team-a", name)
        tally2.added("team-a", name)
        await asyncio.sleep(0.01)

    for name in ("a", "b", "c"):
        ctx = ctx_for(pset, body={"metadata": {"name": name}})
        assert decide(mw, ctx) is None
        run(_exit(mw, ctx, 201))
        run(shown(name))  # its reservation lingers
    assert sorted(m.rsplit("|")[0] for m in reservations(mw)) == ["a", "b", "c"]
    assert all(m.endswith("~") for m in reservations(mw))
    assert isinstance(decide(mw, ctx_for(pset, body={"metadata": {"name": "d"}})), Deny)
    for name in ("a", "b"):
        tally.deleted("team-a", name)
        tally2.deleted("team-a", name)
    tally.replace([])  # c deleted while the watches were down
    tally2.replace([])
    assert len(reservations(mw)) == 3  # still lingering, but not counted
    results = [decide(mw2, ctx_for(pset, body={"metadata": {"name": n}})) for n in "wxyz"]
    assert [r is None for r in results] == [True, True, True, False]


def test_seen_names_are_forgotten_after_a_while_and_bounded() -> None:
    clock = Clock()
    tally = Tally(clock=clock, recent_seconds=60, recent_max=3)
    tally.replace([])
    for name in ("a", "b", "c", "d"):
        tally.added("ns", name)
    assert tally.seen("ns") == ("b", "c", "d")
    clock.now += 61
    tally.added("ns", "e")
    assert tally.seen("ns") == ("e",)
    assert tally.observed("ns") == 5  # counts are never forgotten


def test_namespaces_that_are_gone_are_forgotten() -> None:
    """Namespaces created and deleted over weeks: what is remembered of names seen lately and of
    expected creates follows the namespaces in use, not every one there ever was."""
    clock = Clock()
    tally = Tally(clock=clock, recent_seconds=60, expect_seconds=60, settle_seconds=30)
    tally.replace([])
    for n in range(2000):
        ns = f"ns-{n}"
        tally.added(ns, "a")
        tally.deleted(ns, "a")  # "/a" stays "seen" for recent_seconds
        tally.settle(tally.expect(ns, "b", "", f"t{n}"), None)  # never shown
        clock.now += 0.5
    assert len(tally.recent) <= 200 and len(tally.expected) <= 200
    clock.now += 61
    tally.added("live", "x")
    assert set(tally.recent) == {"live"} and tally.expected == {}
    assert tally.names == {"live": {"x"}} and tally.seen("live") == ("x",)


def test_resource_quotas_of_namespaces_that_are_gone_are_forgotten() -> None:
    """ResourceQuotas created and deleted with their namespaces: the counter keeps nothing of
    a namespace whose quotas are all gone."""
    counts = QuotaCounts(UpstreamConfig(url="http://127.0.0.1:9"))
    fed: dict[str, object] = {}

    async def capture(label: str, path: object, replace: object, event: object, *,
                      metadata_only: bool) -> None:
        fed.update(replace=replace, event=event)

    counts._list_watch = capture  # type: ignore[method-assign]
    run(counts._run_rq())
    replace, event = fed["replace"], fed["event"]
    replace([])  # type: ignore[operator]

    def rq(ns: str, scoped: bool = False) -> dict[str, object]:
        spec: dict[str, object] = {"hard": {"count/configmaps": "5"}}
        if scoped:
            spec["scopes"] = ["BestEffort"]
        return {"metadata": {"namespace": ns, "name": "q"}, "spec": spec}

    for n in range(1000):
        event("ADDED", rq(f"ns-{n}"))  # type: ignore[operator]
        event("DELETED", rq(f"ns-{n}"))  # type: ignore[operator]
        event("ADDED", rq(f"sc-{n}"))  # type: ignore[operator]
        event("MODIFIED", rq(f"sc-{n}", scoped=True))  # type: ignore[operator]
    event("ADDED", rq("live"))  # type: ignore[operator]
    assert set(counts._rq) == {"live"}
    assert counts.aligned("ns-1", resource_quotas=True, cluster_quotas=False) == []
    assert counts.aligned("live", resource_quotas=True, cluster_quotas=False) == [
        ("ResourceQuota", "q", {"count/configmaps": 5})]


def test_expected_creates_end_when_the_watch_shows_them() -> None:
    clock = Clock()
    tally = Tally(clock=clock, settle_seconds=30, expect_seconds=60)
    tally.replace([])
    fired: list[str] = []
    e = tally.expect("a", "cm-1", "", "t1", lambda: fired.append("cm-1"))
    tally.settle(e, True)  # 201, no event yet
    assert tally.expected == {"a": [e]}
    tally.added("a", "cm-1")
    assert fired == ["cm-1"] and tally.expected == {}
    # the event may come first, while the create is still in flight
    e2 = tally.expect("a", "cm-2", "", "t2", lambda: fired.append("cm-2"))
    tally.added("a", "cm-2")
    tally.settle(e2, True)
    assert fired == ["cm-1", "cm-2"]
    # a failed create is not waited for
    e3 = tally.expect("a", "cm-3", "", "t3", lambda: fired.append("cm-3"))
    tally.settle(e3, False)
    assert tally.expected == {}
    # one created but never shown is forgotten after settle_seconds
    e4 = tally.expect("a", "cm-4", "", "t4")
    tally.settle(e4, None)
    clock.now += 31
    tally.expect("a", "cm-5", "", "t5")
    assert [x.name for x in tally.expected["a"]] == ["cm-5"]


def test_generate_name_creates_end_with_a_new_object_of_that_prefix() -> None:
    tally = Tally()
    tally.replace([])
    fired: list[str] = []
    e = tally.expect("a", "", "gen-", "tok", lambda: fired.append("gen"))
    tally.settle(e, True)
    tally.added("a", "other-1", "other-")
    assert fired == [] and tally.seen("a") == ("other-1",)
    tally.added("a", "gen-abcde", "gen-")
    assert fired == ["gen"] and tally.expected == {}
    assert tally.seen("a") == ("other-1", "gen-abcde", "|tok")


def test_a_relist_ends_named_expected_creates() -> None:
    tally = Tally()
    tally.replace([])
    fired: list[str] = []
    e = tally.expect("a", "cm-1", "", "t", lambda: fired.append("cm-1"))
    tally.settle(e, True)
    tally.replace([("a", "cm-1")])
    assert fired == ["cm-1"] and tally.observed("a") == 1


@pytest.mark.parametrize("raw, value, text", [
    ("10", 10, "10"), (7, 7, ""), ("1k", 1000, "1k"), ("2Ki", 2048, "2Ki"), ("1e3", 1000, "1e3"),
    # n objects fit while n <= the quantity (the apiserver compares quantities): 1.5 lets one in
    ("1500m", 1, "1500m"), ("1.5", 1, "1500m"), ("500m", 0, "500m"), (" 3 ", 3, "3"),
    ("abc", None, ""), (True, None, ""), ("-1", None, ""), ("5X", None, ""), (1.5, None, "")])
def test_parse_limit(raw: object, value: int | None, text: str) -> None:
    limit = parse_limit(raw)
    assert limit == value
    if limit is not None:
        assert isinstance(limit, Count) and limit.text == text


@pytest.mark.parametrize("raw, text", [
    ("1000", "1k"), ("2000000", "2M"), ("1500", "1500"), ("+5", "5"), ("007", "7"),
    ("1.0", "1"), ("2000m", "2"), ("0.5", "500m"), ("1500k", "1500k"), ("1E", "1E"),
    ("10e2", "1e3"), ("1e0", "1"), ("1024Ki", "1Mi"), ("1.5Ki", "1536"), ("0.5Ki", "512"),
    ("1Gi", "1Gi"), ("0", "0"), ("0Ki", "0")])
def test_a_limit_reads_as_the_apiserver_prints_it(raw: str, text: str) -> None:
    """The quota admission prints a limit as a canonical quantity whatever its spelling: a
    ClusterResourceQuota (on OpenShift a custom resource, stored as written) with ``hard:
    {count/configmaps: "1000"}`` denies with ``limited: count/configmaps=1k``, as the
    apiserver rewrites a ResourceQuota's ``"1000"`` when it stores it."""
    limit = parse_limit(raw)
    assert isinstance(limit, Count) and limit.text == text


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
    assert counts.observed("", "configmaps", "a") is None
    assert counts.exists("", "configmaps", "a", "x") is None
    assert counts.seen("", "configmaps", "a") == ()
    assert counts.aligned("a", resource_quotas=True, cluster_quotas=False) is None
    assert counts.expect("", "secrets", "a", "x", "", "t") is None  # not tracked
    assert "configmaps=syncing" in counts.describe()


def test_quota_usage_series_are_marked_removed_not_cleared_under_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prometheus_client cannot remove a series in multiprocess mode (it warns and keeps it):
    with --workers the old set's usage series are set to metricfiles.REMOVED, which the
    supervisor's /metrics leaves out, instead of staying at their last value (or at 0), and
    then taken out of the metric (the file's entry is dropped later, metricfiles.forget)."""
    from proxy.engine import telemetry
    from proxy.engine.metricfiles import REMOVED

    telemetry.set_quota_usage("gone-ns", "configmaps", 7)
    monkeypatch.setattr(telemetry, "_MULTIPROCESS", True)

    def refuse() -> None:
        raise AssertionError("clear() is a no-op in multiprocess mode")

    written: list[float] = []
    child = telemetry.QUOTA_USAGE.labels("gone-ns", "configmaps")
    monkeypatch.setattr(child, "set", written.append)
    monkeypatch.setattr(telemetry.QUOTA_USAGE, "clear", refuse)
    telemetry.clear_quota_usage()
    assert written == [REMOVED]
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_quota_usage", {"namespace": "gone-ns", "resource": "configmaps"}) is None


def test_quota_usage_series_at_zero_go_away_without_another_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A namespace's series at 0 for 5 minutes goes away (README) also when no other usage
    changes after it: they went only at the next update of some usage, so once an operator's
    preview namespaces were deleted and nothing else changed, their zeros stayed on every
    dashboard for as long as the cluster was quiet. A scrape removes them (in a single process,
    the flush before each render; with --workers the levels' tick, each 50 ms)."""
    clock = Clock()
    monkeypatch.setattr(telemetry, "_clock", clock, raising=False)
    monkeypatch.setattr(telemetry, "_quota_zero_sweep", 0.0, raising=False)
    telemetry.clear_quota_usage()

    def scrape() -> dict[str, float]:
        telemetry.flush()  # what /metrics runs on the loop before its render
        return {s.labels["namespace"]: s.value for m in telemetry.REGISTRY.collect()
                if m.name == "opgate_quota_usage" for s in m.samples}

    telemetry.set_quota_usage("live", "configmaps", 3)
    telemetry.set_quota_usage("preview-1", "configmaps", 2)
    clock.now += 10
    telemetry.set_quota_usage("preview-1", "configmaps", 0)  # its objects, then it, deleted
    assert scrape() == {"live": 3, "preview-1": 0}
    clock.now += telemetry.QUOTA_USAGE_ZERO_SECONDS + 1
    assert scrape() == {"live": 3}
    telemetry.clear_quota_usage()


def test_quota_usage_series_of_namespaces_left_at_zero_go_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Namespaces created and deleted over the weeks a sidecar runs: a series at 0 shows 0 for
    a while, then goes (as a namespace that never held an object has none), so the series
    follow the namespaces in use, not every one there ever was."""
    clock = Clock()
    monkeypatch.setattr(telemetry, "_clock", clock, raising=False)
    monkeypatch.setattr(telemetry, "_quota_zero_sweep", 0.0, raising=False)
    telemetry.clear_quota_usage()

    def series() -> dict[str, float]:
        return {s.labels["namespace"]: s.value for m in telemetry.REGISTRY.collect()
                if m.name == "opgate_quota_usage" for s in m.samples}

    telemetry.set_quota_usage("live", "configmaps", 3)
    for n in range(1000):
        telemetry.set_quota_usage(f"ns-{n}", "configmaps", 1)
        telemetry.set_quota_usage(f"ns-{n}", "configmaps", 0)  # its objects, then it, deleted
        clock.now += 0.1
    assert series()["ns-999"] == 0  # at 0 for now (what the e2e tests read after a delete)
    clock.now += 300  # telemetry.QUOTA_USAGE_ZERO_SECONDS
    telemetry.set_quota_usage("live", "configmaps", 4)
    telemetry.set_quota_usage("emptied", "configmaps", 0)
    assert series() == {"live": 4, "emptied": 0}
    telemetry.clear_quota_usage()


PROTO = "application/vnd.kubernetes.protobuf"


@pytest.mark.parametrize(("body", "ctype", "said"), [
    (b"{not json", "application/json",
     "the object provided is unrecognized (must be a configmaps object): couldn't get "
     "version/kind; json parse error: "),
    (b"", "application/json", "(<empty>)"),
    (None, "application/json", "(<empty>)"),  # no body at all (Content-Length: 0)
    (b"[]", "application/json", "a JSON array, not an object (5b5d)"),
    (b'"x"', "application/json", "(227822)"),
    (b'{"metadata": []}', "application/json", "metadata: a JSON array, not an object"),
    (b'{"metadata": {"name": 5}}', "application/json", "metadata.name: a JSON number"),
    (b'{"kind": 5, "metadata": {"name": "k"}}', "application/json", "kind: a JSON number"),
    (b'{"apiVersion": "apps/v1", "kind": "ConfigMap", "metadata": {"name": "k"}}',
     "application/json",
     "the API version in the data (apps/v1) does not match the expected API version (v1)"),
    (b"k8s\x00\xff\xff\xff", PROTO, "the object provided is unrecognized (must be a configmaps "
                                    "object): the protobuf message is malformed (6b387300ffffff)"),
    (b"hello", PROTO, "provided data does not appear to be a protobuf message, expected prefix "
                      "[107 56 115 0] (68656c6c6f)"),
    (b"", PROTO, "empty data (<empty>)"),
])
def test_a_body_the_apiserver_cannot_decode_is_its_400_not_a_quota_403(
        body: bytes | None, ctype: str, said: str) -> None:
    # the apiserver decodes a create's body before any admission runs: it answers these 400
    # BadRequest whatever the quota (tests/e2e/test_quota.py compares the real one); opgate,
    # at the limit, answered its quota's 403 ("configmaps is forbidden: exceeded quota")
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts)
    before = denials("configmaps")
    ctx = ctx_for(policies(SIMPLE), ctype=ctype)
    ctx.body = body
    decision = decide(mw, ctx)
    assert isinstance(decision, Deny), decision
    assert (decision.status.code, decision.status.reason) == (400, "BadRequest")
    assert said in decision.status.message, decision.status.message
    assert denials("configmaps") == before and reservations(mw) == {}
    # below the limit the call goes on as before: the apiserver answers it itself
    counts.set("", "configmaps", "team-a", 0)
    ctx = ctx_for(policies(SIMPLE), ctype=ctype)
    ctx.body = body
    assert decide(mw, ctx) is None


def test_a_create_naming_no_object_is_left_to_the_apiservers_422() -> None:
    # neither name nor generateName: the apiserver's validation (422 Invalid, "name or
    # generateName is required") runs before its quota admission, so at the limit opgate lets
    # it on rather than answer a quota 403 for an object that can never be made
    counts = MemoryQuotaCounts()
    counts.set("", "configmaps", "team-a", 3)
    mw = Quota(counts=counts)
    for body in ({"apiVersion": "v1", "kind": "ConfigMap"}, {"metadata": {"name": ""}},
                 {"metadata": None}):
        assert decide(mw, ctx_for(policies(SIMPLE), body=body)) is None, body
        assert reservations(mw) == {}
