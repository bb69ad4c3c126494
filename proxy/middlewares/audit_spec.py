"""``spec.audit``: YAML → an immutable audit policy, modelled on the apiserver's ``audit.k8s.io/v1``
Policy, and the plan that decides each call's level once per policy set.

::

    audit:
      level: Metadata              # opgate's addition: calls no rule matches (see below)
      omitStages: [ResponseStarted]
      omitManagedFields: true
      rules:                       # first match wins, exactly as the apiserver's checker
        - level: None
          users: ["system:kube-proxy"]
          verbs: [watch]
        - level: Request
          resources: [{group: "", resources: [configmaps]}]
          namespaces: [team-a]
        - level: Metadata
          nonResourceURLs: ["/healthz*", "/version"]

Matching is the apiserver's (``k8s.io/apiserver/pkg/audit/policy/checker.go``): ``users`` are
exact user names, ``userGroups`` exact groups (a rule with either never matches a caller opgate
did not verify), ``verbs`` the audit verbs (get, list, watch, create, update, patch, delete,
deletecollection, …; the lower-case HTTP method for non-resource URLs), ``resources`` a group
(``""`` core) with ``resources`` (``pods``, ``pods/log``, ``pods/*``, ``*/status``, ``*``) and
optional ``resourceNames``, ``namespaces`` exact names (``""`` matches cluster-scoped calls),
``nonResourceURLs`` exact paths, ``*``, or a prefix ending in ``*``. A rule with ``namespaces`` or
``resources`` only matches resource requests, one with ``nonResourceURLs`` only the others.
Unlike opgate's other sections, there are no globs: a ``*`` verb or a namespace that is no
namespace name (``team-*``) would match no call, and is refused.

The default ``level`` (for calls no rule matches) is opgate's addition: when absent it is
``None`` if the section has rules (the apiserver's policy: no match, no event) and ``Metadata``
otherwise. Several policies with ``audit`` sections: their rules are tried in file order, the
first ``level`` given is the default, ``omitStages`` add up.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.context import Identity
from proxy.engine.nonresource import url_matches, url_problem
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import CallerField, Fields, Located, PolicyError, sequence

__all__ = ["LEVELS", "SECTION", "STAGES", "AuditPlan", "AuditRule", "AuditSpec", "Decision",
           "GroupResources", "at_least", "build_plan", "parse_section"]

SECTION = "audit"
LEVELS = ("None", "Metadata", "Request", "RequestResponse")
STAGES = ("RequestReceived", "ResponseStarted", "ResponseComplete", "Panic")
_RANK = {level: i for i, level in enumerate(LEVELS)}
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label
_GROUP = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MEMO_SIZE = 4096


def at_least(level: str, floor: str) -> bool:
    """Whether ``level`` is ``floor`` or more detailed (None < Metadata < Request < …)."""
    return _RANK[level] >= _RANK[floor]


@dataclass(frozen=True, slots=True)
class GroupResources:
    group: str = ""
    resources: tuple[str, ...] = ()
    resource_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AuditRule:
    """One entry of ``rules``; empty lists match anything, as in the apiserver's PolicyRule."""

    level: str
    users: frozenset[str] = frozenset()
    user_groups: frozenset[str] = frozenset()
    verbs: frozenset[str] = frozenset()
    resources: tuple[GroupResources, ...] = ()
    namespaces: frozenset[str] = frozenset()
    non_resource_urls: tuple[str, ...] = ()
    omit_stages: frozenset[str] = frozenset()
    omit_managed_fields: bool | None = None
    source: str = ""
    caller_fields: tuple[CallerField, ...] = field(default=(), compare=False)  # users, userGroups

    @property
    def about_users(self) -> bool:
        return bool(self.users or self.user_groups)

    def matches_user(self, identity: Identity | None) -> bool:
        if self.users and (identity is None or identity.user not in self.users):
            return False
        if self.user_groups and (
                identity is None or not any(g in self.user_groups for g in identity.groups)):
            return False
        return True

    def matches_call(self, info: RequestInfo) -> bool:
        """Everything but the user (checker.go ``ruleMatches`` after its user checks)."""
        if self.verbs and info.verb not in self.verbs:
            return False
        if self.namespaces or self.resources:
            return self._matches_resource(info)
        if self.non_resource_urls:
            if info.is_resource_request:
                return False
            return url_matches(info.path, self.non_resource_urls)
        return True

    def _matches_resource(self, info: RequestInfo) -> bool:
        if not info.is_resource_request:
            return False
        if self.namespaces and info.namespace not in self.namespaces:
            return False
        if not self.resources:
            return True
        resource, sub = info.resource, info.subresource
        combined = f"{resource}/{sub}" if sub else resource
        for gr in self.resources:
            if gr.group != info.api_group:
                continue
            if not gr.resources:
                return True
            if gr.resource_names and info.name not in gr.resource_names:
                continue
            for res in gr.resources:
                if res == combined or res == "*":
                    return True
                if sub and res.startswith("*/") and sub == res[2:]:
                    return True
                if res.endswith("/*") and resource == res[:-2]:
                    return True
        return False


@dataclass(frozen=True, slots=True)
class AuditSpec:
    """One policy's ``spec.audit``. ``level`` ``None`` = not given."""

    level: str | None = None
    rules: tuple[AuditRule, ...] = ()
    omit_stages: frozenset[str] = frozenset()
    omit_managed_fields: bool = False
    source: str = ""

    @property
    def caller_fields(self) -> tuple[CallerField, ...]:
        """Where its rules name the verified caller (they match only a caller opgate verified)."""
        return tuple(c for rule in self.rules for c in rule.caller_fields)


def _stages(f: Fields, key: str) -> frozenset[str]:
    stages = f.str_list(key)
    for stage in stages:
        if stage not in STAGES:
            f.fail(key, f'"{stage}" is not one of {", ".join(STAGES)}')
    return frozenset(s for s in stages if s in STAGES)


def _level(f: Fields, *, required: bool) -> str | None:
    return f.str("level", required=required, choices=LEVELS)


def _group_resources(node: Located, what: str, errors: list[PolicyError]) -> GroupResources | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    before = len(errors)
    group = f.str("group", default="") or ""
    if group and not _GROUP.fullmatch(group):
        f.fail("group", f'"{group}" is not a valid API group ("" is the core group)')
    resources = f.str_list("resources")
    for res in resources:
        parts = res.split("/")
        if not res or len(parts) > 2 or any(not p for p in parts):
            f.fail("resources", f'"{res}" is not a resource, "resource/subresource", '
                                '"resource/*", "*/subresource" or "*"')
    names = f.str_list("resourceNames")  # with "*", "pods/*" too: the named objects of them
    if names and not resources:
        f.fail("resourceNames", 'needs "resources"')
    f.finish()
    if len(errors) > before:
        return None
    return GroupResources(group=group, resources=resources, resource_names=names)


def parse_rule(node: Located, what: str, errors: list[PolicyError]) -> AuditRule | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    before = len(errors)
    level = _level(f, required=True)
    users = f.str_list("users")
    groups = f.str_list("userGroups")
    verbs = f.str_list("verbs")
    for verb in verbs:
        if verb != verb.lower() or not verb:
            f.fail("verbs", f'"{verb}": verbs are lower-case (get, list, watch, create, …)')
        elif "*" in verb:  # opgate's other sections' wildcard; a name no call has here
            f.fail("verbs", f'"{verb}": audit rules have no wildcard verb (leave "verbs" out '
                            "to match every verb)")
    resources: list[GroupResources] = []
    res_node = f.node("resources")
    if res_node is not None:
        for index, item in enumerate(sequence(res_node, what=f.path("resources"),
                                              errors=errors)):
            gr = _group_resources(item, f"{f.path('resources')}[{index}]", errors)
            if gr is not None:
                resources.append(gr)
    namespaces = f.str_list("namespaces")
    for ns in namespaces:  # a glob (opgate's other sections take them) would match nothing
        if ns and not _NAMESPACE.fullmatch(ns):
            f.fail("namespaces", f'"{ns}" is not a namespace name: audit rules name namespaces '
                                 'exactly ("" for cluster-scoped calls), without globs')
    urls = f.str_list("nonResourceURLs")
    for url in urls:
        problem = url_problem(url)
        if problem is not None:
            f.fail("nonResourceURLs", problem)
    if urls and (res_node is not None or namespaces):
        f.fail("nonResourceURLs", 'a rule applies either to resources ("resources", '
                                  '"namespaces") or to "nonResourceURLs", not both')
    omit = _stages(f, "omitStages")
    omit_mf_node = f.node("omitManagedFields")
    omit_mf = f.bool("omitManagedFields") if omit_mf_node is not None else None
    f.finish()
    if len(errors) > before or level is None:
        return None
    return AuditRule(level=level, users=frozenset(users), user_groups=frozenset(groups),
                     verbs=frozenset(verbs), resources=tuple(resources),
                     namespaces=frozenset(namespaces), non_resource_urls=urls,
                     omit_stages=omit, omit_managed_fields=omit_mf, source=node.where(),
                     caller_fields=tuple(f.caller_field(k) for k, given in
                                         (("users", users), ("userGroups", groups)) if given))


def parse_section(node: Located, errors: list[PolicyError]) -> AuditSpec:
    """The ``SectionParser`` for ``spec.audit`` (a mapping)."""
    what = f"spec.{SECTION}"
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return AuditSpec()
    level = _level(f, required=False)
    rules: list[AuditRule] = []
    rules_node = f.node("rules")
    if rules_node is not None:
        for index, item in enumerate(sequence(rules_node, what=f.path("rules"), errors=errors)):
            rule = parse_rule(item, f"{f.path('rules')}[{index}]", errors)
            if rule is not None:
                rules.append(rule)
    omit = _stages(f, "omitStages")
    omit_mf = f.bool("omitManagedFields")
    f.finish()
    return AuditSpec(level=level, rules=tuple(rules), omit_stages=omit,
                     omit_managed_fields=omit_mf, source=node.where())


# --- the plan of one policy set --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Decision:
    """What to record of one call: level, stages left out, managed fields left out, and which
    rule decided (``file:line``; ``""`` for the default level)."""

    level: str
    omit_stages: frozenset[str]
    omit_managed_fields: bool
    rule: str = ""


class AuditPlan:
    """Every ``spec.audit`` of a policy set, merged; decisions memoized per call shape and user."""

    __slots__ = ("_body", "_memo", "by_name", "default", "omit_managed_fields", "omit_stages",
                 "rules", "wants_bodies")

    def __init__(self, *, default: str = "Metadata", rules: tuple[AuditRule, ...] = (),
                 omit_stages: frozenset[str] = frozenset(),
                 omit_managed_fields: bool = False) -> None:
        self.default = default
        self.rules = rules
        self.omit_stages = omit_stages
        self.omit_managed_fields = omit_managed_fields
        levels = [r.level for r in rules] + [default]
        self.wants_bodies = any(at_least(lv, "Request") for lv in levels)
        self.by_name = any(gr.resource_names for r in rules for gr in r.resources)
        self._memo: dict[tuple[Any, ...], Decision] = {}
        self._body: dict[tuple[Any, ...], bool] = {}

    def _key(self, info: RequestInfo) -> tuple[Any, ...]:
        if not info.is_resource_request:
            return (info.shape, info.path)
        return (info.shape, info.name) if self.by_name else (info.shape,)

    def decide(self, info: RequestInfo, identity: Identity | None) -> Decision:
        key = (*self._key(info), identity)
        found = self._memo.get(key)
        if found is not None:
            return found
        found = Decision(self.default, self.omit_stages, self.omit_managed_fields)
        for rule in self.rules:
            if rule.matches_user(identity) and rule.matches_call(info):
                mf = rule.omit_managed_fields
                found = Decision(rule.level, self.omit_stages | rule.omit_stages,
                                 self.omit_managed_fields if mf is None else mf, rule.source)
                break
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = found
        return found

    def may_want_body(self, info: RequestInfo) -> bool:
        """Whether the call could end at Request level or more, whoever the caller turns out to
        be (bodies are read before identity is verified): a rule about users that could match
        and asks for bodies says yes; the first rule that surely matches decides."""
        if not self.wants_bodies or not info.is_resource_request:
            return False
        key = self._key(info)
        found = self._body.get(key)
        if found is not None:
            return found
        found = at_least(self.default, "Request")
        for rule in self.rules:
            if not rule.matches_call(info):
                continue
            if at_least(rule.level, "Request"):
                found = True
                break
            if not rule.about_users:
                found = False
                break
        if len(self._body) >= MEMO_SIZE:
            self._body.clear()
        self._body[key] = found
        return found


def build_plan(section: Sequence[tuple[Any, object]]) -> AuditPlan:
    """Merge every ``spec.audit`` of ``PolicySet.section(SECTION)`` (module docstring)."""
    specs = [spec for _, spec in section if isinstance(spec, AuditSpec)]
    rules = tuple(r for s in specs for r in s.rules)
    given = [s.level for s in specs if s.level is not None]
    default = given[0] if given else ("None" if rules else "Metadata")
    omit: frozenset[str] = frozenset().union(*(s.omit_stages for s in specs))
    return AuditPlan(default=default, rules=rules, omit_stages=omit,
                     omit_managed_fields=any(s.omit_managed_fields for s in specs))
