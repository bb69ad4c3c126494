"""``spec.rateLimits``: YAML → immutable, validated rate-limit rules with precompiled matchers.

Parsed once per policy load (never per request), then bound to their policies once per
:class:`PolicySet` (:func:`bind_rules`: mode, failure, metric children), so that a call only
matches and decides. A rule matches on the apiserver's RequestInfo
(``policy_verb``, API group, ``resource[/subresource]`` with RBAC's rules, namespace) and on the
verified user; every list accepts ``*`` and shell-style globs (``team-*``). Resource entries
follow RBAC: ``pods`` is the resource without subresource, ``pods/log`` one subresource,
``pods/*`` every subresource, ``*/scale`` a subresource of anything and ``*`` everything.
The ``{instance}`` of a key and an instance's own qps (``instanceAnnotation``) are resolved per
call by :mod:`proxy.middlewares.instance`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine import telemetry
from proxy.engine.kinds import MAX_BURST, MAX_QPS, MIN_QPS
from proxy.engine.match import Match, Patterns, parse_match
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import Fields, Located, PolicyError, sequence

__all__ = ["PLACEHOLDERS", "RESULTS", "SECTION", "BoundRule", "KeyTemplate", "Match", "Patterns",
           "Plan", "RateLimitRule", "bind_rules", "parse_section"]

SECTION = "rateLimits"
PLACEHOLDERS = ("user", "verb", "group", "resource", "namespace", "name", "instance")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


_JOIN = "|"  # the text between two placeholders the template writes side by side


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """``"{user}/{instance}"`` split into literal text and placeholders, validated at load.

    A rendered key names one bucket, so two calls share it only when their values are the
    same: each value is written with the template's own text characters (and ``%``)
    percent-encoded, and placeholders side by side get ``|`` between them, so
    ``{namespace}-{name}`` keeps ``a-b``/``c`` and ``a``/``b-c`` apart (``a%2Db-c``,
    ``a-b%2Dc``), and ``{user}/{instance}`` a user name holding a ``/`` apart from another's
    instance."""

    text: str
    pieces: tuple[tuple[str, str], ...]  # (literal, placeholder or "")
    escape: dict[int, str] = field(default_factory=dict, compare=False)  # for str.translate

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(p for _, p in self.pieces if p)

    def render(self, values: dict[str, str]) -> str:
        escape = self.escape
        return "".join(lit + (values[p].translate(escape) if p else "") for lit, p in self.pieces)


@dataclass(frozen=True, slots=True)
class RateLimitRule:
    """One validated entry of ``spec.rateLimits``. ``mode``/``failure`` ``None`` = the policy's."""

    name: str
    match: Match
    key: KeyTemplate
    qps: float
    burst: int
    on_exceed: str = "reject"
    max_wait: float = 2.0
    max_queue: int = 100
    mode: str | None = None
    failure: str | None = None
    instance_annotation: str = ""
    max_qps: float = 0.0
    lease: bool = False
    source: str = ""


def parse_key(text: str, node: Located, what: str, errors: list[PolicyError]) -> KeyTemplate:
    pieces: list[tuple[str, str]] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(text):
        literal = text[pos:m.start()]
        if "{" in literal or "}" in literal:
            errors.append(node.error(f'{what}: unbalanced brace in key template "{text}"'))
        if m.group(1) not in PLACEHOLDERS:
            errors.append(node.error(
                f'{what}: unknown placeholder {{{m.group(1)}}} in key template "{text}" '
                f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})"))
        pieces.append((literal, m.group(1)))
        pos = m.end()
    tail = text[pos:]
    if "{" in tail or "}" in tail:
        errors.append(node.error(f'{what}: unbalanced brace in key template "{text}"'))
    if tail:
        pieces.append((tail, ""))
    for i in range(1, len(pieces)):  # (see KeyTemplate: a value must end where the next starts)
        if not pieces[i][0] and pieces[i][1] and pieces[i - 1][1]:
            pieces[i] = (_JOIN, pieces[i][1])
    special = {"%", *"".join(literal for literal, _ in pieces)}
    escape = {ord(c): "".join(f"%{b:02X}" for b in c.encode()) for c in special}
    return KeyTemplate(text, tuple(pieces), escape)


def parse_rule(node: Located, what: str, errors: list[PolicyError]) -> RateLimitRule | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    before = len(errors)
    name = f.str("name", required=True) or ""
    if name and not _NAME.fullmatch(name):
        f.fail("name", f'"{name}" must be letters, digits, "-", "_" or "." (it is part of keys)')
    match = parse_match(f.node("match"), f"{what}.match", errors)
    key_text = f.str("key", default="{user}")
    if key_text == "":  # it silently became the default, one bucket per user
        f.fail("key", 'must not be empty (a literal such as "all" makes one shared bucket)')
    key_text = key_text or "{user}"
    key_node = f.node("key") or node
    key = parse_key(key_text, key_node, f.path("key"), errors)
    # bounds that keep a bucket's arithmetic (µs, doubles in gcra.lua) within what Redis takes
    qps = f.number("qps", required=True, minimum=0, maximum=MAX_QPS)
    if qps is not None and qps <= 0:
        f.fail("qps", f"must be greater than 0 (got {qps})")
    elif qps is not None and qps < MIN_QPS:
        f.fail("qps", f"must be at least {MIN_QPS:g} (one call in ~31 years; got {qps:g})")
    burst = f.int("burst", minimum=1, maximum=MAX_BURST)
    on_exceed = f.str("onExceed", default="reject", choices=("reject", "wait")) or "reject"
    max_wait = f.duration("maxWait", default=2.0)
    max_queue = f.int("maxQueue", default=100, minimum=1)
    mode = f.str("mode", choices=("enforce", "dryrun"))
    failure = f.str("failure", choices=("open", "closed"))
    annotation = f.str("instanceAnnotation", default="") or ""
    max_qps = f.number("maxQps", minimum=0, maximum=MAX_QPS)
    if max_qps is not None and max_qps <= 0:
        f.fail("maxQps", f"must be greater than 0 (got {max_qps})")
    elif max_qps is not None and max_qps < MIN_QPS:  # it bounds the rate a bucket gets
        f.fail("maxQps", f"must be at least {MIN_QPS:g} (one call in ~31 years; got {max_qps:g})")
    if max_qps is not None and not annotation:
        f.fail("maxQps", 'only applies with "instanceAnnotation"')
    if annotation and "instance" not in key.fields:
        f.fail("instanceAnnotation", 'needs "{instance}" in the key (one bucket per instance)')
    lease = f.bool("lease", default=False)
    f.finish()
    if len(errors) > before or qps is None or qps <= 0:
        return None
    return RateLimitRule(
        name=name, match=match, key=key, qps=qps,
        burst=burst if burst is not None else max(1, math.ceil(qps)),
        on_exceed=on_exceed, max_wait=max_wait if max_wait is not None else 2.0,
        max_queue=max_queue or 100, mode=mode, failure=failure,
        instance_annotation=annotation, max_qps=max_qps or qps, lease=lease,
        source=node.where(),
    )


def parse_section(node: Located, errors: list[PolicyError]) -> tuple[RateLimitRule, ...]:
    """The ``SectionParser`` for ``spec.rateLimits`` (a list of rules, names unique)."""
    rules: list[RateLimitRule] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(sequence(node, what=f"spec.{SECTION}", errors=errors)):
        rule = parse_rule(item, f"spec.{SECTION}[{index}]", errors)
        if rule is None:
            continue
        if rule.name in seen:
            errors.append(item.error(
                f'spec.{SECTION}[{index}]: duplicate rule name "{rule.name}" '
                f"(also at {seen[rule.name]})"))
            continue
        seen[rule.name] = rule.source
        rules.append(rule)
    return tuple(rules)


# --- rules bound to their policies, once per PolicySet ---------------------------------------

RESULTS = ("allowed", "denied", "waited", "dryrun", "unavailable", "fallback")


@dataclass(frozen=True, slots=True)
class BoundRule:
    """A rule bound to its policy for one PolicySet.

    ``allowed`` and ``limit_header`` are derived once, for the admitted calls' hot path:
    ``counters["allowed"]`` without the dict lookup, and the ``RateLimit-Limit`` header (the
    rule's burst) without a ``str()`` per call.
    """

    rule: RateLimitRule
    policy: str
    where: str
    dryrun: bool
    fail_open: bool
    per_user: bool
    needs_instance: bool
    prefix: str
    counters: Mapping[str, Any]
    allowed: Any = field(init=False, repr=False, compare=False)
    limit_header: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", self.counters["allowed"])
        object.__setattr__(self, "limit_header", ("RateLimit-Limit", str(self.rule.burst)))


class Plan:
    """The rules of one PolicySet bound to their policies; matching memoized per verb."""

    __slots__ = ("_by_verb", "needs_instance", "rules")

    def __init__(self, rules: tuple[BoundRule, ...]) -> None:
        self.rules = rules
        self.needs_instance = any(b.needs_instance for b in rules)
        self._by_verb: dict[str, tuple[BoundRule, ...]] = {}

    def candidates(self, verb: str) -> tuple[BoundRule, ...]:
        found = self._by_verb.get(verb)
        if found is None:
            found = tuple(b for b in self.rules if b.rule.match.verbs.matches(verb))
            if len(self._by_verb) < 256:
                self._by_verb[verb] = found
        return found

    def matched(self, info: RequestInfo, user: str | None) -> list[BoundRule]:
        """The rules that apply to a call (long-running ones only where spelled out)."""
        verb = info.policy_verb
        candidates = self.candidates(verb)
        if not candidates:
            return []
        skip_long = info.is_long_running and info.verb != "watch"
        return [b for b in candidates if b.rule.match.matches(info, verb, user)
                and (not skip_long or b.rule.match.names(info))]


def bind_rules(section: Sequence[tuple[Any, object]]) -> Plan:
    """Bind every rule of ``PolicySet.section(SECTION)`` to its policy (mode, failure, counters)."""
    bound: list[BoundRule] = []
    counters: dict[str, dict[str, Any]] = {}
    for policy, rules in section:
        per_policy = counters.setdefault(policy.name, {
            r: telemetry.RATELIMIT_DECISIONS.labels(policy.name, r) for r in RESULTS})
        for rule in rules:  # type: ignore[attr-defined]
            bound.append(BoundRule(
                rule=rule, policy=policy.name, where=rule.source or policy.source,
                dryrun="dryrun" in (rule.mode, policy.mode),  # a dryrun policy never denies
                fail_open=(rule.failure or policy.failure) == "open",
                per_user="user" in rule.key.fields,
                needs_instance="instance" in rule.key.fields, prefix=f"{policy.name}/{rule.name}/",
                counters=per_policy))
    return Plan(tuple(bound))
