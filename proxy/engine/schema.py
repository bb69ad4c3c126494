"""The small toolkit every policy section is validated with, and its ``file:line`` errors.

opgate's policy files are edited by people, so every error must say where it is: ``file:line:
message`` (:class:`PolicyError`, always one line). :mod:`proxy.engine.yamlload` reads a file
into :class:`Located` values, which keep the line of every value and mapping key;
:class:`Fields` reads one mapping the way a section parser wants to: typed getters that record
errors instead of raising, and :meth:`Fields.finish` that reports every key nobody asked for.
A middleware module owns its section of ``spec`` through a :data:`SectionParser` built on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

# Fields has methods named str/int/bool; these aliases keep the builtins reachable in its body.
_Str: TypeAlias = str
_Int: TypeAlias = int
_Bool: TypeAlias = bool


# Messages quote what the file says: a line break in a value (a "|" block, a "\n" escape) must
# not split one error over lines, nor let a file forge more "file:line: message" lines.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x09}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})
# a file name that is not UTF-8 (os.listdir's surrogates): its bytes, printable in any terminal
_ESCAPES.update({c: f"\\x{c - 0xDC00:02x}" for c in range(0xDC80, 0xDD00)})


class PolicyError(Exception):
    """One problem in a policy file. ``str()`` is ``file:line: message`` (``file: message`` when
    the problem has no line, e.g. a file that cannot be read), always one line: control
    characters are escaped."""

    def __init__(self, file: str, line: int, message: str) -> None:
        super().__init__(file, line, message)
        self.file = file
        self.line = line
        self.message = message

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line > 0 else self.file
        return f"{where}: {self.message}".translate(_ESCAPES)


@dataclass(frozen=True, slots=True)
class Located:
    """A YAML value with where it came from.

    ``value`` is ``dict[str, Located]``, ``list[Located]`` or a scalar (treat both containers as
    read-only: aliased nodes are shared). ``line`` is 1-based. For a mapping, ``key_lines`` gives
    the line of each key, which is where errors about that key point. ``reported``: the YAML
    could not be made a value (an unsupported tag, a recursive alias), its error is already
    recorded, and ``value`` is ``None``: readers skip it rather than report it again as null.
    """

    value: Any
    file: str
    line: int
    key_lines: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)
    reported: bool = field(default=False, repr=False, compare=False)

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def error(self, message: str, *, line: int | None = None) -> PolicyError:
        """A :class:`PolicyError` at this value (or at ``line`` of the same file)."""
        return PolicyError(self.file, self.line if line is None else line, message)

    def plain(self) -> Any:
        """The value without positions (plain dicts, lists and scalars)."""
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


@dataclass(frozen=True, slots=True)
class CallerField:
    """Where a parsed section names the verified caller (a match's ``users``, an audit rule's
    ``userGroups``). Such a field matches only when some policy of the set has
    ``spec.identity`` (else no call has a user), which one section cannot see: a spec lists
    them as ``caller_fields`` and :mod:`proxy.engine.policies` checks them against the set."""

    file: str
    line: int
    path: str


SectionParser = Callable[[Located, list[PolicyError]], object]
"""Validates one section of ``spec`` (given its node), appends every problem to the list, and
returns an immutable spec object for the middleware (any value when there were errors)."""


_TYPE_NAMES = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
               (dict, "a mapping"), (list, "a list"))


def describe_type(value: object) -> str:
    """How error messages name the type of a YAML value."""
    if value is None:
        return "null"
    for kind, name in _TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


def sequence(node: Located, *, what: str, errors: list[PolicyError]) -> list[Located]:
    """The items of a list node (``[]`` for null); anything else is an error."""
    if node.value is None:  # null, or already reported
        return []
    if not isinstance(node.value, list):
        errors.append(node.error(f"{what}: expected a list, got {describe_type(node.value)}"))
        return []
    return list(node.value)


_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)"
_DURATION = re.compile(f"(?:{_DURATION_PART})+")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_duration(text: str) -> float | None:
    """Go-style durations (``500ms``, ``2s``, ``1m30s``); ``None`` when it is not one."""
    if not _DURATION.fullmatch(text):
        return None
    return sum(float(n) * _UNIT_SECONDS[unit] for n, unit in re.findall(_DURATION_PART, text))


class Fields:
    """Reads one mapping node; typed getters record errors in ``errors`` instead of raising.

    ``what`` is the path of the mapping in messages (``spec.faults[0]``; ``""`` for the top of a
    document). A null value counts as absent. A getter that finds a bad value records the error
    and returns the default, so a parser can go on and report everything in one pass. Call
    :meth:`finish` last: every key that no getter asked for is an "unknown field" error.
    """

    def __init__(self, node: Located, *, what: _Str, errors: list[PolicyError]) -> None:
        self.located = node
        self.what = what
        self.errors = errors
        self.ok = isinstance(node.value, dict)
        self._map: dict[_Str, Located] = node.value if self.ok else {}
        self._seen: set[_Str] = set()
        if not self.ok and not node.reported:
            errors.append(node.error(
                f"{what or 'document'}: expected a mapping, got {describe_type(node.value)}"))

    def path(self, key: _Str) -> _Str:
        return f"{self.what}.{key}" if self.what else key

    def _line(self, key: _Str) -> _Int:
        item = self._map.get(key)
        return self.located.key_lines.get(key) or (item.line if item else self.located.line)

    def fail(self, key: _Str, message: _Str) -> None:
        """Record ``message`` about ``key`` (at the key's line), for checks beyond the getters."""
        self.errors.append(self.located.error(f"{self.path(key)}: {message}", line=self._line(key)))

    def caller_field(self, key: _Str) -> CallerField:
        """Where ``key``, a field about the verified caller, is (see :class:`CallerField`)."""
        return CallerField(self.located.file, self._line(key), self.path(key))

    def _get(self, key: _Str, required: _Bool) -> Located | None:
        self._seen.add(key)
        item = self._map.get(key)
        if item is not None and item.value is not None:
            return item
        if required and self.ok and not (item is not None and item.reported):
            where = f" in {self.what}" if self.what else ""
            self.errors.append(self.located.error(f'missing required field "{key}"{where}',
                                               line=self._line(key)))
        return None

    def _typed(self, key: _Str, required: _Bool, check: Callable[[object], _Bool],
               expected: _Str) -> Located | None:
        item = self._get(key, required)
        if item is not None and not check(item.value):
            self.fail(key, f"expected {expected}, got {describe_type(item.value)}")
            return None
        return item

    def _bounds(self, key: _Str, value: float, minimum: float | None,
                maximum: float | None) -> _Bool:
        if minimum is not None and value < minimum:
            self.fail(key, f"must be at least {minimum} (got {value})")
            return False
        if maximum is not None and value > maximum:
            self.fail(key, f"must be at most {maximum} (got {value})")
            return False
        return True

    def str(self, key: _Str, *, required: _Bool = False, default: _Str | None = None,
            choices: Iterable[_Str] | None = None) -> _Str | None:
        item = self._typed(key, required, lambda v: isinstance(v, _Str), "a string")
        if item is None:
            return default
        if required and item.value == "":  # Kubernetes' "Required value": "" is no name either
            self.fail(key, "must not be empty")
            return default
        allowed = tuple(choices) if choices is not None else None
        if allowed is not None and item.value not in allowed:
            self.fail(key, f'must be one of {", ".join(allowed)} (got "{item.value}")')
            return default
        return _Str(item.value)

    def number(self, key: _Str, *, required: _Bool = False, default: float | None = None,
               minimum: float | None = None, maximum: float | None = None) -> float | None:
        item = self._typed(key, required, _is_number, "a number")
        if item is None:
            return default
        value = _as_float(item.value)
        if not math.isfinite(value):
            self.fail(key, f"must be a finite number (got {item.value})")
            return default
        return value if self._bounds(key, value, minimum, maximum) else default

    def int(self, key: _Str, *, required: _Bool = False, default: _Int | None = None,
            minimum: _Int | None = None, maximum: _Int | None = None) -> _Int | None:
        item = self._typed(key, required, _is_whole, "an integer")
        if item is None:
            return default
        value = _Int(item.value)  # a whole float (1e6, 10.0) is the integer it equals
        # YAML integers are int64 in Kubernetes; beyond, the arithmetic done with them per call
        # (floats) overflows
        minimum = _INT64_MIN if minimum is None else max(minimum, _INT64_MIN)
        maximum = _INT64_MAX if maximum is None else min(maximum, _INT64_MAX)
        return value if self._bounds(key, value, minimum, maximum) else default

    def bool(self, key: _Str, *, default: _Bool = False) -> _Bool:
        item = self._typed(key, False, lambda v: isinstance(v, _Bool), "true or false")
        return default if item is None else _Bool(item.value)

    def duration(self, key: _Str, *, required: _Bool = False,
                 default: float | None = None) -> float | None:
        """Seconds, from a number of seconds or a duration string (``500ms``, ``2s``, ``1m``)."""
        item = self._typed(key, required, lambda v: isinstance(v, _Str) or _is_number(v),
                           'a duration ("500ms", "2s", "1m") or a number of seconds')
        if item is None:
            return default
        value = _as_float(item.value) if _is_number(item.value) else _parse_duration(item.value)
        if value is None:
            self.fail(key, f'invalid duration "{item.value}" (use e.g. "500ms", "2s", "1m")')
            return default
        if not math.isfinite(value) or value < 0:
            self.fail(key, f"must be a non-negative duration (got {item.value})")
            return default
        return float(value)

    def str_list(self, key: _Str, *, required: _Bool = False,
                 default: tuple[_Str, ...] = ()) -> tuple[_Str, ...]:
        item = self._typed(key, required, lambda v: isinstance(v, list), "a list of strings")
        if item is None:
            return default
        out: list[_Str] = []
        for index, entry in enumerate(item.value):
            if isinstance(entry.value, _Str):
                out.append(entry.value)
            elif not entry.reported:
                self.errors.append(entry.error(
                    f"{self.path(key)}[{index}]: expected a string, "
                    f"got {describe_type(entry.value)}"))
        return tuple(out)

    def node(self, key: _Str, *, required: _Bool = False) -> Located | None:
        """The raw node (not null), for nested mappings and lists."""
        return self._get(key, required)

    def finish(self) -> None:
        """Report every key that no getter read as an unknown field."""
        for key in self._map:
            if key not in self._seen:
                self._seen.add(key)
                where = self.what or "the document"
                self.errors.append(self.located.error(f'unknown field "{key}" in {where}',
                                                   line=self._line(key)))


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond every float
        return math.inf if value > 0 else -math.inf


def _is_number(value: object) -> bool:
    return isinstance(value, (_Int, float)) and not isinstance(value, _Bool)


def _is_whole(value: object) -> bool:
    """An integer, or a float that equals one: Kubernetes' YAML goes through JSON, where
    ``1e6`` and ``10.0`` are the integers they equal (kubectl takes ``replicas: 1e3``)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _Int) and not isinstance(value, _Bool)
