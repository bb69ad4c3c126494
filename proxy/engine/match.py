"""Which calls a policy rule applies to: the ``match`` block every middleware's rules share.

A match is written in the apiserver's vocabulary and tested against the call's RequestInfo:
``policy_verb``, API group, ``resource[/subresource]`` with RBAC's rules, namespace, and the
verified user. Every list accepts ``*`` and shell-style globs (``team-*``). Resource entries
follow RBAC: ``pods`` is the resource without subresource, ``pods/log`` one subresource,
``pods/*`` every subresource, ``*/scale`` a subresource of anything and ``*`` everything; in
a glob, ``*`` never takes a ``/`` (``pod*`` is no ``pods/exec``), as in a shell's.

A non-resource call (a path outside ``/api/{v}/…`` and ``/apis/{g}/{v}/…``) has no group,
resource or namespace, so a rule naming them is about resource requests, as in RBAC; but one
about every resource (each of ``apiGroups``, ``resources``, ``namespaces`` left out or holding
``*``) also matches the discovery paths a client reads to learn those resources (``/api``,
``/apis``, ``/openapi``, ``/version``: ``DISCOVERY_URLS`` of :mod:`proxy.engine.nonresource`,
what RBAC's default ``system:discovery`` gives every user), and no other path (``/metrics``,
``/logs``, ``/healthz``, ``/debug/…`` are not about resources). A rule naming none of them
matches every non-resource path (by verbs and users); an identity rule's ``nonResourceURLs``
name paths themselves.

Compiled once per policy load; matching does no allocation beyond an f-string.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import CallerField, Fields, Located, PolicyError

__all__ = ["NAMESPACE_NAME", "Match", "Patterns", "never_a_namespace", "parse_match"]

_GLOB_CHARS = frozenset("*?[")
# The verbs a call can have (requestinfo): the apiserver's for resources, the lower-case HTTP
# method for other paths. Any other verb (a typo, or RBAC's use/bind/escalate) never matches.
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection",
         "proxy", "head", "post", "put", "options", "connect", "trace")


# What an API group (a DNS subdomain) and a namespace (a DNS label) can hold, globs aside: an
# entry with another character matches no call. "groups" being apiGroups' alias, a user group
# ("system:masters") written there was taken, and an identity deny rule so written denied none.
_NAME_CHARS = {"groups": re.compile(r"[-a-z0-9.*?\[\]!]*"),
               "apiGroups": re.compile(r"[-a-z0-9.*?\[\]!]*"),
               "namespaces": re.compile(r"[-a-z0-9*?\[\]!]*")}
_GROUP_KIND = ('an API group is a DNS name such as "apps" or "demo.opgate.dev" (a user group '
               'is an identity allow entry\'s "group:")')
NAMESPACE_NAME = "a namespace is a DNS label (lower-case letters, digits and '-')"
_NAME_KINDS = {"groups": _GROUP_KIND, "apiGroups": _GROUP_KIND, "namespaces": NAMESPACE_NAME}


@dataclass(frozen=True, slots=True)
class Patterns:
    """A list of literal names and globs; empty or containing ``*`` matches anything.

    With ``segments`` (resources: ``pods/log``) a glob's ``*`` and ``?`` stay within one
    ``/``-separated part, as a shell's do in a path: ``pod*`` is ``pods`` or ``podtemplates``,
    never ``pods/exec`` (``pods`` is the resource without subresource), and ``*/scale`` is a
    subresource of anything. A glob then only meets values with as many ``/`` as it has, so
    one regex per count keeps ``*`` from taking a ``/`` (``by_depth``)."""

    any: bool = True
    literals: frozenset[str] = frozenset()
    regex: re.Pattern[str] | None = None
    by_depth: tuple[re.Pattern[str] | None, ...] = ()

    @classmethod
    def of(cls, items: tuple[str, ...], *, segments: bool = False) -> Patterns:
        if not items or "*" in items:
            return cls()
        globs = [i for i in items if _GLOB_CHARS & set(i)]
        literals = frozenset(i for i in items if i not in globs)
        if segments and globs:
            depths = [[g for g in globs if g.count("/") == n]
                      for n in range(max(g.count("/") for g in globs) + 1)]
            return cls(any=False, literals=literals, by_depth=tuple(
                _compile(same) if same else None for same in depths))
        return cls(any=False, literals=literals, regex=_compile(globs) if globs else None)

    def matches(self, value: str) -> bool:
        if self.any or value in self.literals:
            return True
        if self.by_depth:
            depth = value.count("/")
            regex = self.by_depth[depth] if depth < len(self.by_depth) else None
        else:
            regex = self.regex
        return regex is not None and regex.match(value) is not None


def _compile(globs: list[str]) -> re.Pattern[str]:
    return re.compile("|".join(fnmatch.translate(g) for g in globs))


@dataclass(frozen=True, slots=True)
class Match:
    """What a rule applies to. ``named`` = subresources and verbs spelled out literally, the only
    way long-running calls (exec, attach, port-forward, log, proxy) are rate limited.
    ``about_resources``: the rule names groups, resources or namespaces (``*`` too), so of the
    non-resource paths it matches discovery's only, and only when each field is ``*``
    (``every_resource``).
    ``caller_fields``: where ``users`` is written, for the policy set's check that some policy
    verifies callers."""

    verbs: Patterns = Patterns()
    groups: Patterns = Patterns()
    resources: Patterns = Patterns()
    namespaces: Patterns = Patterns()
    users: Patterns = Patterns()
    named: frozenset[str] = frozenset()
    about_resources: bool = False
    every_resource: bool = True
    caller_fields: tuple[CallerField, ...] = field(default=(), compare=False)

    def matches(self, info: RequestInfo, verb: str, user: str | None) -> bool:
        """``user=None``: any user (before identity is known, e.g. to decide on reading a body)."""
        if not (self.verbs.matches(verb) and (user is None or self.users.matches(user))):
            return False
        if not info.is_resource_request:  # /api, /metrics …: see the module docstring
            return not self.about_resources or (self.every_resource and info.is_discovery)
        resource = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
        return (self.groups.matches(info.api_group) and self.resources.matches(resource)
                and self.namespaces.matches(info.namespace))

    def names(self, info: RequestInfo) -> bool:
        """Whether the rule spells out this long-running call (``pods/exec``, ``*/log``)."""
        return (info.subresource or info.verb) in self.named


def _patterns(f: Fields, key: str, errors: list[PolicyError]) -> tuple[str, ...]:
    items = f.str_list(key)
    given = f.node(key)
    if given is not None and given.value == []:  # RBAC's reading: nothing; ours was: anything
        f.fail(key, f'is empty, which matches nothing (leave "{key}" out to match anything)')
    # each entry's own line (a block list has one per line); str_list reported the non-strings
    entries = ([e for e in given.value if isinstance(e.value, str)]
               if given is not None and isinstance(given.value, list) else [])

    def fail(index: int, message: str) -> None:
        errors.append(entries[index].error(f"{f.path(key)}: {message}"))

    for index, item in enumerate(items):
        if not item and key not in ("groups", "apiGroups", "namespaces"):  # "": core, cluster
            fail(index, 'an empty entry matches nothing (use "*" for anything)')
        elif "[" in item and "]" not in item:
            fail(index, f'"{item}" is not a valid glob (unclosed "[")')
        elif key != "users" and item != item.lower():  # a call's are always lower-case
            fail(index, f'"{item}" never matches: {key} are lower-case'
                 + (' (the plural of the URL: "deployments", not "Deployment")'
                    if key == "resources" else ""))
        elif key == "verbs" and not _GLOB_CHARS & set(item) and item not in VERBS:
            fail(index, f'"{item}" never matches: a call\'s verb is one of {", ".join(VERBS)}')
        elif key in ("groups", "apiGroups") and "/" in item:
            fail(index, f'"{item}" never matches: an API group has no version '
                 f'("{item.partition("/")[0]}", not "{item}")')
        elif key in _NAME_CHARS and not _NAME_CHARS[key].fullmatch(item):
            fail(index, f'"{item}" never matches: {_NAME_KINDS[key]}')
    return items


def never_a_namespace(item: str) -> bool:
    """Whether a namespace entry (globs allowed) has a character no namespace has."""
    return not _NAME_CHARS["namespaces"].fullmatch(item)


def parse_match(node: Located | None, what: str, errors: list[PolicyError]) -> Match:
    if node is None:
        return Match()
    f = Fields(node, what=what, errors=errors)
    verbs = _patterns(f, "verbs", errors)
    groups = _patterns(f, "groups", errors)
    api_groups = _patterns(f, "apiGroups", errors)
    if groups and api_groups:
        f.fail("apiGroups", 'use either "groups" or its alias "apiGroups", not both')
    groups = groups or api_groups
    resources = _patterns(f, "resources", errors)
    namespaces = _patterns(f, "namespaces", errors)
    users = _patterns(f, "users", errors)
    callers = (f.caller_field("users"),) if users else ()
    f.finish()
    named = {r.split("/", 1)[1] for r in resources if "/" in r}
    named.update(verbs)
    named = {n for n in named if not _GLOB_CHARS & set(n)}
    in_groups, of_resources = Patterns.of(groups), Patterns.of(resources, segments=True)
    in_namespaces = Patterns.of(namespaces)
    return Match(verbs=Patterns.of(verbs), groups=in_groups, resources=of_resources,
                 namespaces=in_namespaces, users=Patterns.of(users), named=frozenset(named),
                 about_resources=bool(groups or resources or namespaces),
                 every_resource=in_groups.any and of_resources.any and in_namespaces.any,
                 caller_fields=callers)
