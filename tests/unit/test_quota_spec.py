"""spec.quotas → validated QuotaRule tuples (file:line errors), and how they bind to policies."""

from __future__ import annotations

import pytest

from proxy.app import section_parsers
from proxy.engine.check import check
from proxy.engine.policies import build_policy_set
from proxy.engine.schema import PolicyError
from proxy.engine.yamlload import parse_yaml_documents
from proxy.middlewares.quota_spec import (
    BoundQuota,
    QuotaRule,
    bind_quotas,
    count_key,
    legacy_key,
    parse_section,
    qualified,
)


def parse(text: str) -> tuple[tuple[QuotaRule, ...], list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file="q.yaml", errors=errors)
    rules = parse_section(docs[0], errors)
    return rules, [str(e) for e in errors]


def one(text: str) -> QuotaRule:
    rules, errors = parse(text)
    assert errors == []
    assert len(rules) == 1
    return rules[0]


def test_full_entry_and_defaults() -> None:
    rule = one("""
- name: team-configmaps
  resources: [configmaps, widgets]
  apiGroups: ["", demo.opgate.dev]
  namespaces: ["team-*", ops]
  max: 5
  alignWith: [ResourceQuota, ClusterResourceQuota]
  mode: dryrun
  failure: open
""")
    assert rule.name == "team-configmaps"
    assert rule.pairs == (("", "configmaps"), ("", "widgets"), ("demo.opgate.dev", "configmaps"),
                          ("demo.opgate.dev", "widgets"))
    assert rule.max == 5
    assert rule.align_with == {"ResourceQuota", "ClusterResourceQuota"}
    assert (rule.mode, rule.failure, rule.source) == ("dryrun", "open", "q.yaml:2")
    assert rule.namespaces.matches("team-a") and rule.namespaces.matches("ops")
    assert not rule.namespaces.matches("default")

    minimal = one("- {resources: [secrets], max: 0}")
    assert (minimal.api_groups, minimal.max, minimal.align_with, minimal.name) == (
        ("",), 0, frozenset(), "")
    assert (minimal.mode, minimal.failure) == (None, None)
    assert minimal.namespaces.matches("anything")

    aligned_only = one("- {resources: [configmaps], alignWith: [ResourceQuota]}")
    assert aligned_only.max is None


@pytest.mark.parametrize("body, message", [
    ("- {max: 3}", 'q.yaml:1: missing required field "resources" in spec.quotas[0]'),
    ("- {resources: [configmaps]}",
     'q.yaml:1: missing required field "max" in spec.quotas[0] (or "alignWith" to only mirror '
     "the cluster's quotas)"),
    ("- resources: [configmaps]\n  max: -1",
     "q.yaml:2: spec.quotas[0].max: must be at least 0 (got -1)"),
    ("- resources: [configmaps]\n  max: many",
     "q.yaml:2: spec.quotas[0].max: expected an integer, got a string"),
    ("- resources: []\n  max: 1", "q.yaml:1: spec.quotas[0].resources: must name at least one"),
    ("- resources: ['*']\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "*": globs are not supported here (each resource is '
     "watched, so name it)"),
    ("- resources: [pods/log]\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "pods/log": subresources have no object count'),
    # a group in the resource's name (as in ResourceQuota's count/deployments.apps) was taken
    # for a core resource of that name: valid, watched for ever, never matching a create
    ("- resources: [deployments.apps]\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "deployments.apps": name the resource without its '
     'group, and the group in apiGroups (resources: [deployments], apiGroups: [apps])'),
    ("- resources: [count/widgets.demo.opgate.dev]\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "count/widgets.demo.opgate.dev" is a quota\'s key: '
     'name the resource without its group, and the group in apiGroups (resources: [widgets], '
     'apiGroups: [demo.opgate.dev])'),
    ("- resources: [count/configmaps]\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "count/configmaps" is a quota\'s key: name the '
     'resource (resources: [configmaps])'),
    ("- resources: [ConfigMaps]\n  max: 1",
     'q.yaml:1: spec.quotas[0].resources: "ConfigMaps" is not a valid resource name'),
    ("- resources: [configmaps]\n  apiGroups: [\"apps*\"]\n  max: 1",
     'q.yaml:2: spec.quotas[0].apiGroups: "apps*": globs are not supported here (each API '
     "group is watched, so name it)"),
    # a group with a version was refused as if it named a subresource
    ("- resources: [deployments]\n  apiGroups: [apps/v1]\n  max: 1",
     'q.yaml:2: spec.quotas[0].apiGroups: "apps/v1": an API group has no version ("apps", '
     'not "apps/v1")'),
    ("- resources: [configmaps]\n  apiGroups: []\n  max: 1",
     'q.yaml:2: spec.quotas[0].apiGroups: must name at least one ("" is the core group)'),
    ("- resources: [configmaps]\n  namespaces: ['']\n  max: 1",
     'q.yaml:2: spec.quotas[0].namespaces: an empty entry matches nothing (use "*" for every '
     "namespace)"),
    # an empty list counted in every namespace; an upper-case name matched none
    ("- resources: [configmaps]\n  namespaces: []\n  max: 1",
     "q.yaml:2: spec.quotas[0].namespaces: is empty, which matches nothing (leave it out for "
     "every namespace)"),
    ("- resources: [configmaps]\n  namespaces: [Team-A]\n  max: 1",
     'q.yaml:2: spec.quotas[0].namespaces: "Team-A" never matches: namespaces are lower-case'),
    ("- resources: [configmaps]\n  namespaces: [team_a]\n  max: 1",  # counted nowhere
     'q.yaml:2: spec.quotas[0].namespaces: "team_a" never matches: a namespace is a DNS label '
     "(lower-case letters, digits and '-')"),
    ("- resources: [configmaps]\n  max: 1\n  alignWith: [LimitRange]",
     'q.yaml:3: spec.quotas[0].alignWith: "LimitRange" is not one of ResourceQuota, '
     "ClusterResourceQuota"),
    ("- resources: [configmaps]\n  max: 1\n  mode: maybe",
     'q.yaml:3: spec.quotas[0].mode: must be one of enforce, dryrun (got "maybe")'),
    ("- resources: [configmaps]\n  max: 1\n  name: Bad_Name",
     'q.yaml:3: spec.quotas[0].name: "Bad_Name" is not a valid name (lower-case letters, '
     'digits, "-" and ".")'),
    ("- resources: [configmaps]\n  max: 1\n  limit: 2",
     'q.yaml:3: unknown field "limit" in spec.quotas[0]'),
    ("resources: [configmaps]", "q.yaml:1: spec.quotas: expected a list, got a mapping"),
    ("- 7", "q.yaml:1: spec.quotas[0]: expected a mapping, got an integer"),
])
def test_errors_say_where(body: str, message: str) -> None:
    rules, errors = parse(body)
    assert message in errors, errors
    assert rules == ()


def test_every_error_of_an_entry_is_reported() -> None:
    _, errors = parse("- resources: ['*']\n  max: -2\n  alignWith: [Nope]\n")
    assert len(errors) == 3, errors


def test_count_names() -> None:
    assert count_key("", "configmaps") == "count/configmaps"
    assert count_key("demo.opgate.dev", "widgets") == "count/widgets.demo.opgate.dev"
    assert legacy_key("", "secrets") == "secrets"
    assert legacy_key("", "widgets") is None
    assert legacy_key("apps", "deployments") is None
    assert qualified("apps", "deployments") == "deployments.apps"


POLICY = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {{name: {name}}}
spec:
  mode: {mode}
  failure: {failure}
  quotas:
{quotas}
"""


def test_bind_takes_name_mode_and_failure_from_the_policy() -> None:
    text = POLICY.format(name="team-quota", mode="dryrun", failure="open", quotas=(
        "    - {resources: [configmaps, secrets], max: 3}\n"
        "    - {name: own, resources: [configmaps], max: 9, mode: enforce, failure: closed}"))
    pset = build_policy_set([("p.yaml", text.encode())], parsers=section_parsers())
    plan = bind_quotas(pset.section("quotas"))
    assert sorted(plan) == [("", "configmaps"), ("", "secrets")]
    first, second = plan[("", "configmaps")]
    assert isinstance(first, BoundQuota)
    assert (first.quota_name, first.policy, first.dryrun, first.fail_open) == (
        "team-quota", "team-quota", True, True)
    assert first.where == "p.yaml:8"
    # an entry's own mode trials it in an enforce policy; a dryrun policy never denies
    assert (second.quota_name, second.dryrun, second.fail_open) == ("own", True, False)


def test_opgate_check_accepts_and_rejects(tmp_path: object) -> None:
    from pathlib import Path

    base = Path(str(tmp_path))
    good = base / "good.yaml"
    good.write_text(POLICY.format(name="p", mode="enforce", failure="closed",
                                  quotas="    - {resources: [configmaps], max: 3}"))
    assert check([str(good)], parsers=section_parsers()) == []
    bad = base / "bad.yaml"
    bad.write_text(POLICY.format(name="p", mode="enforce", failure="closed",
                                 quotas="    - {resources: [configmaps], max: -3}"))
    assert check([str(bad)], parsers=section_parsers()) == [
        f"{bad}:8: spec.quotas[0].max: must be at least 0 (got -3)"]


def test_the_example_policy_is_valid() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "policies" / "examples" / "quotas.yaml"
    assert check([str(example)], parsers=section_parsers()) == []
