"""YAML with positions, and the small toolkit every policy section is validated with.

opgate's policy files are edited by people, so every error must say where it is: ``file:line:
message``. PyYAML's ``safe_load`` throws positions away, so this module composes the node graph
(the C parser when libyaml is there) and turns it into :class:`Located` values that keep the file
and the 1-based line of every value and mapping key. Scalars resolve exactly as ``safe_load``
would (ints, floats, bools, null, timestamps, strings); mapping keys stay the text that was
written (so ``on:`` is the key ``"on"``, not ``True``). Duplicate keys are errors; ``<<`` merge
keys work, with the explicit keys winning. Nesting deeper than :data:`MAX_DEPTH` and aliases that
expand a file far beyond what it writes are errors too (found before anything is expanded).

:class:`Fields` reads one mapping the way a section parser wants to: typed getters that record
errors instead of raising, and :meth:`Fields.finish` that reports every key nobody asked for.
A middleware module owns its section of ``spec`` through a :data:`SectionParser` built on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import yaml


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader, with YAML 1.2's floats: ``1e-3`` and ``5e3`` are numbers, as
    Kubernetes' YAML reads them (YAML 1.1, PyYAML's, wants a dot and a signed exponent: it
    took ``qps: 1e3`` for a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))
_LOADER: Any = _Loader
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# Hostile or broken files must not take the process down. libyaml's composer recurses in C (a
# few thousand "[" overflow the stack: a crash, not an exception), this module in Python, so
# nesting is bounded before composing; a policy needs about ten levels.
MAX_DEPTH = 64
# Aliases share one converted value, but the parsers walk every use: a small file whose aliases
# nest ("billion laughs") would cost minutes and gigabytes of errors. Aliases may add this many
# values, or ALIAS_RATIO times what the file writes (a merged default reused by many rules).
ALIAS_ALLOWANCE = 10_000
ALIAS_RATIO = 10

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
    the line of each key, which is where errors about that key point.
    """

    value: Any
    file: str
    line: int
    key_lines: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)

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


class _Converter:
    """Turns one file's composed nodes into :class:`Located` values, collecting errors."""

    def __init__(self, file: str, errors: list[PolicyError]) -> None:
        self.file = file
        self.errors = errors
        self.constructor = yaml.constructor.SafeConstructor()
        self.done: dict[int, Located] = {}  # aliases share one converted value
        self.sizes: dict[int, int] = {}  # values under each converted node, aliases expanded
        self.active: set[int] = set()
        self.written = 0  # values as written in the file
        self.expanded = 0  # values the parsers will see (each alias counted in full)

    def error(self, node: yaml.Node, message: str) -> Located:
        line = node.start_mark.line + 1
        self.errors.append(PolicyError(self.file, line, message))
        return Located(None, self.file, line)

    def convert(self, node: yaml.Node) -> Located:
        key = id(node)
        if key in self.done:
            self.expanded += self.sizes[key]
            if self.expanded - self.written > max(ALIAS_ALLOWANCE, ALIAS_RATIO * self.written):
                raise _AliasBomb(node)
            return self.done[key]
        if key in self.active:
            return self.error(node, "recursive YAML alias")
        self.active.add(key)
        self.written += 1
        self.expanded += 1
        start = self.expanded
        try:
            if isinstance(node, yaml.MappingNode):
                result = self.mapping(node)
            elif isinstance(node, yaml.SequenceNode):
                result = self.sequence(node)
            else:
                result = self.scalar(node)
        finally:
            self.active.discard(key)
        self.done[key] = result
        self.sizes[key] = self.expanded - start + 1
        return result

    def scalar(self, node: yaml.Node) -> Located:
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:
            return self.error(node, f"unsupported YAML tag {node.tag}")
        except Exception as exc:  # e.g. a timestamp with a month 13
            return self.error(node, f"invalid value {node.value!r}: {exc}")
        return Located(value, self.file, node.start_mark.line + 1)

    def sequence(self, node: yaml.Node) -> Located:
        if node.tag != _SEQ_TAG:
            return self.error(node, f"unsupported YAML tag {node.tag}")
        return Located([self.convert(n) for n in node.value], self.file, node.start_mark.line + 1)

    def mapping(self, node: yaml.Node) -> Located:
        if node.tag != _MAP_TAG:
            return self.error(node, f"unsupported YAML tag {node.tag}")
        out: dict[str, Located] = {}
        lines: dict[str, int] = {}
        merges: list[yaml.Node] = []
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                merges.extend(value_node.value if isinstance(value_node, yaml.SequenceNode)
                              else [value_node])
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.error(key_node, "a mapping key must be a plain string")
                continue
            name = str(key_node.value)
            if name in out:
                self.error(key_node, f'duplicate key "{name}" (first at line {lines[name]})')
                continue
            out[name] = self.convert(value_node)
            lines[name] = line
        for merge_node in merges:  # explicit keys win, then earlier merges win (YAML merge spec)
            merged = self.convert(merge_node)
            if not isinstance(merged.value, dict):
                self.error(merge_node, "a << merge must name a mapping")
                continue
            for name, item in merged.value.items():
                if name not in out:
                    out[name] = item
                    lines[name] = merged.key_lines.get(name, item.line)
        return Located(out, self.file, node.start_mark.line + 1, lines)


class _AliasBomb(Exception):
    def __init__(self, node: yaml.Node) -> None:
        super().__init__()
        self.node = node


def _too_deep(data: bytes | str) -> int:
    """The line where the nesting first goes beyond :data:`MAX_DEPTH` (0: it does not), from the
    parser's events, which libyaml produces without recursing. A YAML error ends the scan: the
    composer then reports it."""
    depth = 0
    try:
        for event in yaml.parse(data, Loader=_LOADER):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return int(event.start_mark.line) + 1
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        pass
    return 0


def _reader_error_line(data: bytes | str, exc: yaml.reader.ReaderError) -> int:
    """The line of a reader error (libyaml gives a byte offset into the UTF-8 or UTF-16 data)."""
    raw = data.encode() if isinstance(data, str) else data
    encoding = "utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8"
    return raw[: exc.position].decode(encoding, "replace").count("\n") + 1


def parse_yaml_documents(
    data: bytes | str, *, file: str, errors: list[PolicyError]
) -> list[Located]:
    """Every document of ``data`` (``None`` value for an empty one); problems go to ``errors``.

    A syntax error ends the file: the documents before it are still returned. So does nesting
    deeper than :data:`MAX_DEPTH` or aliases that expand too far (then none are).
    """
    deep = _too_deep(data)
    if deep:
        errors.append(PolicyError(file, deep, f"invalid YAML: nested more than {MAX_DEPTH} "
                                              "levels deep"))
        return []
    converter = _Converter(file, errors)
    documents: list[Located] = []
    try:
        for node in yaml.compose_all(data, Loader=_LOADER):
            documents.append(converter.convert(node))
            converter.done.clear()  # ids are only unique while a document's nodes are alive
            converter.sizes.clear()
    except _AliasBomb as exc:
        errors.append(PolicyError(
            file, exc.node.start_mark.line + 1,
            f"YAML aliases expand to too many values ({converter.expanded} from "
            f"{converter.written} written; aliases may add {ALIAS_ALLOWANCE}, or {ALIAS_RATIO} "
            "times what the file writes)"))
        return []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 0
        problem = exc.problem or exc.context or "syntax error"
        errors.append(PolicyError(file, line, f"invalid YAML: {problem}"))
    except yaml.reader.ReaderError as exc:  # bad encoding, control characters
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        errors.append(PolicyError(file, _reader_error_line(data, exc),
                                  f"invalid YAML: unacceptable character #x{code:04x}: "
                                  f"{exc.reason}"))
    except yaml.YAMLError as exc:
        errors.append(PolicyError(file, 0, f"invalid YAML: {str(exc).splitlines()[0]}"))
    return documents


def load_yaml_documents(
    path: str | Path, *, errors: list[PolicyError] | None = None
) -> list[Located]:
    """Read and parse one file. Problems go to ``errors`` when given, else the first is raised."""
    sink: list[PolicyError] = [] if errors is None else errors
    file = str(path)
    try:
        documents = parse_yaml_documents(Path(path).read_bytes(), file=file, errors=sink)
    except OSError as exc:
        sink.append(PolicyError(file, 0, read_error(exc)))
        documents = []
    if errors is None and sink:
        raise sink[0]
    return documents


def read_error(exc: OSError) -> str:
    """How a file that cannot be read is reported."""
    if isinstance(exc, FileNotFoundError):
        return "no such file or directory"
    return f"cannot read: {exc.strerror or exc}"


def sequence(node: Located, *, what: str, errors: list[PolicyError]) -> list[Located]:
    """The items of a list node (``[]`` for null); anything else is an error."""
    if node.value is None:
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
        if not self.ok:
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

    def _get(self, key: _Str, required: _Bool) -> Located | None:
        self._seen.add(key)
        item = self._map.get(key)
        if item is not None and item.value is not None:
            return item
        if required and self.ok:
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
        check = lambda v: isinstance(v, _Int) and not isinstance(v, _Bool)  # noqa: E731
        item = self._typed(key, required, check, "an integer")
        if item is None:
            return default
        value = _Int(item.value)
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
            else:
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
