"""The object's name of a YAML create body (``Content-Type: application/yaml``, which the
apiserver accepts as it accepts JSON), for the quota middleware.

Only ``metadata.name`` and ``metadata.generateName`` are wanted, so the body is read as a stream
of parser events (libyaml's when PyYAML has it), never built into objects: no constructor runs
(no tag makes Python objects, an alias is not followed), and reading stops at the end of the
top-level ``metadata`` mapping. A body that is not a YAML mapping, or whose name is not a string
(``name: 123``, an alias), leaves the name out, as a CBOR body does. :func:`yaml_names` is cheap
for a small body; :func:`read_names` reads one larger than ``INLINE_BYTES`` in a worker thread,
so a megabyte of ``data`` before ``metadata`` (as ``kubectl … -o yaml`` prints it) does not hold
up the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import yaml
from yaml.events import (
    AliasEvent,
    CollectionStartEvent,
    DocumentStartEvent,
    Event,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    StreamStartEvent,
)

__all__ = ["INLINE_BYTES", "YAML", "read_names", "yaml_names"]

YAML = "application/yaml"
INLINE_BYTES = 64 * 1024  # a body up to this size is read on the event loop (well under 10 ms)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR = "tag:yaml.org,2002:str"
_RESOLVER = yaml.resolver.Resolver()
_NONE = ("", "")


async def read_names(body: bytes) -> tuple[str, str]:
    """:func:`yaml_names`, in a worker thread for a body larger than ``INLINE_BYTES``."""
    if len(body) <= INLINE_BYTES:
        return yaml_names(body)
    return await asyncio.to_thread(yaml_names, body)


def yaml_names(body: bytes) -> tuple[str, str]:
    """``(name, generateName)`` of the first YAML document of ``body`` (``("", "")`` when it
    says none, or cannot be read)."""
    events = yaml.parse(body, Loader=_Loader)
    try:
        return _top(events)
    except (yaml.YAMLError, ValueError, StopIteration):  # not YAML, not UTF-8/16
        return _NONE
    finally:
        events.close()  # stop the parser: the rest of the body is never read


def _top(events: Iterator[Event]) -> tuple[str, str]:
    for kind in (StreamStartEvent, DocumentStartEvent, MappingStartEvent):
        if not isinstance(next(events, None), kind):
            return _NONE
    while not isinstance(key := next(events), MappingEndEvent):
        field = _text(key)
        _skip(key, events)  # a complex key (a mapping, a sequence): never "metadata"
        value = next(events)
        if field == "metadata" and isinstance(value, MappingStartEvent):
            return _metadata(events)
        _skip(value, events)
    return _NONE


def _metadata(events: Iterator[Event]) -> tuple[str, str]:
    found = {"name": "", "generateName": ""}
    while not isinstance(key := next(events), MappingEndEvent):
        field = _text(key)
        _skip(key, events)
        value = next(events)
        if field in found and isinstance(value, ScalarEvent):
            found[field] = _text(value)
        else:
            _skip(value, events)
    return found["name"], found["generateName"]


def _skip(start: Event, events: Iterator[Event]) -> None:
    """Read past the rest of a node that began with ``start`` (a mapping or a sequence)."""
    if not isinstance(start, CollectionStartEvent):
        return
    depth = 1
    while depth:
        event = next(events)
        if isinstance(event, CollectionStartEvent):
            depth += 1
        elif not isinstance(event, ScalarEvent | AliasEvent):
            depth -= 1  # a mapping's or a sequence's end


def _text(event: Event) -> str:
    """A scalar that YAML reads as a string (quoted, tagged ``!!str``, or plain and not a
    number, a bool or null); "" for anything else."""
    if not isinstance(event, ScalarEvent):
        return ""
    if event.tag not in (None, "!", _STR):
        return ""
    plain, _quoted = event.implicit
    if event.tag is None and plain and not event.style and _RESOLVER.resolve(
            yaml.ScalarNode, event.value, (True, False)) != _STR:
        return ""
    return event.value
