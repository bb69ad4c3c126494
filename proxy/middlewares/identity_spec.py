"""``spec.identity``: YAML → an immutable spec (issuers, allow list, rules).

Parsed once per policy load. ``issuers`` says whose tokens opgate verifies itself: the cluster's
service-account issuer (``kubernetes: {}``, found by OIDC discovery on the apiserver) and OIDC
providers (``oidc: {issuer, audiences, claims}``); any other token is handed to the apiserver (a
TokenReview). ``allow`` lists who may call at all (``serviceAccount: ns/name``, ``user``,
``group``; globs allowed). ``rules`` narrow what they may do
(:mod:`proxy.middlewares.identity_rules`); the first rule that matches decides and no match
denies. ``subjectAccessReview: true`` also asks the apiserver. Who a verified token names, by
its issuer's declaration here, is :mod:`proxy.middlewares.identity_claims`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.engine.context import Identity
from proxy.engine.match import Patterns
from proxy.engine.schema import Fields, Located, PolicyError, sequence
from proxy.middlewares.identity_rules import Rule, parse_rules

__all__ = ["KUBERNETES", "SA_PREFIX", "SECTION", "TOKENREVIEW", "AllowList", "IdentitySpec",
           "Issuer", "parse_section"]

SECTION = "identity"
KUBERNETES = "kubernetes"  # the issuer key of the cluster's own service-account issuer
TOKENREVIEW = "tokenreview"  # the issuer key of identities the apiserver vouched for
# what a kubernetes token's audience may be besides the issuer itself (the apiserver's defaults)
DEFAULT_KUBERNETES_AUDIENCES = ("https://kubernetes.default.svc",
                                "https://kubernetes.default.svc.cluster.local")
SA_PREFIX = "system:serviceaccount:"
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
        given = k.node("audiences")
        if given is not None and given.value == []:  # () is "those the apiserver accepts"
            k.fail("audiences", 'is empty, which accepts no token (leave "audiences" out for '
                   "those the apiserver accepts)")
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
        if issuers_node.value == []:  # no service-account token passes, none is verified here
            f.fail("issuers", "is empty, which refuses every service-account token (leave "
                   '"issuers" out for the cluster\'s own: "- kubernetes: {}")')
        keys = [i.key for i in issuers]
        for dup in sorted({k for k in keys if keys.count(k) > 1}):
            f.fail("issuers", f'"{dup}" is listed twice')
    allow_node = f.node("allow", required=True)
    allow = _parse_allow(allow_node, f"{what}.allow", errors,
                         allow_node.where() if allow_node is not None else node.where())
    if allow_node is not None and allow.users is None and allow.groups is None:
        f.fail("allow", 'names nobody (to allow every verified caller: "- group: '
               'system:authenticated")')
    rules, rules_where = parse_rules(f, errors)
    sar = f.bool("subjectAccessReview", default=False)
    f.finish()
    return IdentitySpec(issuers=issuers, allow=allow, rules=rules, rules_where=rules_where,
                        subject_access_review=sar)
