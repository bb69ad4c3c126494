"""spec.audit → the apiserver's audit Policy semantics: parsing with file:line errors, rule
matching as checker.go does it, the merged plan of a policy set, which bodies it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.app import section_parsers
from proxy.engine.check import check
from proxy.engine.context import Identity
from proxy.engine.policies import build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.schema import PolicyError
from proxy.engine.yamlload import parse_yaml_documents
from proxy.middlewares.audit_spec import (
    AuditPlan,
    AuditRule,
    AuditSpec,
    GroupResources,
    build_plan,
    parse_section,
)

POLICY = """apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: {name}}}
spec:
  audit:
{audit}
"""


def parse(text: str) -> tuple[AuditSpec, list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file="a.yaml", errors=errors)
    spec = parse_section(docs[0], errors)
    return spec, [str(e) for e in errors]


def test_full_section() -> None:
    spec, errors = parse(
        "level: Request\n"
        "omitStages: [ResponseStarted]\n"
        "omitManagedFields: true\n"
        "rules:\n"
        "  - level: None\n"
        "    users: [system:kube-proxy]\n"
        "    userGroups: [system:nodes]\n"
        "    verbs: [watch]\n"
        "  - level: RequestResponse\n"
        "    resources:\n"
        "      - {group: '', resources: [pods, pods/log], resourceNames: [web]}\n"
        "      - {group: apps}\n"
        "    namespaces: [team-a, '']\n"
        "    omitStages: [ResponseComplete]\n"
        "    omitManagedFields: false\n"
        "  - level: Metadata\n"
        "    nonResourceURLs: ['/healthz*', /version]\n")
    assert errors == []
    assert spec.level == "Request"
    assert spec.omit_stages == {"ResponseStarted"}
    assert spec.omit_managed_fields is True
    first, second, third = spec.rules
    assert first == AuditRule(level="None", users=frozenset({"system:kube-proxy"}),
                              user_groups=frozenset({"system:nodes"}),
                              verbs=frozenset({"watch"}), source="a.yaml:5")
    assert second.resources == (GroupResources("", ("pods", "pods/log"), ("web",)),
                                GroupResources("apps"))
    assert second.namespaces == {"team-a", ""}
    assert (second.omit_stages, second.omit_managed_fields) == ({"ResponseComplete"}, False)
    assert third.non_resource_urls == ("/healthz*", "/version")
    assert third.omit_managed_fields is None


@pytest.mark.parametrize(("body", "message"), [
    ("level: Verbose", 'a.yaml:1: spec.audit.level: must be one of None, Metadata, Request, '
                       'RequestResponse (got "Verbose")'),
    ("rules:\n  - verbs: [get]", 'a.yaml:2: missing required field "level" in '
                                 'spec.audit.rules[0]'),
    ("rules:\n  - level: None\n    verb: [get]",
     'a.yaml:3: unknown field "verb" in spec.audit.rules[0]'),
    ("omitStages: [Done]", 'a.yaml:1: spec.audit.omitStages: "Done" is not one of '
                           'RequestReceived, ResponseStarted, ResponseComplete, Panic'),
    ("rules:\n  - level: None\n    nonResourceURLs: [/x]\n    namespaces: [a]",
     "a.yaml:3: spec.audit.rules[0].nonResourceURLs: a rule applies either to resources "
     '("resources", "namespaces") or to "nonResourceURLs", not both'),
    ("rules:\n  - level: None\n    nonResourceURLs: [healthz]",
     'a.yaml:3: spec.audit.rules[0].nonResourceURLs: "healthz" must begin with "/" (or be "*")'),
    ("rules:\n  - level: None\n    nonResourceURLs: ['/a*/b']",
     'a.yaml:3: spec.audit.rules[0].nonResourceURLs: "/a*/b": "*" is only allowed at the end'),
    ("rules:\n  - level: None\n    verbs: [GET]",
     'a.yaml:3: spec.audit.rules[0].verbs: "GET": verbs are lower-case (get, list, watch, '
     "create, …)"),
    # opgate's other sections take globs ("*", "team-*"); the apiserver's policy has none,
    # and a rule with one silently matched nothing
    ("rules:\n  - level: None\n    verbs: ['*']",
     'a.yaml:3: spec.audit.rules[0].verbs: "*": audit rules have no wildcard verb (leave '
     '"verbs" out to match every verb)'),
    ("rules:\n  - level: None\n    namespaces: [team-a, 'team-*']",
     'a.yaml:3: spec.audit.rules[0].namespaces: "team-*" is not a namespace name: audit rules '
     'name namespaces exactly ("" for cluster-scoped calls), without globs'),
    ("rules:\n  - level: None\n    namespaces: ['*']",
     'a.yaml:3: spec.audit.rules[0].namespaces: "*" is not a namespace name: audit rules '
     'name namespaces exactly ("" for cluster-scoped calls), without globs'),
    ("rules:\n  - level: None\n    resources:\n      - {group: Apps}",
     'a.yaml:4: spec.audit.rules[0].resources[0].group: "Apps" is not a valid API group '
     '("" is the core group)'),
    ("rules:\n  - level: None\n    resources:\n      - {resourceNames: [a]}",
     'a.yaml:4: spec.audit.rules[0].resources[0].resourceNames: needs "resources"'),
    ("rules:\n  - level: None\n    resources:\n      - {resources: [a/b/c]}",
     'a.yaml:4: spec.audit.rules[0].resources[0].resources: "a/b/c" is not a resource, '
     '"resource/subresource", "resource/*", "*/subresource" or "*"'),
    ("rules: {level: None}", "a.yaml:1: spec.audit.rules: expected a list, got a mapping"),
    ("- level: None", "a.yaml:1: spec.audit: expected a mapping, got a list"),
])
def test_errors_say_where(body: str, message: str) -> None:
    _, errors = parse(body)
    assert errors == [message]


def test_resource_names_of_wildcard_resources_are_taken_as_the_apiserver_takes_them() -> None:
    """``resourceNames`` with ``pods/*`` or ``*`` (the named objects' subresources, any named
    object of the group): the apiserver's validation only asks for some resource."""
    spec, errors = parse("rules:\n  - level: Request\n    resources:\n"
                         "      - {resources: ['pods/*', '*/status'], resourceNames: [web]}\n"
                         "      - {group: apps, resources: ['*'], resourceNames: [web]}\n")
    assert errors == []
    assert spec.rules[0].resources == (GroupResources("", ("pods/*", "*/status"), ("web",)),
                                       GroupResources("apps", ("*",), ("web",)))


def test_opgate_check_accepts_the_section_and_reports_lines(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(POLICY.format(name="p", audit="    rules: [{level: Request, verbs: [create]}]"))
    assert check([str(good)], parsers=section_parsers()) == []
    bad = tmp_path / "bad.yaml"
    bad.write_text(POLICY.format(name="p", audit="    rules:\n      - level: Everything"))
    assert check([str(bad)], parsers=section_parsers()) == [
        f'{bad}:7: spec.audit.rules[0].level: must be one of None, Metadata, Request, '
        'RequestResponse (got "Everything")']


def test_the_example_policy_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "policies" / "examples" / "audit.yaml"
    identity = example.with_name("identity.yaml")  # its userGroups rule needs one in the set
    assert check([str(example), str(identity)], parsers=section_parsers()) == []


# --- matching, as the apiserver's policy checker ------------------------------------------

SA = Identity(user="system:serviceaccount:ops:op",
              groups=("system:serviceaccounts", "system:serviceaccounts:ops",
                      "system:authenticated"))


def rule(**kw: object) -> AuditRule:
    return AuditRule(level="Request", **kw)  # type: ignore[arg-type]


def info(method: str, path: str, query: str = ""):  # type: ignore[no-untyped-def]
    return parse_request_info(method, path, query)


@pytest.mark.parametrize(("r", "method", "path", "query", "who", "expected"), [
    (rule(), "GET", "/version", "", None, True),
    (rule(users=frozenset({SA.user})), "GET", "/api/v1/pods", "", SA, True),
    (rule(users=frozenset({SA.user})), "GET", "/api/v1/pods", "", None, False),
    (rule(users=frozenset({"alice"})), "GET", "/api/v1/pods", "", SA, False),
    (rule(user_groups=frozenset({"system:serviceaccounts:ops"})), "GET", "/api/v1/pods", "", SA,
     True),
    (rule(user_groups=frozenset({"system:masters"})), "GET", "/api/v1/pods", "", SA, False),
    (rule(verbs=frozenset({"watch"})), "GET", "/api/v1/pods", "watch=true", None, True),
    (rule(verbs=frozenset({"list"})), "GET", "/api/v1/pods", "watch=true", None, False),
    (rule(verbs=frozenset({"deletecollection"})), "DELETE", "/api/v1/namespaces/a/pods", "", None,
     True),
    (rule(namespaces=frozenset({"a"})), "GET", "/api/v1/namespaces/a/pods/x", "", None, True),
    (rule(namespaces=frozenset({"a"})), "GET", "/api/v1/namespaces/b/pods/x", "", None, False),
    (rule(namespaces=frozenset({""})), "GET", "/api/v1/nodes/n1", "", None, True),
    (rule(namespaces=frozenset({"a"})), "GET", "/healthz", "", None, False),
    (rule(resources=(GroupResources("", ("pods",)),)), "GET", "/api/v1/namespaces/a/pods/x",
     "", None, True),
    (rule(resources=(GroupResources("", ("pods",)),)), "GET",
     "/api/v1/namespaces/a/pods/x/log", "", None, False),
    (rule(resources=(GroupResources("", ("pods/log",)),)), "GET",
     "/api/v1/namespaces/a/pods/x/log", "", None, True),
    (rule(resources=(GroupResources("", ("pods/*",)),)), "GET",
     "/api/v1/namespaces/a/pods/x/exec", "", None, True),
    (rule(resources=(GroupResources("", ("*/status",)),)), "PUT",
     "/api/v1/namespaces/a/pods/x/status", "", None, True),
    (rule(resources=(GroupResources("", ("*",)),)), "GET",
     "/apis/apps/v1/namespaces/a/deployments", "", None, False),
    (rule(resources=(GroupResources("apps"),)), "GET",
     "/apis/apps/v1/namespaces/a/deployments", "", None, True),
    (rule(resources=(GroupResources("", ("configmaps",), ("cfg",)),)), "GET",
     "/api/v1/namespaces/a/configmaps/cfg", "", None, True),
    (rule(resources=(GroupResources("", ("configmaps",), ("cfg",)),)), "GET",
     "/api/v1/namespaces/a/configmaps/other", "", None, False),
    # names with a wildcard resource: the apiserver's validation takes them (the checker
    # looks at the name before each resource)
    (rule(resources=(GroupResources("", ("pods/*",), ("web",)),)), "GET",
     "/api/v1/namespaces/a/pods/web/exec", "", None, True),
    (rule(resources=(GroupResources("", ("pods/*",), ("web",)),)), "GET",
     "/api/v1/namespaces/a/pods/db/exec", "", None, False),
    (rule(resources=(GroupResources("", ("*",), ("web",)),)), "DELETE",
     "/api/v1/namespaces/a/services/web", "", None, True),
    (rule(non_resource_urls=("/healthz*",)), "GET", "/healthz/etcd", "", None, True),
    (rule(non_resource_urls=("/version",)), "GET", "/version/", "", None, False),
    (rule(non_resource_urls=("*",)), "GET", "/api/v1/pods", "", None, False),
    (rule(verbs=frozenset({"post"}), non_resource_urls=("*",)), "POST", "/logs", "", None, True),
])
def test_rules_match_as_the_apiserver(r: AuditRule, method: str, path: str, query: str,
                                      who: Identity | None, expected: bool) -> None:
    call = info(method, path, query)
    assert (r.matches_user(who) and r.matches_call(call)) is expected


def test_first_match_wins_and_the_default() -> None:
    plan = AuditPlan(default="Metadata", rules=(
        AuditRule(level="None", verbs=frozenset({"watch"}), source="p.yaml:9"),
        AuditRule(level="Request", resources=(GroupResources("", ("configmaps",)),),
                  omit_stages=frozenset({"ResponseStarted"}), source="p.yaml:11"),
        AuditRule(level="None", resources=(GroupResources("", ("configmaps",)),)),
    ), omit_stages=frozenset({"Panic"}))
    watch = plan.decide(info("GET", "/api/v1/namespaces/a/configmaps", "watch=1"), None)
    assert (watch.level, watch.rule) == ("None", "p.yaml:9")
    create = plan.decide(info("POST", "/api/v1/namespaces/a/configmaps"), SA)
    assert (create.level, create.omit_stages, create.rule) == (
        "Request", {"Panic", "ResponseStarted"}, "p.yaml:11")
    other = plan.decide(info("GET", "/api/v1/namespaces/a/secrets/s"), SA)
    assert (other.level, other.rule, other.omit_stages) == ("Metadata", "", {"Panic"})


def plan_of(*audits: str) -> AuditPlan:
    text = "---\n".join(POLICY.format(name=f"p{i}", audit=a) for i, a in enumerate(audits))
    pset = build_policy_set([("p.yaml", text.encode())], parsers=section_parsers())
    return build_plan(pset.section("audit"))


def test_default_level() -> None:
    assert build_plan(()).default == "Metadata"  # --audit-log with no spec.audit anywhere
    assert plan_of("    omitStages: [ResponseStarted]").default == "Metadata"
    assert plan_of("    rules: [{level: Request, verbs: [create]}]").default == "None"
    assert plan_of("    level: Request\n    rules: [{level: None, verbs: [get]}]").default == \
        "Request"


def test_several_policies_merge_in_order() -> None:
    plan = plan_of("    omitStages: [ResponseStarted]\n"
                   "    rules: [{level: None, verbs: [watch]}]",
                   "    level: Metadata\n    omitStages: [Panic]\n    omitManagedFields: true\n"
                   "    rules: [{level: Request}]")
    assert [r.level for r in plan.rules] == ["None", "Request"]
    assert plan.default == "Metadata"
    assert plan.omit_stages == {"ResponseStarted", "Panic"}
    assert plan.omit_managed_fields is True


def test_bodies_are_read_only_where_a_rule_may_want_them() -> None:
    plan = AuditPlan(default="Metadata", rules=(
        AuditRule(level="Request", users=frozenset({"alice"}), verbs=frozenset({"create"}),
                  resources=(GroupResources("", ("secrets",)),)),
        AuditRule(level="None", user_groups=frozenset({"bots"})),
        AuditRule(level="Metadata", resources=(GroupResources("", ("secrets",)),)),
        AuditRule(level="Request", verbs=frozenset({"create"})),
    ))
    # alice's rule may match (identity is not known when the body is read)
    assert plan.may_want_body(info("POST", "/api/v1/namespaces/a/secrets"))
    assert not plan.may_want_body(info("PUT", "/api/v1/namespaces/a/secrets/s"))
    assert plan.may_want_body(info("POST", "/api/v1/namespaces/a/configmaps"))
    assert not plan.may_want_body(info("PUT", "/api/v1/namespaces/a/configmaps/c"))
    assert not plan.may_want_body(info("POST", "/logs"))  # non-resource: never a requestObject
    assert not AuditPlan().may_want_body(info("POST", "/api/v1/namespaces/a/configmaps"))
    # and once identity is known, alice gets Request, others the Metadata rule
    secret = info("POST", "/api/v1/namespaces/a/secrets")
    assert plan.decide(secret, Identity(user="alice")).level == "Request"
    assert plan.decide(secret, SA).level == "Metadata"
    assert plan.decide(secret, Identity(user="bot", groups=("bots",))).level == "None"
