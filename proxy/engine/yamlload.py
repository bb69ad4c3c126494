"""YAML with positions: a policy file's documents as :class:`~proxy.engine.schema.Located` values.

opgate's policy files are edited by people, so every error must say where it is: ``file:line:
message``. PyYAML's ``safe_load`` throws positions away, so this module composes the node graph
(the C parser when libyaml is there) and turns it into :class:`~proxy.engine.schema.Located`
values that keep the file and the 1-based line of every value and mapping key. Scalars resolve
exactly as ``safe_load`` would (ints, floats, bools, null, timestamps, strings); mapping keys
stay the text that was written (so ``on:`` is the key ``"on"``, not ``True``). Duplicate keys
are errors; ``<<`` merge keys work, with the explicit keys winning. Nesting deeper than
:data:`MAX_DEPTH` and aliases that expand a file far beyond what it writes are errors too (found
before anything is expanded). What a section parser then reads from them is
:mod:`proxy.engine.schema`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from proxy.engine.schema import Located, PolicyError

__all__ = ["ALIAS_ALLOWANCE", "ALIAS_RATIO", "MAX_DEPTH", "load_yaml_documents",
           "parse_yaml_documents", "read_error"]


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
        return Located(None, self.file, line, reported=True)

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
