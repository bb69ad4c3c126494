"""``spec.identity``: YAML → an immutable spec (issuers, allow list, rules), and claim mapping.

Parsed once per policy load. ``issuers`` says whose tokens opgate verifies itself: the cluster's
service-account issuer (``kubernetes: {}``, found by OIDC discovery on the apiserver) and OIDC
providers (``oidc: {issuer, audiences, claims}``); any other token is handed to the apiserver (a
TokenReview). ``allow`` lists who may call at all (``serviceAccount: ns/name``, ``user``,
``group``; globs allowed). ``rules`` narrow what they may do, in the shared ``match`` vocabulary
plus an optional ``name`` and ``effect`` (``allow``, the default, or ``deny``) and RBAC's
``nonResourceURLs`` (:mod:`proxy.engine.nonresource`: a rule with them is about those paths
only, never about a resource request); the first rule that matches decides and no match
denies. ``subjectAccessReview: true`` also asks the apiserver.

The claim mapping (:func:`identity_from_claims`) lives here because it is what the spec means:
a service-account token becomes ``system:serviceaccount:<ns>:<name>`` with the apiserver's
groups; an OIDC token's user is ``claims.username`` (default ``sub``, prefixed ``<issuer>#``
unless it is ``email``, as the apiserver does; ``usernamePrefix: "-"`` for none).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.engine.context import Extra, Identity
from proxy.engine.match import VERBS, Match, Patterns, parse_match
from proxy.engine.nonresource import url_matches, url_problem
from proxy.engine.requestinfo import RequestInfo
from proxy.engine.schema import Fields, Located, PolicyError, sequence

__all__ = ["KUBERNETES", "SECTION", "TOKENREVIEW", "AllowList", "IdentitySpec", "Issuer", "Rule",
           "identity_from_claims", "parse_section"]

SECTION = "identity"
URLS = "nonResourceURLs"
# the verbs of a non-resource call: its lower-case HTTP method (requestinfo)
NON_RESOURCE_VERBS = ("get", "head", "post", "put", "patch", "delete", "options", "connect",
                      "trace")
KUBERNETES = "kubernetes"  # the issuer key of the cluster's own service-account issuer
TOKENREVIEW = "tokenreview"  # the issuer key of identities the apiserver vouched for
# what a kubernetes token's audience may be besides the issuer itself (the apiserver's defaults)
DEFAULT_KUBERNETES_AUDIENCES = ("https://kubernetes.default.svc",
                                "https://kubernetes.default.svc.cluster.local")
SA_PREFIX = "system:serviceaccount:"
# the keys of user.extra the apiserver's authenticators fill (k8s.io/apiserver
# pkg/authentication/user and serviceaccount/util.go)
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_UID = "authentication.kubernetes.io/node-uid"
AUTHENTICATED = "system:authenticated"
_DNS_LABEL = re.compile(r"[a-z0-9*?\[\]]([-a-z0-9.*?\[\]]*[a-z0-9*?\[\]])?")


@dataclass(frozen=True, slots=True)
class Issuer:
    """One accepted issuer. ``url`` is ``""`` for ``kubernetes`` (discovered from the apiserver);
    ``audiences`` ``()`` for ``kubernetes`` means those the apiserver accepts: the issuer and the
    in-cluster service names are verified offline, any other is asked (:meth:`known`)."""

    kind: str  # kubernetes | oidc
    url: str = ""
    audiences: tuple[str, ...] = ()
    username_claim: str = "sub"
    username_prefix: str | None = None  # None: "<issuer>#" unless the claim is email
    groups_claim: str = ""
    groups_prefix: str = ""
    source: str = ""

    @property
    def key(self) -> str:
        return KUBERNETES if self.kind == KUBERNETES else self.url

    def audience_ok(self, token_audiences: tuple[str, ...], issuer_url: str, *,
                    vouched: bool = False) -> bool:
        """Whether this declaration accepts a token of these audiences: one of ``audiences``
        when listed; else one the apiserver accepts, so any of a token it ``vouched`` for (a
        TokenReview: its ``--api-audiences`` may name others), or one of :meth:`known`."""
        if not self.audiences and vouched:
            return True
        wanted = self.audiences or (issuer_url, *DEFAULT_KUBERNETES_AUDIENCES)
        return any(a in wanted for a in token_audiences)

    def known(self, token_audiences: tuple[str, ...], issuer_url: str) -> bool:
        """Whether a ``kubernetes`` token of these audiences may be verified offline: one is
        the issuer, an in-cluster name of the apiserver or one listed; the apiserver is asked
        about any other (a TokenReview), which its ``--api-audiences`` may hold."""
        wanted = (issuer_url, *DEFAULT_KUBERNETES_AUDIENCES, *self.audiences)
        return any(a in wanted for a in token_audiences)


@dataclass(frozen=True, slots=True)
class AllowList:
    """Who may call at all: users (service accounts are users) and groups, globs compiled."""

    users: Patterns | None
    groups: Patterns | None
    where: str

    def allows(self, identity: Identity) -> bool:
        if self.users is not None and self.users.matches(identity.user):
            return True
        return self.groups is not None and any(self.groups.matches(g) for g in identity.groups)


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


@dataclass(frozen=True, slots=True)
class IdentitySpec:
    issuers: tuple[Issuer, ...]
    allow: AllowList
    rules: tuple[Rule, ...]
    rules_where: str = ""
    subject_access_review: bool = False

    def accepts(self, issuer_key: str) -> bool:
        return issuer_key == TOKENREVIEW or any(i.key == issuer_key for i in self.issuers)

    def issuer(self, issuer_key: str) -> Issuer | None:
        for i in self.issuers:
            if i.key == issuer_key:
                return i
        return None

    def check_against(self, earlier: Sequence[object]) -> list[PolicyError]:
        """An OIDC issuer that an earlier policy declared with another claim mapping is an
        error: a token is verified once, with the first declaration's mapping, so this one's
        would be ignored (and a rule about its user names silently never match)."""
        found: list[PolicyError] = []
        for issuer in self.issuers:
            if issuer.kind == KUBERNETES:  # no claim mapping of its own
                continue
            other = next((o for spec in earlier if isinstance(spec, IdentitySpec)
                          for o in spec.issuers if o.key == issuer.key), None)
            if other is None or _claims(other) == _claims(issuer):
                continue
            file, _, line = issuer.source.rpartition(":")
            found.append(PolicyError(file, int(line) if line.isdigit() else 0, (
                f'spec.identity.issuers: "{issuer.url}" maps claims differently from its '
                f"declaration at {other.source} (a token is one user for every policy: username,"
                " usernamePrefix, groups and groupsPrefix must agree)")))
        return found


def _claims(issuer: Issuer) -> tuple[str, str | None, str, str]:
    return (issuer.username_claim, issuer.username_prefix, issuer.groups_claim,
            issuer.groups_prefix)


def _parse_issuer(node: Located, what: str, errors: list[PolicyError]) -> Issuer | None:
    f = Fields(node, what=what, errors=errors)
    if not f.ok:
        return None
    k8s, oidc = f.node(KUBERNETES), f.node("oidc")
    present = [k for k in (KUBERNETES, "oidc") if k in node.value]
    if len(present) != 1:
        f.fail(KUBERNETES, 'an issuer is exactly one of "kubernetes: {}" or "oidc: {...}"')
    f.finish()
    if len(present) != 1:
        return None
    if present == [KUBERNETES]:
        body = k8s if k8s is not None else Located({}, node.file, node.line)
        k = Fields(body, what=f"{what}.kubernetes", errors=errors)
        audiences = k.str_list("audiences")
        k.finish()
        return Issuer(kind=KUBERNETES, audiences=audiences, source=node.where())
    o = Fields(oidc or Located(None, node.file, node.line), what=f"{what}.oidc", errors=errors)
    url = o.str("issuer", required=True) or ""  # as written: the token's iss must equal it
    if url and not url.startswith("https://"):
        o.fail("issuer", f'must be an https:// URL (got "{url}")')
    audiences = o.str_list("audiences", required=True)
    if oidc is not None and isinstance(oidc.value, dict) and "audiences" in oidc.value \
            and not audiences:
        o.fail("audiences", "must name at least one audience (the client id)")
    username, prefix, groups, groups_prefix = "sub", None, "", ""
    claims = o.node("claims")
    if claims is not None:
        c = Fields(claims, what=f"{what}.oidc.claims", errors=errors)
        username = c.str("username", default="sub") or "sub"
        prefix = c.str("usernamePrefix")
        groups = c.str("groups", default="") or ""
        groups_prefix = c.str("groupsPrefix", default="") or ""
        c.finish()
    o.finish()
    return Issuer(kind="oidc", url=url, audiences=audiences, username_claim=username,
                  username_prefix=prefix, groups_claim=groups, groups_prefix=groups_prefix,
                  source=node.where())


def _parse_allow(node: Located | None, what: str, errors: list[PolicyError],
                 where: str) -> AllowList:
    users: list[str] = []
    groups: list[str] = []
    items = sequence(node, what=what, errors=errors) if node is not None else []
    for index, item in enumerate(items):
        f = Fields(item, what=f"{what}[{index}]", errors=errors)
        if not f.ok:
            continue
        sa, user, group = f.str("serviceAccount"), f.str("user"), f.str("group")
        given = [v for v in (sa, user, group) if v is not None]
        if len(given) != 1:
            f.fail("serviceAccount", 'an entry is exactly one of "serviceAccount: <namespace>/'
                   '<name>", "user: <name>" or "group: <name>"')
        elif sa is not None:
            namespace, _, name = sa.partition("/")
            if not (_DNS_LABEL.fullmatch(namespace) and name and "/" not in name):
                f.fail("serviceAccount", f'"{sa}" must be <namespace>/<name> (globs allowed)')
            else:
                users.append(f"{SA_PREFIX}{namespace}:{name}")
        elif user is not None:
            users.append(user)
        elif group is not None:
            groups.append(group)
        for value in given:
            if not value:
                f.fail("user" if user is not None else "group", "must not be empty")
        f.finish()
    return AllowList(users=Patterns.of(tuple(users)) if users else None,
                     groups=Patterns.of(tuple(groups)) if groups else None, where=where)


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


def parse_section(node: Located, errors: list[PolicyError]) -> IdentitySpec:
    """The ``SectionParser`` for ``spec.identity``."""
    what = f"spec.{SECTION}"
    f = Fields(node, what=what, errors=errors)
    issuers_node = f.node("issuers")
    if issuers_node is None:
        issuers: tuple[Issuer, ...] = (Issuer(kind=KUBERNETES, source=node.where()),)
    else:
        parsed = [_parse_issuer(item, f"{what}.issuers[{i}]", errors)
                  for i, item in enumerate(sequence(issuers_node, what=f"{what}.issuers",
                                                    errors=errors))]
        issuers = tuple(i for i in parsed if i is not None)
        keys = [i.key for i in issuers]
        for dup in sorted({k for k in keys if keys.count(k) > 1}):
            f.fail("issuers", f'"{dup}" is listed twice')
    allow_node = f.node("allow", required=True)
    allow = _parse_allow(allow_node, f"{what}.allow", errors,
                         allow_node.where() if allow_node is not None else node.where())
    if allow_node is not None and allow.users is None and allow.groups is None:
        f.fail("allow", 'names nobody (to allow every verified caller: "- group: '
               'system:authenticated")')
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
    sar = f.bool("subjectAccessReview", default=False)
    f.finish()
    return IdentitySpec(issuers=issuers, allow=allow, rules=tuple(r for r in rules if r),
                        rules_where=rules_node.where() if rules_node is not None else "",
                        subject_access_review=sar)


# --- claims → Identity --------------------------------------------------------------------

def _service_account(claims: Mapping[str, Any]) -> Identity | None:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.startswith(SA_PREFIX):
        return None
    namespace, _, name = sub[len(SA_PREFIX):].partition(":")
    if not namespace or not name or ":" in name:
        return None
    uid = ""
    k8s = claims.get("kubernetes.io")
    pairs: list[tuple[str, str]] = []
    if isinstance(k8s, dict):
        sa = k8s.get("serviceaccount")
        if k8s.get("namespace") != namespace or not isinstance(sa, dict) or sa.get("name") != name:
            return None
        uid = str(sa.get("uid") or "")
        pairs = _bound_to(k8s)
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED)
    return Identity(user=sub, groups=groups, uid=uid, source="serviceaccount",
                    extra=_extra(claims, pairs))


def _ref(k8s: Mapping[str, Any], kind: str) -> tuple[str, str] | None:
    """The name and uid of the object a token is bound to (``kubernetes.io.pod`` …)."""
    ref = k8s.get(kind)
    if not isinstance(ref, dict):
        return None
    name, uid = ref.get("name"), ref.get("uid")
    return (name if isinstance(name, str) else "", uid if isinstance(uid, str) else "")


def _bound_to(k8s: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``user.extra`` of a service-account token's binding, as the apiserver's validator
    (pkg/serviceaccount/claims.go) and ``ServiceAccountInfo.UserInfo`` fill it: the pod's name
    and uid when both are set, the node's name (and uid, when set) of a pod- or node-bound
    token; nothing for a secret-bound one."""
    pairs: list[tuple[str, str]] = []
    pod = _ref(k8s, "pod")
    if pod is not None and pod[0] and pod[1]:
        pairs += [(POD_NAME, pod[0]), (POD_UID, pod[1])]
    node = _ref(k8s, "node")
    if node is not None and node[0]:
        pairs.append((NODE_NAME, node[0]))
        if node[1]:
            pairs.append((NODE_UID, node[1]))
    return pairs


def _extra(claims: Mapping[str, Any], pairs: list[tuple[str, str]]) -> Extra:
    """``user.extra`` by key: ``pairs`` and the credential id ``JTI=<jti>`` of a token with a
    ``jti`` (the apiserver's service-account and OIDC authenticators both add it)."""
    jti = claims.get("jti")
    if isinstance(jti, str) and jti:
        pairs = [*pairs, (CREDENTIAL_ID, f"JTI={jti}")]
    return tuple(sorted((key, (value,)) for key, value in pairs))


def identity_from_claims(issuer: Issuer, issuer_url: str,
                         claims: Mapping[str, Any]) -> Identity | None:
    """The caller a verified token names, or ``None`` when the claims do not name one."""
    if issuer.kind == KUBERNETES:
        return _service_account(claims)
    value = claims.get(issuer.username_claim)
    if not isinstance(value, str) or not value:
        return None
    # as the apiserver: an email_verified claim, when present, must be the JSON true
    if issuer.username_claim == "email" and claims.get("email_verified", True) is not True:
        return None
    prefix = issuer.username_prefix
    if prefix is None:
        prefix = "" if issuer.username_claim == "email" else f"{issuer_url}#"
    elif prefix == "-":
        prefix = ""
    groups: list[str] = []
    if issuer.groups_claim:
        raw = claims.get(issuer.groups_claim)
        if isinstance(raw, str):
            items = [raw]
        elif raw is None or (isinstance(raw, list) and all(isinstance(g, str) for g in raw)):
            items = raw or []
        else:  # as the apiserver, which refuses the token: not a string nor a list of them
            return None
        groups = [issuer.groups_prefix + g for g in items if g]
    groups.append(AUTHENTICATED)
    return Identity(user=prefix + value, groups=tuple(groups), uid="", source="oidc",
                    extra=_extra(claims, []))
