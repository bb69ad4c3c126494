"""``spec.quotas``: YAML → immutable, validated object-count quotas, bound once per policy set.

One entry limits how many objects of some resources may exist in each namespace it matches::

    quotas:
      - name: configmaps-per-namespace   # optional; the quota's name in denials (default: the
        resources: [configmaps, secrets] #   policy's metadata.name)
        apiGroups: [""]                  # default [""] (the core group); literal names
        namespaces: ["team-*"]           # default ["*"]; shell-style globs
        max: 100                         # per namespace and per resource
        alignWith: [ResourceQuota, ClusterResourceQuota]   # also their count/<resource> limits
        mode: dryrun                     # optional: the policy's mode / failure otherwise
        failure: open

Each (apiGroup, resource) pair is counted by a list+watch of the whole cluster, so resources and
groups are literal names (no globs): ``*`` would mean watching every resource; and a resource
is named without its group (``deployments`` with ``apiGroups: [apps]``, not ResourceQuota's
``count/deployments.apps``). Only namespaced
resources can be quota'd (as with ResourceQuota). ``max`` may be left out when ``alignWith``
names something: the entry then only mirrors the cluster's own quotas (opgate denies before the
apiserver would, with the same words). The count's name is the apiserver's
``count/<resource>[.<group>]``; for core resources ResourceQuota's legacy names (``configmaps``,
``secrets``, ``pods``, ``services``, ``replicationcontrollers``, ``resourcequotas``,
``persistentvolumeclaims``) are read from aligned quotas too. ``count/pods`` counts every pod
the apiserver stores; the legacy ``pods`` (:func:`live_key`) only those not Succeeded or Failed,
as the apiserver's pod evaluator counts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.match import NAMESPACE_NAME, Patterns, never_a_namespace
from proxy.engine.schema import Fields, Located, PolicyError, sequence

__all__ = ["ALIGN_KINDS", "CLUSTER_RESOURCE_QUOTA", "LEGACY_COUNTS", "QUOTA_IGNORED",
           "RESOURCE_QUOTA", "SECTION",
           "BoundQuota", "QuotaRule", "bind_quotas", "count_key", "legacy_key", "live_key",
           "parse_section", "qualified"]

SECTION = "quotas"
RESOURCE_QUOTA = "ResourceQuota"
CLUSTER_RESOURCE_QUOTA = "ClusterResourceQuota"
ALIGN_KINDS = (RESOURCE_QUOTA, CLUSTER_RESOURCE_QUOTA)
# core resources whose ResourceQuota also accepts the bare name (quota/v1/evaluator/core)
LEGACY_COUNTS = frozenset({"pods", "services", "replicationcontrollers", "resourcequotas",
                           "secrets", "configmaps", "persistentvolumeclaims"})
# what the apiserver's quota never counts (quota/v1/install DefaultIgnoredResources, which
# OpenShift's ClusterResourceQuota admission uses too): an aligned limit on them limits nothing
QUOTA_IGNORED = frozenset({("", "events"), ("events.k8s.io", "events")})
_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_GROUP = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_GLOB_CHARS = frozenset("*?[")


def qualified(group: str, resource: str) -> str:
    """The apiserver's GroupResource string: ``configmaps``, ``widgets.demo.opgate.dev``."""
    return f"{resource}.{group}" if group else resource


def count_key(group: str, resource: str) -> str:
    """ResourceQuota's object-count name: ``count/configmaps``, ``count/widgets.demo.dev``."""
    return "count/" + qualified(group, resource)


def legacy_key(group: str, resource: str) -> str | None:
    """The bare name a ResourceQuota may use for the same count (core resources only)."""
    return resource if not group and resource in LEGACY_COUNTS else None


def live_key(group: str, resource: str) -> str | None:
    """The legacy name that counts only the objects not at their end of life: ``pods``, which
    leaves out pods in a terminal phase (``count/pods`` counts every pod in storage)."""
    return "pods" if not group and resource == "pods" else None


@dataclass(frozen=True, slots=True)
class QuotaRule:
    """One validated entry of ``spec.quotas``. ``mode``/``failure`` ``None`` = the policy's;
    ``name`` ``""`` = the policy's name; ``max`` ``None`` = only the aligned quotas limit."""

    resources: tuple[str, ...]
    api_groups: tuple[str, ...] = ("",)
    namespaces: Patterns = field(default_factory=Patterns)
    max: int | None = None
    align_with: frozenset[str] = frozenset()
    name: str = ""
    mode: str | None = None
    failure: str | None = None
    source: str = ""

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """Every (apiGroup, resource) this entry counts."""
        return tuple((g, r) for g in self.api_groups for r in self.resources)


def _literals(f: Fields, key: str, pattern: re.Pattern[str], what: str, *,
              required: bool = False, default: tuple[str, ...] = (),
              allow_empty: bool = False) -> tuple[str, ...]:
    given = f.node(key)
    items = f.str_list(key, required=required, default=default)
    if given is not None and given.value == []:
        f.fail(key, "must name at least one" + (' ("" is the core group)' if allow_empty else ""))
    good: list[str] = []
    for item in items:
        if _GLOB_CHARS & set(item):
            f.fail(key, f'"{item}": globs are not supported here (each {what} is watched, so '
                        "name it)")
        elif key == "resources" and (item.startswith("count/") or "." in item):
            f.fail(key, _grouped_resource(item))
        elif "/" in item and key == "apiGroups":
            f.fail(key, f'"{item}": an API group has no version '
                        f'("{item.partition("/")[0]}", not "{item}")')
        elif "/" in item:
            f.fail(key, f'"{item}": subresources have no object count')
        elif not (item == "" and allow_empty) and not pattern.fullmatch(item):
            f.fail(key, f'"{item}" is not a valid {what} name')
        elif item not in good:
            good.append(item)
    return tuple(good)


def _grouped_resource(item: str) -> str:
    """What to write instead of ResourceQuota's spelling (``count/deployments.apps``,
    ``deployments.apps``): resource names have no dots (a CRD's plural is a DNS label), so
    such a name would be a core resource that no create ever is."""
    bare = item.removeprefix("count/")
    resource, _, group = bare.partition(".")
    said = f'"{item}" is a quota\'s key: ' if bare != item else f'"{item}": '
    if not group:
        return f"{said}name the resource (resources: [{resource}])"
    return (f"{said}name the resource without its group, and the group in apiGroups "
            f"(resources: [{resource}], apiGroups: [{group}])")


def parse_quota(node: Located, what: str, errors: list[PolicyError]) -> QuotaRule | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    before = len(errors)
    name = f.str("name", default="") or ""
    if name and (len(name) > 253 or not _NAME.fullmatch(name)):
        f.fail("name", f'"{name}" is not a valid name (lower-case letters, digits, "-" and ".")')
    resources = _literals(f, "resources", _RESOURCE, "resource", required=True)
    groups = _literals(f, "apiGroups", _GROUP, "API group", default=("",), allow_empty=True)
    namespaces = f.str_list("namespaces", default=("*",))
    given = f.node("namespaces")
    if given is not None and given.value == []:  # it counted in every namespace
        f.fail("namespaces", 'is empty, which matches nothing (leave it out for every namespace)')
    for item in namespaces:
        if not item:
            f.fail("namespaces", 'an empty entry matches nothing (use "*" for every namespace)')
        elif "[" in item and "]" not in item:
            f.fail("namespaces", f'"{item}" is not a valid glob (unclosed "[")')
        elif item != item.lower():
            f.fail("namespaces", f'"{item}" never matches: namespaces are lower-case')
        elif never_a_namespace(item):
            f.fail("namespaces", f'"{item}" never matches: {NAMESPACE_NAME}')
    maximum = f.int("max", minimum=0)
    align = f.str_list("alignWith")
    for kind in align:
        if kind not in ALIGN_KINDS:
            f.fail("alignWith", f'"{kind}" is not one of {", ".join(ALIGN_KINDS)}')
    mode = f.str("mode", choices=("enforce", "dryrun"))
    failure = f.str("failure", choices=("open", "closed"))
    f.finish()
    if maximum is None and not align and f.node("max") is None and len(errors) == before:
        errors.append(node.error(f'missing required field "max" in {what} (or "alignWith" to '
                                 "only mirror the cluster's quotas)"))
    if len(errors) > before:
        return None
    return QuotaRule(resources=resources, api_groups=groups,
                     namespaces=Patterns.of(namespaces), max=maximum,
                     align_with=frozenset(align), name=name, mode=mode, failure=failure,
                     source=node.where())


def parse_section(node: Located, errors: list[PolicyError]) -> tuple[QuotaRule, ...]:
    """The ``SectionParser`` for ``spec.quotas`` (a list of entries)."""
    rules: list[QuotaRule] = []
    for index, item in enumerate(sequence(node, what=f"spec.{SECTION}", errors=errors)):
        rule = parse_quota(item, f"spec.{SECTION}[{index}]", errors)
        if rule is not None:
            rules.append(rule)
    return tuple(rules)


# --- entries bound to their policies, once per PolicySet ---------------------------------------

@dataclass(frozen=True, slots=True)
class BoundQuota:
    """An entry bound to its policy: the quota name denials carry, mode and failure."""

    rule: QuotaRule
    policy: str
    quota_name: str
    where: str
    dryrun: bool
    fail_open: bool

    def applies(self, namespace: str) -> bool:
        return self.rule.namespaces.matches(namespace)


def bind_quotas(section: Sequence[tuple[Any, object]]) -> dict[tuple[str, str], list[BoundQuota]]:
    """Every entry of ``PolicySet.section(SECTION)`` by the (group, resource) pairs it counts."""
    by_pair: dict[tuple[str, str], list[BoundQuota]] = {}
    for policy, rules in section:
        for rule in rules:  # type: ignore[attr-defined]
            bound = BoundQuota(
                rule=rule, policy=policy.name, quota_name=rule.name or policy.name,
                where=rule.source or policy.source,
                dryrun="dryrun" in (rule.mode, policy.mode),  # a dryrun policy never denies
                fail_open=(rule.failure or policy.failure) == "open")
            for pair in rule.pairs:
                by_pair.setdefault(pair, []).append(bound)
    return by_pair
