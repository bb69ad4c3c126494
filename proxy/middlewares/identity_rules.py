"""``spec.identity.rules``: what a caller the allow list admits may do.

In the shared ``match`` vocabulary (:mod:`proxy.engine.match`) plus an optional ``name`` and
``effect`` (``allow``, the default, or ``deny``) and RBAC's ``nonResourceURLs``
(:mod:`proxy.engine.nonresource`: a rule with them is about those paths only, never about a
resource request). The first rule that matches decides and no match denies
(:class:`proxy.middlewares.identity_spec.IdentitySpec` holds them in order); this module reads
the list, each rule's ``file:line`` errors included, and matches one rule against a call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.engine.match import VERBS, Match, parse_match
from proxy.engine.nonresource import url_matches, url_problem
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import Fields, Located, PolicyError, sequence

__all__ = ["NON_RESOURCE_VERBS", "Rule", "parse_rules"]

URLS = "nonResourceURLs"
# the verbs of a non-resource call: its lower-case HTTP method (requestinfo)
NON_RESOURCE_VERBS = ("get", "head", "post", "put", "patch", "delete", "options", "connect",
                      "trace")


@dataclass(frozen=True, slots=True)
class Rule:
    """One of ``rules``. With ``non_resource_urls`` (RBAC's ``nonResourceURLs``) it is about
    non-resource calls only, and then only those paths; without, ``match`` alone decides."""

    name: str
    match: Match
    allow: bool = True
    source: str = ""
    non_resource_urls: tuple[str, ...] = ()

    def matches(self, info: RequestInfo, verb: str, user: str | None) -> bool:
        if self.non_resource_urls and (info.is_resource_request
                                       or not url_matches(info.path, self.non_resource_urls)):
            return False
        return self.match.matches(info, verb, user)


def parse_rules(f: Fields, errors: list[PolicyError]) -> tuple[tuple[Rule, ...], str]:
    """The section's ``rules`` (read through its :class:`Fields` ``f``) and where the list is
    (``""`` when missing): a rule with errors is left out, the others kept in order."""
    what = f.what
    rules_node = f.node("rules", required=True)
    rule_items = (sequence(rules_node, what=f"{what}.rules", errors=errors)
                  if rules_node is not None else [])
    rules = [_parse_rule(item, f"{what}.rules[{i}]", i, errors)
             for i, item in enumerate(rule_items)]
    if rules_node is not None and not rule_items:
        f.fail("rules", 'has no rule, so it denies everything (to allow anything RBAC allows: '
               '"- {verbs: [\'*\']}")')
    seen: dict[str, str] = {}
    for index, rule in enumerate(rules):
        if rule is None:
            continue
        if rule.name in seen:  # at the second one, not at the list
            errors.append(rule_items[index].error(
                f'{what}.rules[{index}]: two rules are named "{rule.name}" '
                f"(also at {seen[rule.name]})"))
        else:
            seen[rule.name] = rule.source
    return (tuple(r for r in rules if r),
            rules_node.where() if rules_node is not None else "")


def _parse_rule(node: Located, what: str, index: int,
                errors: list[PolicyError]) -> Rule | None:
    if not isinstance(node.value, dict):
        Fields(node, what=what, errors=errors)  # reports "expected a mapping"
        return None
    own = ("name", "effect", URLS)
    f = Fields(Located({k: v for k, v in node.value.items() if k in own},
                       node.file, node.line, node.key_lines), what=what, errors=errors)
    name = f.str("name", default=f"rules[{index}]") or f"rules[{index}]"
    effect = f.str("effect", default="allow", choices=("allow", "deny")) or "allow"
    rest = {k: v for k, v in node.value.items() if k not in own}
    urls = _non_resource_urls(f, rest, errors)
    match = parse_match(Located(rest, node.file, node.line, node.key_lines), what, errors)
    return Rule(name=name, match=match, allow=effect == "allow", source=node.where(),
                non_resource_urls=urls)


def _non_resource_urls(f: Fields, rest: Mapping[str, Located],
                       errors: list[PolicyError]) -> tuple[str, ...]:
    """A rule's ``nonResourceURLs``, checked as RBAC checks a ClusterRole's (not with resource
    fields: such a rule could never match) plus what could never match a call: a bad entry, an
    empty list, a verb that no non-resource call has (theirs is the lower-case HTTP method)."""
    urls = f.str_list(URLS)
    given = f.node(URLS)
    if given is None:
        return ()
    if given.value == []:
        f.fail(URLS, f'is empty, which matches nothing (leave "{URLS}" out for a rule about '
               "resources)")
    for entry in given.value if isinstance(given.value, list) else ():
        problem = url_problem(entry.value) if isinstance(entry.value, str) else None
        if problem is not None:
            errors.append(entry.error(f"{f.path(URLS)}: {problem}"))
    mixed = [k for k in ("apiGroups", "groups", "resources", "namespaces") if k in rest]
    if mixed:
        f.fail(URLS, f'a rule applies either to resources ("{mixed[0]}") or to '
               f'"{URLS}", not both (RBAC\'s rule too)')
    verbs = rest.get("verbs")
    for entry in verbs.value if verbs is not None and isinstance(verbs.value, list) else ():
        verb = entry.value
        if isinstance(verb, str) and verb in VERBS and verb not in NON_RESOURCE_VERBS:
            errors.append(entry.error(
                f'{f.path("verbs")}: "{verb}" never matches a non-resource URL: its verb is the '
                f'lower-case HTTP method ({", ".join(NON_RESOURCE_VERBS)})'))
    return urls
