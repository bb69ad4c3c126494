"""spec.rateLimits → validated RateLimitRule tuples, and how their matchers read RequestInfo."""

from __future__ import annotations

import pytest

from proxy.engine.policies import PolicyLoadError, build_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.schema import PolicyError
from proxy.engine.yamlload import parse_yaml_documents
from proxy.middlewares.ratelimit_spec import RateLimitRule, parse_section


def parse(text: str) -> tuple[tuple[RateLimitRule, ...], list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file="rl.yaml", errors=errors)
    rules = parse_section(docs[0], errors)
    return rules, [str(e) for e in errors]


def one(text: str) -> RateLimitRule:
    rules, errors = parse(text)
    assert errors == []
    assert len(rules) == 1
    return rules[0]


def test_full_rule_and_defaults() -> None:
    rule = one("""
- name: writes
  match: {verbs: [create, update], apiGroups: ["", apps], resources: [configmaps, "pods/*"],
          namespaces: ["team-*"], users: ["system:serviceaccount:ops:*"]}
  key: "{user}/{instance}"
  qps: 5
  burst: 10
  onExceed: wait
  maxWait: 500ms
  maxQueue: 7
  mode: dryrun
  failure: open
  instanceAnnotation: opgate.dev/qps
  maxQps: 50
  lease: true
""")
    assert (rule.name, rule.qps, rule.burst, rule.on_exceed, rule.max_wait) == (
        "writes", 5.0, 10, "wait", 0.5)
    assert (rule.max_queue, rule.mode, rule.failure, rule.lease) == (7, "dryrun", "open", True)
    assert (rule.instance_annotation, rule.max_qps) == ("opgate.dev/qps", 50.0)
    assert rule.key.fields == {"user", "instance"}
    assert rule.source == "rl.yaml:2"
    assert rule.match.named == {"create", "update"}  # pods/* is a glob: names nothing

    minimal = one("- {name: all, qps: 2.5}")
    assert (minimal.burst, minimal.on_exceed, minimal.max_wait, minimal.key.text) == (
        3, "reject", 2.0, "{user}")
    assert (minimal.mode, minimal.failure, minimal.max_qps, minimal.lease) == (
        None, None, 2.5, False)
    assert minimal.match.verbs.any and minimal.match.resources.any


@pytest.mark.parametrize("body, message", [
    ("{name: a, qps: 0}", "spec.rateLimits[0].qps: must be greater than 0"),
    ("{name: a, qps: -1}", "spec.rateLimits[0].qps: must be at least 0"),
    ("{name: a}", 'missing required field "qps" in spec.rateLimits[0]'),
    ("{qps: 1}", 'missing required field "name"'),
    ("{name: a, qps: 1, burst: 0}", "spec.rateLimits[0].burst: must be at least 1"),
    ("{name: a, qps: 1, burst: 1.5}", "spec.rateLimits[0].burst: expected an integer"),
    # beyond what a bucket's arithmetic (µs, Redis PEXPIRE) holds: every decision was an error
    ("{name: a, qps: 1e-12}", "spec.rateLimits[0].qps: must be at least 1e-09"),
    ("{name: a, qps: 1e300}", "spec.rateLimits[0].qps: must be at most"),
    ("{name: a, qps: 1, burst: 1000000000}", "spec.rateLimits[0].burst: must be at most"),
    ("{name: a, qps: 1, key: '{instance}', instanceAnnotation: q, maxQps: 1e9}",
     "maxQps: must be at most"),
    # maxQps bounds an annotated instance's rate: below 1e-9 its bucket was out of bounds too
    ("{name: a, qps: 1, key: '{instance}', instanceAnnotation: q, maxQps: 1e-10}",
     "spec.rateLimits[0].maxQps: must be at least 1e-09"),
    ("{name: a, qps: 1, key: '{user}/{pod}'}", "unknown placeholder {pod}"),
    ("{name: a, qps: 1, key: '{user'}", "unbalanced brace"),
    ("{name: a, qps: 1, key: ''}", "spec.rateLimits[0].key: must not be empty"),
    ("{name: a, qps: 1, key: 'x}'}", "unbalanced brace"),
    ("{name: a, qps: 1, onExceed: drop}", "onExceed: must be one of reject, wait"),
    ("{name: a, qps: 1, maxWait: soon}", 'maxWait: invalid duration "soon"'),
    ("{name: a, qps: 1, mode: audit}", "mode: must be one of enforce, dryrun"),
    ("{name: a, qps: 1, failure: maybe}", "failure: must be one of open, closed"),
    ("{name: a, qps: 1, maxQps: 5}", 'maxQps: only applies with "instanceAnnotation"'),
    ("{name: a, qps: 1, instanceAnnotation: x/qps}", 'needs "{instance}" in the key'),
    ("{name: a, qps: 1, key: '{instance}', instanceAnnotation: q, maxQps: 0}",
     "maxQps: must be greater than 0"),
    ("{name: a, qps: 1, rate: 3}", 'unknown field "rate" in spec.rateLimits[0]'),
    ("{name: 'a b', qps: 1}", "must be letters, digits"),
    ("{name: a, qps: 1, match: {verb: [get]}}", 'unknown field "verb" in spec.rateLimits[0].match'),
    ("{name: a, qps: 1, match: {groups: [''], apiGroups: [apps]}}", "not both"),
    ("{name: a, qps: 1, match: {users: ['']}}", "an empty entry matches nothing"),
    ("{name: a, qps: 1, match: {resources: ['pods[']}}", "not a valid glob"),
    ("{name: a, qps: 1, match: {verbs: get}}", "verbs: expected a list of strings"),
    # selectors that can never match used to be accepted: the limit silently applied to nothing
    ("{name: a, qps: 1, match: {verbs: [Create]}}",
     '"Create" never matches: verbs are lower-case'),
    ("{name: a, qps: 1, match: {verbs: [updte]}}",
     '"updte" never matches: a call\'s verb is one of get, list, watch, create, update'),
    ("{name: a, qps: 1, match: {verbs: [use]}}", '"use" never matches'),
    ("{name: a, qps: 1, match: {resources: [ConfigMaps]}}",
     '"ConfigMaps" never matches: resources are lower-case (the plural of the URL'),
    ("{name: a, qps: 1, match: {apiGroups: [apps/v1]}}",
     '"apps/v1" never matches: an API group has no version ("apps", not "apps/v1")'),
    ("{name: a, qps: 1, match: {groups: [Apps]}}", '"Apps" never matches: groups are lower'),
    ("{name: a, qps: 1, match: {namespaces: [Team-A]}}", '"Team-A" never matches'),
    ("{name: a, qps: 1, match: {apiGroups: ['apps[']}}", "not a valid glob"),
    # an explicit empty list matched every call (RBAC reads it as none)
    ("{name: a, qps: 1, match: {verbs: []}}",
     'verbs: is empty, which matches nothing (leave "verbs" out to match anything)'),
    ("{name: a, qps: 1, match: {resources: []}}", "resources: is empty"),
    # a user group written where the API group goes (groups is apiGroups' alias) matched no
    # call without a word: an identity deny rule so written denied nothing
    ("{name: a, qps: 1, match: {groups: ['system:masters']}}",
     '"system:masters" never matches: an API group is a DNS name'),
    ("{name: a, qps: 1, match: {namespaces: [team_a]}}",
     '"team_a" never matches: a namespace is a DNS label'),
    # a required name left empty was taken: 429s said rate limit "" of the policy
    ("{name: '', qps: 1}", "spec.rateLimits[0].name: must not be empty"),
])
def test_invalid_rules_are_reported_with_position(body: str, message: str) -> None:
    rules, errors = parse(f"- {body}\n")
    assert rules == ()
    assert any(message in e for e in errors), errors
    assert all(e.startswith("rl.yaml:1: ") for e in errors), errors


def test_a_bad_entry_is_reported_at_its_own_line() -> None:
    # it was reported at the line of "verbs:", not at the entry that is wrong
    _, errors = parse("- name: a\n  qps: 1\n  match:\n    verbs:\n      - get\n      - Update\n"
                      "    resources:\n      - pods\n      - 'pods['\n")
    assert errors == [
        'rl.yaml:6: spec.rateLimits[0].match.verbs: "Update" never matches: verbs are lower-case',
        'rl.yaml:9: spec.rateLimits[0].match.resources: "pods[" is not a valid glob '
        '(unclosed "[")']


def test_what_can_match_is_accepted() -> None:
    rule = one("- {name: a, qps: 1, match: {verbs: [deletecollection, 'l*', post], "
               "apiGroups: ['', apps, '*.k8s.io'], users: [Alice], namespaces: ['']}}\n")
    assert rule.match.users.matches("Alice")


def test_duplicate_names_and_non_list() -> None:
    _, errors = parse("- {name: a, qps: 1}\n- {name: a, qps: 2}\n")
    assert errors == ['rl.yaml:2: spec.rateLimits[1]: duplicate rule name "a" (also at rl.yaml:1)']
    _, errors = parse("{name: a, qps: 1}\n")
    assert errors == ["rl.yaml:1: spec.rateLimits: expected a list, got a mapping"]


def test_section_through_the_policy_loader() -> None:
    doc = b"""apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: op}
spec:
  rateLimits:
    - {name: r, qps: 1, burst: 0}
"""
    with pytest.raises(PolicyLoadError) as info:
        build_policy_set([("p.yaml", doc)], parsers={"rateLimits": parse_section})
    assert [str(e) for e in info.value.errors] == [
        "p.yaml:6: spec.rateLimits[0].burst: must be at least 1 (got 0)"]
    good = build_policy_set([("p.yaml", doc.replace(b"burst: 0", b"burst: 2"))],
                            parsers={"rateLimits": parse_section})
    (policy, rules), = good.section("rateLimits")
    assert policy.name == "op" and rules[0].burst == 2


MATCH = """
- name: m
  qps: 1
  match: {verbs: [get, "l*"], groups: ["", "apps"], resources: [pods, "pods/log", "*/scale",
          "config*"], namespaces: ["team-*", ""], users: [alice, "system:serviceaccount:*"]}
"""


@pytest.mark.parametrize("method, path, query, user, expected", [
    ("GET", "/api/v1/namespaces/team-a/pods/p", "", "alice", True),
    ("GET", "/api/v1/namespaces/team-a/pods", "", "alice", True),  # list: l*
    ("GET", "/api/v1/namespaces/team-a/pods", "watch=1", "alice", False),  # watch
    ("GET", "/api/v1/namespaces/other/pods/p", "", "alice", False),
    ("GET", "/api/v1/pods", "", "alice", True),  # cluster-scoped list: namespace ""
    ("GET", "/api/v1/namespaces/team-a/pods/p", "", "bob", False),
    ("GET", "/api/v1/namespaces/team-a/pods/p", "", "system:serviceaccount:ops:op", True),
    ("GET", "/api/v1/namespaces/team-a/pods/p/log", "", "alice", True),
    ("GET", "/api/v1/namespaces/team-a/pods/p/status", "", "alice", False),  # RBAC: pods only
    ("GET", "/apis/apps/v1/namespaces/team-a/deployments/d/scale", "", "alice", True),
    ("GET", "/apis/apps/v1/namespaces/team-a/deployments/d", "", "alice", False),
    ("GET", "/api/v1/namespaces/team-a/configmaps/c", "", "alice", True),  # glob
    # a glob's "*" stays within the resource, as a shell's within a path segment: "config*"
    # matched configmaps/status (so "pod*" pods/exec), where "configmaps" itself does not
    ("GET", "/api/v1/namespaces/team-a/configmaps/c/status", "", "alice", False),
    ("GET", "/apis/batch/v1/namespaces/team-a/jobs/j", "", "alice", False),  # group
    ("PUT", "/api/v1/namespaces/team-a/pods/p", "", "alice", False),  # verb
    ("GET", "/healthz", "", "alice", False),  # non-resource: rule restricts resources
])
def test_matching_table(method: str, path: str, query: str, user: str, expected: bool) -> None:
    rule = one(MATCH)
    info = parse_request_info(method, path, query)
    assert rule.match.matches(info, info.policy_verb, user) is expected


def test_non_resource_requests_match_only_unrestricted_rules() -> None:
    info = parse_request_info("GET", "/apis", "")
    assert one("- {name: a, qps: 1, match: {verbs: [get]}}").match.matches(info, "get", "u")
    assert not one("- {name: a, qps: 1, match: {resources: ['*'], namespaces: [x]}}").match.matches(
        info, "get", "u")


DISCOVERY = ["/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1", "/version", "/version/",
             "/openapi", "/openapi/v2", "/openapi/v3", "/openapi/v3/apis/apps/v1"]
OTHER_PATHS = ["/metrics", "/logs", "/logs/", "/logs/kube-apiserver.log", "/healthz", "/livez",
               "/readyz", "/debug/pprof/", "/debug/pprof/profile", "/version/x", "/apis-x",
               "/openapiv2", "/", "/.well-known/openid-configuration"]


@pytest.mark.parametrize("fields", [
    "resources: ['*']", "apiGroups: ['*']", "groups: ['*']", "namespaces: ['*']",
    "resources: ['*'], apiGroups: ['*'], namespaces: ['*']", "resources: ['*', pods]"])
@pytest.mark.parametrize("path", DISCOVERY + OTHER_PATHS)
def test_a_rule_about_every_resource_matches_discovery_and_no_other_path(
        fields: str, path: str) -> None:
    # the middle reading, RBAC's defaults (system:discovery): a rule about every resource also
    # lets a client discover them (/api, /apis, /version, /openapi), as DESIGN's own
    # {verbs: [get, list, watch], resources: ["*"]} needs for client-go; it matched every path
    # before 8731376 (/metrics, /logs, /debug: none is about a resource), none after it
    match = one("- {name: a, qps: 1, match: {verbs: [get], " + fields + "}}").match
    assert match.matches(parse_request_info("GET", path, ""), "get", "u") is (path in DISCOVERY)
    assert match.matches(parse_request_info("GET", "/api/v1/namespaces/a/pods/p", ""), "get", "u")
    assert not match.matches(parse_request_info("POST", "/api", ""), "post", "u")  # verbs still
    # leaving them out is how a rule covers every non-resource path
    assert one("- {name: a, qps: 1, match: {verbs: [get]}}").match.matches(
        parse_request_info("GET", path, ""), "get", "u")


@pytest.mark.parametrize("fields", [
    "resources: [pods]", "resources: ['*/*']", "resources: ['*/scale']", "apiGroups: ['']",
    "apiGroups: [apps]", "namespaces: [a]", "resources: ['*'], namespaces: [a]",
    "resources: ['*'], apiGroups: [apps]", "resources: ['p*']"])
@pytest.mark.parametrize("path", DISCOVERY + OTHER_PATHS)
def test_a_rule_naming_some_resources_matches_no_path(fields: str, path: str) -> None:
    match = one("- {name: a, qps: 1, match: {verbs: [get], " + fields + "}}").match
    assert not match.matches(parse_request_info("GET", path, ""), "get", "u")


@pytest.mark.parametrize("resources, verbs, path, named", [
    (["pods/exec"], [], "/api/v1/namespaces/a/pods/p/exec", True),
    (["*/exec"], [], "/api/v1/namespaces/a/pods/p/exec", True),
    (["pods/*"], [], "/api/v1/namespaces/a/pods/p/exec", False),
    (["*"], ["*"], "/api/v1/namespaces/a/pods/p/exec", False),
    (["pods/log"], [], "/api/v1/namespaces/a/pods/p/log", True),
    (["pods/exec"], [], "/api/v1/namespaces/a/pods/p/log", False),
    ([], ["proxy"], "/api/v1/proxy/namespaces/a/pods/p", True),
])
def test_long_running_calls_are_named_only_literally(
    resources: list[str], verbs: list[str], path: str, named: bool
) -> None:
    given = ", ".join(f"{k}: {v}" for k, v in (("resources", resources), ("verbs", verbs)) if v)
    rule = one(f"- {{name: a, qps: 1, match: {{{given}}}}}")
    assert rule.match.names(parse_request_info("POST", path, "")) is named
