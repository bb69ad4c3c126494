"""The few ``metadata`` fields opgate reads from a Kubernetes protobuf body, without a schema.

client-go (1.35) sends built-in objects (ConfigMaps, Secrets, Pods…) as
``application/vnd.kubernetes.protobuf`` by default, so the quota's object name and the
``{instance}`` of a controlling ownerReference must be read from such bodies too, and the
audit's objectRef the apiserver completes from the object (its uid and resourceVersion). The
body is ``k8s\\x00`` and a ``runtime.Unknown`` (``raw`` = 2) whose ``raw`` is the object; every
top-level object has its ``ObjectMeta`` at field 1 (``name`` 1, ``generateName`` 2, ``uid`` 5,
``resourceVersion`` 6, ``ownerReferences`` 13: ``kind`` 1, ``name`` 3, ``controller`` 6), as in
k8s.io/apimachinery's ``generated.proto``. Only those messages are walked, each field skipped by
its length; anything malformed gives ``None`` (the caller goes on as for a body it cannot read).
:func:`object_names` and :func:`object_ref_fields` read the same fields from a JSON body as
well, for the quota and the audit log alike, at any depth the apiserver decodes
(:mod:`proxy.engine.jsonbody`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from proxy.engine.context import media_type
from proxy.engine.jsonbody import loads

MAGIC = b"k8s\x00"
PROTOBUF = "application/vnd.kubernetes.protobuf"


@dataclass(frozen=True, slots=True)
class ProtoMeta:
    name: str
    generate_name: str
    controller: tuple[str, str] | None  # (kind, name) of the ownerReference with controller
    uid: str = ""
    resource_version: str = ""


class _Malformed(ValueError):
    pass


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Malformed
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """``(field number, value)``: an int for a varint, a view for a length-delimited field
    (no copy: an object's data may be large)."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise _Malformed
            yield number, buf[pos:pos + size]
            pos += size
        elif wire == 1 or wire == 5:  # fixed64, fixed32: nothing of ours
            pos += 8 if wire == 1 else 4
        else:  # groups (3, 4) are not used by Kubernetes
            raise _Malformed
    if pos != end:
        raise _Malformed


def _field(buf: memoryview, number: int) -> memoryview | None:
    found = None
    for n, value in _fields(buf):
        if n == number and isinstance(value, memoryview):
            found = value  # protobuf: the last one wins
    return found


def _text(value: memoryview) -> str:
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError as exc:
        raise _Malformed from exc


def _owner(buf: memoryview) -> tuple[str, str, bool]:
    kind = name = ""
    controller = False
    for n, value in _fields(buf):
        if n == 1 and isinstance(value, memoryview):
            kind = _text(value)
        elif n == 3 and isinstance(value, memoryview):
            name = _text(value)
        elif n == 6 and isinstance(value, int):
            controller = value != 0
    return kind, name, controller


def is_protobuf(content_type: str | None) -> bool:
    return media_type(content_type) == PROTOBUF


def read_meta(body: bytes) -> ProtoMeta | None:
    """The object's name, generateName and controlling owner; ``None`` if not readable."""
    if not body.startswith(MAGIC):
        return None
    try:
        raw = _field(memoryview(body)[len(MAGIC):], 2)
        meta = _field(raw, 1) if raw is not None else None
        if meta is None:
            return None
        name = generate_name = uid = version = ""
        controller: tuple[str, str] | None = None
        for n, value in _fields(meta):
            if not isinstance(value, memoryview):
                continue
            if n == 1:
                name = _text(value)
            elif n == 2:
                generate_name = _text(value)
            elif n == 5:
                uid = _text(value)
            elif n == 6:
                version = _text(value)
            elif n == 13 and controller is None:
                kind, owner, is_controller = _owner(value)
                if is_controller:
                    controller = (kind, owner)
        return ProtoMeta(name, generate_name, controller, uid, version)
    except _Malformed:
        return None


def _json_metadata(body: bytes) -> dict[str, object]:
    """``metadata`` of a JSON object body (``{}`` when there is none or it cannot be read)."""
    try:
        found = loads(body).get("metadata")
    except (ValueError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def _text_of(meta: dict[str, object], key: str) -> str:
    value = meta.get(key)
    return value if isinstance(value, str) else ""


def object_ref_fields(body: bytes) -> tuple[str, str, str]:
    """``(name, uid, resourceVersion)`` of an object body, protobuf or JSON (each ``""`` when
    absent or unreadable): what the apiserver's audit completes an objectRef with from the
    object it decoded."""
    if body.startswith(MAGIC):
        meta = read_meta(body)
        return (meta.name, meta.uid, meta.resource_version) if meta is not None else ("", "", "")
    found = _json_metadata(body)
    return _text_of(found, "name"), _text_of(found, "uid"), _text_of(found, "resourceVersion")


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
               float: "number", type(None): "null"}


def _json_type(value: object) -> str:
    return f"a JSON {_JSON_TYPES.get(type(value), 'value')}"


def undecodable(body: bytes | None, *, protobuf: bool) -> str | None:
    """Why the apiserver could not decode this create body as an object (its 400 BadRequest,
    answered before any admission), as far as the fields opgate reads tell; ``None`` when it
    can. A JSON body must be an object whose ``apiVersion``, ``kind``, ``metadata`` (an
    object), ``metadata.name`` and ``generateName`` have their types (or are null); a protobuf
    body must have the ``k8s\\x00`` prefix and a readable envelope and ``ObjectMeta``."""
    if protobuf:
        if not body:
            return "empty data"
        if not body.startswith(MAGIC):
            return ("provided data does not appear to be a protobuf message, expected prefix "
                    f"[{' '.join(str(b) for b in MAGIC)}]")
        try:  # each walk reads every field's length: a field past the end is malformed
            raw = _field(memoryview(body)[len(MAGIC):], 2)
            meta = _field(raw, 1) if raw is not None else None
            for _ in _fields(meta) if meta is not None else ():
                pass
        except _Malformed:
            return "the protobuf message is malformed"
        return None
    try:
        obj = loads(body or b"")
    except ValueError as e:
        return f"couldn't get version/kind; json parse error: {e}"
    if not isinstance(obj, dict):
        return f"couldn't get version/kind; json parse error: {_json_type(obj)}, not an object"
    for key in ("apiVersion", "kind"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            return f"couldn't get version/kind; {key}: {_json_type(obj[key])}, not a string"
    meta = obj.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        return f"metadata: {_json_type(meta)}, not an object"
    for key in ("name", "generateName"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"metadata.{key}: {_json_type(meta[key])}, not a string"
    return None


def object_names(body: bytes) -> tuple[str, str]:
    """``(name, generateName)`` of an object body, protobuf or JSON; ``("", "")`` for a body in
    another encoding (CBOR) or one that cannot be read, nested deeper than the apiserver reads
    included (the quota's denial then names no object, the audit's objectRef keeps none)."""
    if body.startswith(MAGIC):
        meta = read_meta(body)
        return (meta.name, meta.generate_name) if meta is not None else ("", "")
    found = _json_metadata(body)
    return _text_of(found, "name"), _text_of(found, "generateName")
