"""``spec.identity`` parsing: file:line errors, defaults, the issuers, allow list and rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engine.check import check
from proxy.engine.context import Identity
from proxy.engine.policies import load_policy_set
from proxy.middlewares import identity_spec
from proxy.middlewares.identity_spec import (
    KUBERNETES,
    TOKENREVIEW,
    IdentitySpec,
    Issuer,
)

PARSERS = {identity_spec.SECTION: identity_spec.parse_section}
HEAD = "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: ident}\nspec:\n"
GOOD = """\
  identity:
    issuers:
      - kubernetes: {}
      - oidc: {issuer: "https://dex.example.com", audiences: [kubernetes],
               claims: {groups: groups, groupsPrefix: "dex:"}}
    allow:
      - serviceAccount: ops/sample-*
      - user: alice
      - group: "system:masters"
    rules:
      - {verbs: [get, list, watch], resources: ["*"]}
      - {name: no-secrets, effect: deny, resources: [secrets]}
      - {verbs: [create], apiGroups: [""], resources: [configmaps], namespaces: ["team-*"]}
    subjectAccessReview: true
"""


def spec_of(tmp_path: Path, body: str) -> IdentitySpec:
    path = tmp_path / "ident.yaml"
    path.write_text(HEAD + body)
    policy_set = load_policy_set([path], parsers=PARSERS)
    ((_, spec),) = policy_set.section(identity_spec.SECTION)
    assert isinstance(spec, IdentitySpec)
    return spec


def errors_of(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "ident.yaml"
    path.write_text(HEAD + body)
    return check([str(path)], parsers=PARSERS)


def test_a_full_section_parses(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, GOOD)
    k8s, dex = spec.issuers
    assert (k8s.kind, k8s.key, k8s.audiences) == (KUBERNETES, KUBERNETES, ())
    assert (dex.key, dex.audiences, dex.groups_claim, dex.groups_prefix) == (
        "https://dex.example.com", ("kubernetes",), "groups", "dex:")
    assert [r.name for r in spec.rules] == ["rules[0]", "no-secrets", "rules[2]"]
    assert [r.allow for r in spec.rules] == [True, False, True]
    assert spec.rules[1].source.endswith("ident.yaml:16")
    assert spec.subject_access_review
    assert spec.accepts(KUBERNETES) and spec.accepts(TOKENREVIEW)
    assert not spec.accepts("https://other.example.com")


@pytest.mark.parametrize(("user", "groups", "allowed"), [
    ("system:serviceaccount:ops:sample-operator", (), True),
    ("system:serviceaccount:ops:sample-x", (), True),
    ("system:serviceaccount:ops:other", (), False),
    ("system:serviceaccount:dev:sample-operator", (), False),
    ("alice", (), True),
    ("alice2", (), False),
    ("bob", ("system:authenticated", "system:masters"), True),
])
def test_allow_list_with_globs(tmp_path: Path, user: str, groups: tuple[str, ...],
                               allowed: bool) -> None:
    spec = spec_of(tmp_path, GOOD)
    assert spec.allow.allows(Identity(user=user, groups=groups)) is allowed


def test_issuers_default_to_the_cluster(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "  identity:\n    allow: [{group: x}]\n    rules: [{verbs: ['*']}]\n")
    assert [i.kind for i in spec.issuers] == [KUBERNETES]


@pytest.mark.parametrize(("body", "expected"), [
    ("  identity:\n    rules: [{verbs: [get]}]\n",
     'ident.yaml:6: missing required field "allow" in spec.identity'),
    ("  identity:\n    allow: [{group: x}]\n",
     'ident.yaml:6: missing required field "rules" in spec.identity'),
    ("  identity:\n    allow: [{group: x}]\n    rules: []\n",
     "ident.yaml:7: spec.identity.rules: has no rule, so it denies everything"),
    ("  identity:\n    allow: []\n    rules: [{verbs: [get]}]\n",
     "ident.yaml:6: spec.identity.allow: names nobody"),
    ("  identity:\n    allow: [{serviceAccount: nonamespace}]\n    rules: [{verbs: [get]}]\n",
     'ident.yaml:6: spec.identity.allow[0].serviceAccount: "nonamespace" must be '
     "<namespace>/<name>"),
    ("  identity:\n    allow: [{user: a, group: b}]\n    rules: [{verbs: [get]}]\n",
     "spec.identity.allow[0].serviceAccount: an entry is exactly one of"),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{verbs: [get], effect: maybe}]\n",
     "spec.identity.rules[0].effect: must be one of allow, deny"),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{verbs: [get], colour: red}]\n",
     'ident.yaml:7: unknown field "colour" in spec.identity.rules[0]'),
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - {name: a}\n      - {name: b}\n"
     "      - {name: a}\n",  # at the duplicate, not at the list
     'ident.yaml:10: spec.identity.rules[2]: two rules are named "a" (also at '),
    ("  identity:\n    issuers: [{oidc: {issuer: 'http://dex', audiences: [k]}}]\n"
     "    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     'spec.identity.issuers[0].oidc.issuer: must be an https:// URL (got "http://dex")'),
    ("  identity:\n    issuers: [{oidc: {issuer: 'https://dex'}}]\n"
     "    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     'missing required field "audiences" in spec.identity.issuers[0].oidc'),
    # as an oidc issuer's: an empty list was read as leaving "audiences" out (any the
    # apiserver accepts), the opposite of what it says
    ("  identity:\n    issuers:\n      - kubernetes: {audiences: []}\n"
     "    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     "ident.yaml:7: spec.identity.issuers[0].kubernetes.audiences: is empty, which accepts no "
     'token (leave "audiences" out for those the apiserver accepts)'),
    # an empty list refused every service-account token (and verified no other token
    # itself): what no one means by it
    ("  identity:\n    issuers: []\n    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     "ident.yaml:6: spec.identity.issuers: is empty, which refuses every service-account token "
     '(leave "issuers" out for the cluster\'s own: "- kubernetes: {}")'),
    ("  identity:\n    issuers: [{kubernetes: {}, oidc: {issuer: 'https://d', audiences: [a]}}]\n"
     "    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     'an issuer is exactly one of "kubernetes: {}" or "oidc: {...}"'),
    ("  identity:\n    issuers: [{kubernetes: {}}, {kubernetes: {}}]\n"
     "    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n",
     'spec.identity.issuers: "kubernetes" is listed twice'),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{verbs: [get]}]\n    sar: true\n",
     'unknown field "sar" in spec.identity'),
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - nonResourceURLs:\n"
     "          - /healthz\n          - healthz\n",  # at the entry's own line
     'ident.yaml:10: spec.identity.rules[0].nonResourceURLs: "healthz" must begin with "/"'),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{nonResourceURLs: ['/a*b']}]\n",
     'ident.yaml:7: spec.identity.rules[0].nonResourceURLs: "/a*b": "*" is only allowed at '
     "the end"),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{nonResourceURLs: []}]\n",
     "ident.yaml:7: spec.identity.rules[0].nonResourceURLs: is empty, which matches nothing"),
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - resources: [pods]\n"
     "        nonResourceURLs: ['/healthz']\n",
     'ident.yaml:9: spec.identity.rules[0].nonResourceURLs: a rule applies either to '
     'resources ("resources") or to "nonResourceURLs", not both'),
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - {nonResourceURLs: ['*'], "
     "namespaces: [a]}\n",
     'resources ("namespaces") or to "nonResourceURLs", not both'),
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - nonResourceURLs: ['/metrics']\n"
     "        verbs: [get, list]\n",
     'ident.yaml:9: spec.identity.rules[0].verbs: "list" never matches a non-resource URL'),
    ("  identity:\n    allow: [{group: x}]\n    rules: [{nonResourceURLs: '/healthz'}]\n",
     "spec.identity.rules[0].nonResourceURLs: expected a list of strings"),
    # a rule's groups are API groups (apiGroups' alias): this deny rule denied nobody
    ("  identity:\n    allow: [{group: x}]\n    rules:\n      - {effect: deny, verbs: [delete], "
     "groups: ['dex:interns']}\n      - {verbs: ['*']}\n",
     'ident.yaml:8: spec.identity.rules[0].groups: "dex:interns" never matches: an API group '
     "is a DNS name"),
])
def test_errors_say_where(tmp_path: Path, body: str, expected: str) -> None:
    errors = errors_of(tmp_path, body)
    assert any(expected in e for e in errors), errors


def _oidc_policy(name: str, claims: str, audiences: str = "[k]") -> str:
    return (f"apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {{name: {name}}}\nspec:\n"
            f"  identity:\n    issuers:\n      - kubernetes: {{}}\n"
            f"      - oidc: {{issuer: 'https://dex', audiences: {audiences}{claims}}}\n"
            "    allow: [{group: system:authenticated}]\n"
            "    rules: [{effect: deny, users: [alice]}, {verbs: ['*']}]\n")


def test_one_issuer_maps_claims_alike_in_every_policy(tmp_path: Path) -> None:
    # a token is verified once, with the first declaration's mapping: the second policy's was
    # ignored, so its deny rule for "alice" met "https://dex#alice" and never matched
    path = tmp_path / "ident.yaml"
    path.write_text(_oidc_policy("a", "") + "---\n"
                    + _oidc_policy("b", ", claims: {usernamePrefix: '-'}"))
    assert check([path], parsers=PARSERS) == [
        f'{path}:19: spec.identity.issuers: "https://dex" maps claims differently from its '
        f"declaration at {path}:8 (a token is one user for every policy: username, "
        "usernamePrefix, groups and groupsPrefix must agree)"]
    # alike (audiences are each policy's own), or another issuer: fine
    path.write_text(_oidc_policy("a", ", claims: {username: sub}") + "---\n"
                    + _oidc_policy("b", "", "[other]") + "---\n"
                    + _oidc_policy("c", ", claims: {usernamePrefix: '-'}").replace(
                        "https://dex", "https://dex2"))
    assert check([path], parsers=PARSERS) == []


@pytest.mark.parametrize(("oidc", "kind"), [("1", "an integer"), ("true", "a boolean"),
                                            ("1.5", "a number")])
def test_an_oidc_issuer_that_is_not_a_mapping(tmp_path: Path, oidc: str, kind: str) -> None:
    # `"audiences" in oidc.value` raised TypeError: the whole section "could not be validated"
    # (a traceback in the log) and the section's other errors were lost
    errors = errors_of(tmp_path, f"  identity:\n    issuers: [{{oidc: {oidc}}}]\n"
                                 "    allow: [{group: x}]\n    rules: [{verbs: [Get]}]\n")
    path = tmp_path / "ident.yaml"
    assert errors == [
        f"{path}:6: spec.identity.issuers[0].oidc: expected a mapping, got {kind}",
        f'{path}:8: spec.identity.rules[0].verbs: "Get" never matches: verbs are lower-case']


def test_non_resource_urls_parse(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "  identity:\n    allow: [{group: x}]\n    rules:\n"
                             "      - {verbs: [get, head], nonResourceURLs: [/healthz, /apis/*]}\n"
                             "      - {verbs: [get]}\n")
    paths, plain = spec.rules
    assert paths.non_resource_urls == ("/healthz", "/apis/*") and plain.non_resource_urls == ()


def test_kubernetes_audiences() -> None:
    default = Issuer(kind=KUBERNETES)
    assert default.audience_ok(("https://issuer",), "https://issuer")
    assert default.audience_ok(("x", "https://kubernetes.default.svc"), "https://issuer")
    assert not default.audience_ok(("vault",), "https://issuer")
    assert Issuer(kind=KUBERNETES, audiences=("vault",)).audience_ok(("vault",), "https://i")


def test_the_example_policy_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "policies" / "examples" / "identity.yaml"
    assert check([str(example)], parsers=PARSERS) == []
