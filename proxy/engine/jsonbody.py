"""JSON as deep as the apiserver takes it: Python's ``json`` gives up at about 1,000 levels.

The apiserver decodes JSON nested up to 10,000 levels (sigs.k8s.io/json's ``maxNestingDepth``,
Go's encoding/json's): a custom resource with ``x-kubernetes-preserve-unknown-fields`` stores
an object 2,000 levels deep, and its ``managedFields`` (and so its metadata-only watch events)
are as deep. The ``json`` module recurses once per level in C and raises ``RecursionError``
at ``sys.getrecursionlimit()`` (1,000); the body readers (the quota's and audit's object name,
``{instance}``, the audit's ``requestObject``, the capture's redaction, the informers' lists
and watches) would fail on such a body, or the call would. Raising the limit is no fix: it is
process-wide, past the thread's C stack a deep recursion is a segfault, not an error, and from
Python 3.12 the C code has a fixed limit of its own.

So :func:`loads` and :class:`Encoder` first do what ``json`` does (every ordinary body: no cost
but a ``try``) and only on ``RecursionError`` walk the document with an explicit stack (no
recursion at any depth; ``json``'s C scanner still reads each string and number, so values are
the same). A document nested deeper than :data:`MAX_DEPTH` is a ``ValueError`` (:class:`TooDeep`,
a ``JSONDecodeError`` saying ``exceeded max depth``), as it is to the apiserver: its 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from json.decoder import JSONDecodeError, scanstring
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any

__all__ = ["MAX_DEPTH", "Encoder", "TooDeep", "dumps", "loads"]

MAX_DEPTH = 10000  # sigs.k8s.io/json (and Go's encoding/json): maxNestingDepth
_SCAN = json.JSONDecoder().scan_once  # the value at an index, in C
_SPACE = re.compile(r"[ \t\n\r]*")
_TRIES = 32  # containers given to the C scanner whole that turn out too deep for it


class TooDeep(JSONDecodeError):
    """The document is nested deeper than :data:`MAX_DEPTH` (the apiserver's 400 says
    ``exceeded max depth`` too)."""


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, also for a document nested deeper than ``json`` recurses (up to
    :data:`MAX_DEPTH`). ``ValueError`` (``JSONDecodeError``) for one that is not JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        pass
    if isinstance(data, (bytes, bytearray)):
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    return _parse(data)


def _skip(text: str, pos: int) -> int:
    """The position of the first character at or after ``pos`` that is not JSON whitespace."""
    found = _SPACE.match(text, pos)
    return found.end() if found is not None else pos


def _key(text: str, pos: int) -> tuple[str, int]:
    """A member's name and the position after its ``:`` (``pos`` at its opening quote)."""
    if text[pos:pos + 1] != '"':
        raise JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
    key, pos = scanstring(text, pos + 1)
    pos = _skip(text, pos)
    if text[pos:pos + 1] != ":":
        raise JSONDecodeError("Expecting ':' delimiter", text, pos)
    return key, _skip(text, pos + 1)


def _scan(text: str, pos: int) -> tuple[Any, int] | None:
    """The value at ``pos`` read by ``json``'s C scanner, ``None`` when it is too deep for it."""
    try:
        return _SCAN(text, pos)  # type: ignore[no-any-return]
    except StopIteration as exc:
        raise JSONDecodeError("Expecting value", text, exc.value) from None
    except RecursionError:
        return None


def _parse(text: str) -> Any:
    """The document in ``text``, each open container on an explicit stack (``[container,
    key]``). A container is first given to the C scanner whole (most of a deep document is
    shallow); after :data:`_TRIES` containers too deep for it, none is: each failed try read
    up to ~1,000 levels for nothing, and with fewer tries than levels the stack stays shallow
    while they last, so what the C scanner reads is within :data:`MAX_DEPTH`."""
    stack: list[list[Any]] = []
    tries = _TRIES
    pos = _skip(text, 0)
    while True:
        char = text[pos:pos + 1]
        found = _scan(text, pos) if tries or (char != "{" and char != "[") else None
        if found is not None:
            value, pos = found
        else:
            tries -= 1 if tries else 0
            if len(stack) >= MAX_DEPTH:
                raise TooDeep("exceeded max depth", text, pos)
            pos = _skip(text, pos + 1)
            if text[pos:pos + 1] != ("}" if char == "{" else "]"):
                if char == "{":
                    key, pos = _key(text, pos)
                    stack.append([{}, key])
                else:
                    stack.append([[], None])
                continue  # to the first member's value
            value = {} if char == "{" else []
            pos += 1
        while True:  # ``value`` is complete: put it in its container, then what follows it
            if not stack:
                pos = _skip(text, pos)
                if pos != len(text):
                    raise JSONDecodeError("Extra data", text, pos)
                return value
            top = stack[-1]
            container = top[0]
            if top[1] is None:
                container.append(value)
            else:
                container[top[1]] = value
            pos = _skip(text, pos)
            char = text[pos:pos + 1]
            if char == ",":
                pos = _skip(text, pos + 1)
                if top[1] is not None:
                    top[1], pos = _key(text, pos)
                break  # to the next member's value
            if char != ("]" if top[1] is None else "}"):
                raise JSONDecodeError("Expecting ',' delimiter", text, pos)
            pos += 1
            value = stack.pop()[0]


class Encoder(json.JSONEncoder):
    """A ``json.JSONEncoder`` whose :meth:`encode` also writes an object nested deeper than the
    C encoder recurses (e.g. what :func:`loads` read), the same text either way."""

    def encode(self, o: Any) -> str:
        try:
            return super().encode(o)
        except RecursionError:
            return "".join(self._pieces(o))

    def _pieces(self, o: Any) -> Iterator[str]:
        string = encode_basestring_ascii if self.ensure_ascii else encode_basestring
        stack: list[tuple[Iterator[Any], str, bool]] = []  # (members, closer, of a dict)
        first = True  # the next member is its container's first
        tries = _TRIES  # as in _parse: containers the C encoder is given whole, and fails
        while True:
            whole = self._whole(o) if tries and isinstance(o, (dict, list, tuple)) else None
            if whole is not None:
                yield whole
            elif isinstance(o, dict):
                tries -= 1 if tries else 0
                yield "{"
                stack.append((iter(o.items()), "}", True))
                first = True
            elif isinstance(o, (list, tuple)):
                tries -= 1 if tries else 0
                yield "["
                stack.append((iter(o), "]", False))
                first = True
            else:
                yield self._scalar(o, string)
            while True:  # the next member of the innermost open container
                if not stack:
                    return
                members, closer, is_dict = stack[-1]
                member = next(members, _END)
                if member is _END:
                    stack.pop()
                    yield closer
                    first = False
                    continue
                if not first:
                    yield self.item_separator
                first = False
                if is_dict:
                    yield string(self._key_text(member[0])) + self.key_separator
                    o = member[1]
                else:
                    o = member
                break

    def _whole(self, o: Any) -> str | None:
        """``o`` written by the C encoder, ``None`` when it is too deep for it."""
        try:
            return super().encode(o)
        except RecursionError:
            return None

    def _scalar(self, o: Any, string: Any) -> str:
        if isinstance(o, str):
            return str(string(o))
        if o is None:
            return "null"
        if o is True or o is False:
            return "true" if o else "false"
        if isinstance(o, int):
            return int.__repr__(o)
        if isinstance(o, float):
            return self._float(o)
        return self._scalar(self.default(o), string)  # default raises TypeError

    def _float(self, o: float) -> str:
        if o != o or o in (float("inf"), float("-inf")):
            if not self.allow_nan:
                raise ValueError(f"Out of range float values are not JSON compliant: {o!r}")
            return "NaN" if o != o else ("Infinity" if o > 0 else "-Infinity")
        return float.__repr__(o)

    def _key_text(self, key: Any) -> str:
        if isinstance(key, str):
            return key
        if isinstance(key, float):
            return self._float(key)
        if key is True or key is False or key is None:
            return {True: "true", False: "false", None: "null"}[key]
        if isinstance(key, int):
            return int.__repr__(key)
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


_END = object()
_COMPACT = Encoder(separators=(",", ":"))


def dumps(o: Any) -> str:
    """``json.dumps(o, separators=(",", ":"))`` at any depth."""
    return _COMPACT.encode(o)
