"""List options, decoded only as far as classification needs: ``watch`` and ``metadata.name``.

A GET on a collection is a ``list`` or a ``watch`` depending on the ``watch`` flag, and a
``fieldSelector=metadata.name=X`` names the object of that list or watch (RBAC and opgate's rules
then see ``name=X``). The apiserver only takes that name when the whole ListOptions decodes, so
this module also checks the label selector, ``limit`` and ``timeoutSeconds`` for validity, the
way k8s.io/apimachinery parses them, without building anything from them.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

# --- list options: only what decides list vs watch and the object name ----------------------

_OPTION_KEYS = frozenset({"watch", "fieldSelector", "labelSelector", "limit", "timeoutSeconds"})
_HEX = frozenset("0123456789abcdefABCDEF")


def list_or_watch(query: str) -> tuple[str, str]:
    """Verb (``list`` or ``watch``) and object name of a GET/HEAD on a collection.

    The apiserver decodes the whole ListOptions; if any of it fails to decode, it still honours
    ``watch`` but takes no name from the field selector.
    """
    options = _first_values(query) if query else {}
    if not options:
        return "list", ""
    watch = options.get("watch")
    decoded, name = _field_selector_name(options.get("fieldSelector", ""))
    # The rest of ListOptions can only change the outcome when a name was found (or, in one
    # corner, for a non-ASCII watch value), so it is only validated then.
    if decoded and (name or (watch is not None and not watch.isascii())):
        decoded = _int64_ok(options.get("limit")) and _int64_ok(options.get("timeoutSeconds"))
        decoded = decoded and _label_selector_ok(options.get("labelSelector", ""))
    if watch is None:
        watching = False
    elif decoded:
        watching = not (watch == "0" or watch.casefold() == "false")
    else:
        watching = watch.lower() not in ("false", "0")
    return ("watch" if watching else "list"), (name if decoded else "")


def raw_selectors(query: str) -> tuple[str, str]:
    """The ``fieldSelector`` and ``labelSelector`` (``""`` for none) the apiserver's RequestInfo
    holds for a list, watch or deletecollection, which its authorizers see (a
    SubjectAccessReview's ``rawSelector``): each key's first value, as sent, however the rest
    of the ListOptions decodes."""
    options = _first_values(query) if query else {}
    return options.get("fieldSelector", ""), options.get("labelSelector", "")


_DRY_RUN = frozenset({"dryRun"})


def dry_run(query: str) -> bool:
    """Whether the apiserver takes a write with this raw query for a dry run: it has a
    ``dryRun`` parameter as Go's ``url.ParseQuery`` reads it (``dry%52un=All`` too; not
    ``xdryRun=``, nor a pair Go skips). Any value counts: one other than ``All`` is refused
    (422), so that call makes nothing either."""
    return "dryRun" in _first_values(query, _DRY_RUN)


def _first_values(query: str, keys: frozenset[str] = _OPTION_KEYS) -> dict[str, str]:
    """First value of each of ``keys`` (the list options), with Go's ``url.ParseQuery`` rules.

    Pairs holding a ``;`` or a malformed ``%`` escape are skipped, as Go skips them.
    """
    found: dict[str, str] = {}
    for pair in query.split("&"):
        if not pair or ";" in pair:
            continue
        raw_key, _, raw_value = pair.partition("=")
        key = raw_key
        if "%" in raw_key or "+" in raw_key:
            if not _escapes_ok(raw_key):
                continue
            key = unquote_plus(raw_key)
        if key in keys and key not in found and _escapes_ok(raw_value):
            found[key] = unquote_plus(raw_value)
    return found


def _escapes_ok(text: str) -> bool:
    at = text.find("%")
    while at >= 0:
        pair = text[at + 1 : at + 3]
        if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
            return False
        at = text.find("%", at + 3)
    return True


def _int64_ok(value: str | None) -> bool:
    """Absent, or what Go's ``strconv.ParseInt(value, 10, 64)`` accepts."""
    if value is None:
        return True
    digits = value[1:] if value[:1] in ("+", "-") else value
    if not (digits.isascii() and digits.isdigit()):
        return False
    return -(2**63) <= int(value) < 2**63


def _field_selector_name(selector: str) -> tuple[bool, str]:
    """(parsed, name): the first ``metadata.name=`` / ``==`` term of the sorted selector terms.

    The name is kept only when it could be a path segment (not ``.``/``..``, no ``/`` or ``%``).
    """
    terms: list[str] = []
    start, escaped = 0, False
    for at, char in enumerate(selector):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ",":
            terms.append(selector[start:at])
            start = at + 1
    if selector:
        terms.append(selector[start:])
    terms.sort()
    name: str | None = None
    for term in terms:
        if not term:
            continue
        at = term.find("=")
        if at < 0:
            return False, ""
        if at > 0 and term[at - 1] == "!":
            field, negated, raw = term[: at - 1], True, term[at + 1 :]
        elif term[at + 1 : at + 2] == "=":
            field, negated, raw = term[:at], False, term[at + 2 :]
        else:
            field, negated, raw = term[:at], False, term[at + 1 :]
        value = _unescape_field_value(raw)
        if value is None:
            return False, ""
        if name is None and not negated and field == "metadata.name":
            name = value
    if name is None or name in (".", "..") or "/" in name or "%" in name:
        return True, ""
    return True, name


def _unescape_field_value(raw: str) -> str | None:
    if "\\" not in raw and "," not in raw and "=" not in raw:
        return raw
    out: list[str] = []
    escaped = False
    for char in raw:
        if escaped:
            if char not in "\\,=":
                return None
            out.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in ",=":
            return None
        else:
            out.append(char)
    return None if escaped else "".join(out)


# --- label selectors: validity only (k8s.io/apimachinery labels.Parse) ------------------------

_SYMBOLS = frozenset("=!(),><")
_BLANKS = frozenset(" \t\r\n")
_LABEL_NAME = re.compile(r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")


def _label_selector_ok(selector: str) -> bool:
    return _LabelSelectorCheck(selector).run()


def _lex_labels(selector: str) -> list[tuple[str, str]]:
    """Tokens as (kind, text); kind is the operator itself, ``in``/``notin``, ``id`` or ``end``.

    Go's lexer reads a NUL byte as end of input: at a token start it ends the scan, right after a
    token it is swallowed.
    """
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(selector)
    while True:
        while pos < end and selector[pos] in _BLANKS:
            pos += 1
        if pos >= end or selector[pos] == "\0":
            tokens.append(("end", ""))
            return tokens
        start = pos
        if selector[pos] in _SYMBOLS:
            pos += 2 if selector[pos : pos + 2] in ("==", "!=") else 1
            kind = selector[start:pos]
        else:
            while pos < end and selector[pos] not in _SYMBOLS:
                if selector[pos] in _BLANKS or selector[pos] == "\0":
                    break
                pos += 1
            kind = selector[start:pos]
            kind = kind if kind in ("in", "notin") else "id"
        tokens.append((kind, selector[start:pos]))
        if pos < end and selector[pos] == "\0":
            pos += 1


class _LabelSelectorCheck:
    """Recursive descent over the label-selector grammar, answering only "would it parse"."""

    __slots__ = ("pos", "tokens")

    def __init__(self, selector: str) -> None:
        self.tokens = _lex_labels(selector)
        self.pos = 0

    def peek(self) -> str:
        kind = self.tokens[self.pos][0]
        return "id" if kind in ("in", "notin") else kind

    def take(self, *, operator: bool = False) -> tuple[str, str]:
        kind, text = self.tokens[self.pos]
        self.pos += 1
        return ("id" if kind in ("in", "notin") and not operator else kind), text

    def run(self) -> bool:
        while True:
            kind = self.peek()
            if kind == "end":
                return True
            if kind not in ("id", "!") or not self.requirement():
                return False
            kind = self.take()[0]
            if kind == "end":
                return True
            if kind != "," or self.peek() not in ("id", "!"):
                return False

    def requirement(self) -> bool:
        kind, key = self.take()
        negated = kind == "!"
        if negated:
            kind, key = self.take()
        if kind != "id" or not _label_key_ok(key):
            return False
        if negated or self.peek() in ("end", ","):
            return True
        operator = self.take(operator=True)[0]
        if operator in ("in", "notin"):
            values = self.value_set()
        elif operator in ("=", "==", "!=", ">", "<"):
            values = self.exact_value()
        else:
            return False
        if values is None:
            return False
        if operator in (">", "<") and not all(_int64_ok(value) for value in values):
            return False
        return all(len(value) <= 63 and _label_value_ok(value) for value in values)

    def value_set(self) -> set[str] | None:
        if self.take()[0] != "(":
            return None
        kind = self.peek()
        if kind == ")":
            self.take()
            return {""}
        if kind not in ("id", ","):
            return None
        values: set[str] = set()
        while True:
            kind, text = self.take()
            if kind == "id":
                values.add(text)
                following = self.peek()
                if following == ")":
                    break
                if following != ",":
                    return None
            elif kind == ",":
                following = self.peek()
                if not values or following in (")", ","):
                    values.add("")
                if following == ")":
                    break
            else:
                return None
        return values if self.take()[0] == ")" else None

    def exact_value(self) -> set[str] | None:
        if self.peek() in ("end", ","):
            return {""}
        kind, text = self.take()
        return {text} if kind == "id" else None


def _label_key_ok(key: str) -> bool:
    pieces = key.split("/")
    if len(pieces) > 2:
        return False
    if len(pieces) == 2:
        prefix = pieces[0]
        if not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
            return False
    name = pieces[-1]
    return 0 < len(name) <= 63 and _LABEL_NAME.fullmatch(name) is not None


def _label_value_ok(value: str) -> bool:
    return not value or _LABEL_NAME.fullmatch(value) is not None
