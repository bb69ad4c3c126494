"""``spec.capture``: which calls traffic capture (``--capture FILE``) writes down, and how much
of their bodies. A list of rules; the first whose ``match`` fits a call decides::

    capture:
      - name: no-leases              # optional; shown in each flow's metadata
        match: {resources: [leases], apiGroups: [coordination.k8s.io]}
        sample: 0                    # never: an exclusion
      - match: {verbs: [create, update, patch, delete]}
        maxBodyBytes: 262144         # per body and direction (default 65536; 0: no bodies)
      - match: {resources: [secrets]}
        secretBodies: true           # the bodies of Secrets too (default: left out)
      - match: {verbs: [get, list, watch]}
        sample: 0.1                  # one call in ten

``match`` is the block every rule shares (:mod:`proxy.engine.match`: ``verbs``,
``groups``/``apiGroups``, ``resources`` with ``res/sub``, ``namespaces``, ``users``; globs).
Several policies with ``capture``: their rules are tried in file order. A call no rule matches
is not captured; with no ``capture`` section at all every call is (with the defaults), as
``--capture`` asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.match import Match, parse_match
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import Fields, Located, PolicyError, sequence

__all__ = ["DEFAULT_MAX_BODY", "SECTION", "CapturePlan", "CaptureRule", "build_plan",
           "parse_section"]

SECTION = "capture"
DEFAULT_MAX_BODY = 64 * 1024
MAX_BODY_LIMIT = 64 * 1024 * 1024  # per body: a rule may not ask for more
MEMO_SIZE = 4096


@dataclass(frozen=True, slots=True)
class CaptureRule:
    name: str
    match: Match = field(default_factory=Match)
    sample: float = 1.0
    max_body_bytes: int = DEFAULT_MAX_BODY
    secret_bodies: bool = False
    source: str = ""  # file:line of the rule ("" for the default)
    policy: str = ""


DEFAULT_RULE = CaptureRule(name="default")  # no spec.capture anywhere: every call


def _parse_rule(node: Located, what: str, index: int,
                errors: list[PolicyError]) -> CaptureRule | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    before = len(errors)
    name = f.str("name", default=f"capture-{index}") or f"capture-{index}"
    match = parse_match(f.node("match"), f"{what}.match", errors)
    sample = f.number("sample", default=1.0, minimum=0.0, maximum=1.0)
    limit = f.int("maxBodyBytes", default=DEFAULT_MAX_BODY, minimum=0, maximum=MAX_BODY_LIMIT)
    secrets = f.bool("secretBodies", default=False)
    f.finish()
    if len(errors) > before:
        return None
    return CaptureRule(name=name, match=match, sample=1.0 if sample is None else sample,
                       max_body_bytes=DEFAULT_MAX_BODY if limit is None else limit,
                       secret_bodies=secrets, source=node.where())


def parse_section(node: Located, errors: list[PolicyError]) -> tuple[CaptureRule, ...]:
    """The ``SectionParser`` for ``spec.capture`` (a list of rules)."""
    items = sequence(node, what=f"spec.{SECTION}", errors=errors)
    rules = [_parse_rule(item, f"spec.{SECTION}[{i}]", i, errors) for i, item in enumerate(items)]
    seen: dict[str, str] = {}
    for index, rule in enumerate(rules):
        if rule is None:
            continue
        if rule.name in seen:  # at the second one, not at the list
            errors.append(items[index].error(f'spec.{SECTION}[{index}]: two rules are named '
                                             f'"{rule.name}" (also at {seen[rule.name]})'))
        else:
            seen[rule.name] = rule.source
    return tuple(r for r in rules if r is not None)


class CapturePlan:
    """Every ``spec.capture`` rule of a policy set, in order; the rule for a call (or ``None``:
    not captured) memoized per call shape and user."""

    __slots__ = ("_memo", "rules")

    def __init__(self, rules: tuple[CaptureRule, ...] | None) -> None:
        self.rules = rules  # None: no section anywhere, every call gets DEFAULT_RULE
        self._memo: dict[tuple[Any, str], CaptureRule | None] = {}

    def rule_for(self, info: RequestInfo, user: str) -> CaptureRule | None:
        if self.rules is None:
            return DEFAULT_RULE
        key = (info.shape, user)
        try:
            return self._memo[key]
        except KeyError:
            pass
        verb = info.policy_verb
        found = next((r for r in self.rules if r.match.matches(info, verb, user)), None)
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = found
        return found


def build_plan(section: Sequence[tuple[Any, object]]) -> CapturePlan:
    """The plan of ``PolicySet.section(SECTION)``: ``(policy, rules)`` pairs in file order."""
    if not section:
        return CapturePlan(None)
    rules: list[CaptureRule] = []
    for policy, spec in section:
        name = getattr(policy, "name", "")
        for rule in spec if isinstance(spec, tuple) else ():
            rules.append(CaptureRule(name=rule.name, match=rule.match, sample=rule.sample,
                                     max_body_bytes=rule.max_body_bytes,
                                     secret_bodies=rule.secret_bodies, source=rule.source,
                                     policy=name))
    return CapturePlan(tuple(rules))
