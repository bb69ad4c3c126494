"""Reading ``metadata`` from Kubernetes protobuf bodies (what client-go sends by default)."""

from __future__ import annotations

import pytest

from proxy.engine.protometa import (
    ProtoMeta,
    is_protobuf,
    object_names,
    object_ref_fields,
    read_meta,
)

# a ConfigMap as kube-apiserver v1.35.4 served it with Accept: application/vnd.kubernetes.protobuf
# (created with generateName "gen-", labels, an ownerReference that is not the controller, then
# the controlling one, managedFields and data); the same encoding client-go sends
CONFIGMAP_PB = bytes.fromhex(
    "6b3873000a0f0a0276311209436f6e6669674d617012b6040a98040a0967656e2d7870326a66120467656e2d"
    "1a0764656661756c7422002a2436306561613761312d653231302d346230302d623635382d66396338623735"
    "3733663430320331393738004208089efbb7d80610005a080a036170701201786a430a075365727669636512"
    "0e6e6f742d636f6e74726f6c6c6572222430303030303030302d303030302d303030302d303030302d3030"
    "303030303030303030322a0276316a4a0a065769646765741a027731222430303030303030302d30303030"
    "2d303030302d303030302d3030303030303030303030312a1264656d6f2e6f70676174652e6465762f7631"
    "300138018a01a6020a0d507974686f6e2d75726c6c696212065570646174651a0276312208089efbb7d806"
    "100032084669656c647356313af2010aef017b22663a64617461223a7b222e223a7b7d2c22663a6b223a7b"
    "7d7d2c22663a6d65746164617461223a7b22663a67656e65726174654e616d65223a7b7d2c22663a6c6162"
    "656c73223a7b222e223a7b7d2c22663a617070223a7b7d7d2c22663a6f776e65725265666572656e636573"
    "223a7b222e223a7b7d2c226b3a7b5c227569645c223a5c2230303030303030302d303030302d303030302d"
    "303030302d3030303030303030303030315c227d223a7b7d2c226b3a7b5c227569645c223a5c2230303030"
    "303030302d303030302d303030302d303030302d3030303030303030303030325c227d223a7b7d7d7d7d42"
    "0012190a016b1214c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a91a002200")

# hand-made: k8s\0, Unknown{raw=2: ConfigMap{metadata=1: ObjectMeta{name=1: "cm-1"}}}
NAMED_PB = b"k8s\x00" + bytes([0x12, 8, 0x0A, 6, 0x0A, 4]) + b"cm-1"


def test_a_body_the_apiserver_encoded() -> None:
    assert read_meta(CONFIGMAP_PB) == ProtoMeta(
        name="gen-xp2jf", generate_name="gen-", controller=("Widget", "w1"),
        uid="60eaa7a1-e210-4b00-b658-f9c8b7573f40", resource_version="197")


def test_a_name_only() -> None:
    assert read_meta(NAMED_PB) == ProtoMeta(name="cm-1", generate_name="", controller=None)


@pytest.mark.parametrize("body", [
    b"", b"k8s\x00", b'{"metadata": {"name": "x"}}', NAMED_PB[4:],
    NAMED_PB[:-1],  # a length past the end
    CONFIGMAP_PB[:200],
    b"k8s\x00" + bytes([0x12, 0x80]),  # an unfinished varint
    b"k8s\x00" + bytes([0x13]),  # a group (wire type 3)
    b"k8s\x00" + bytes([0x12, 4, 0x0A, 2, 0x0A, 0]) + b"\x00",  # a stray byte in raw
    b"k8s\x00" + bytes([0x12, 4, 0x0A, 2, 0x0A, 2]) + b"\xff\xfe",  # a name not UTF-8
    b"k8s\x00" + bytes([0x12, 0x0B]) + b"\x80" * 11,  # a varint past 64 bits
])
def test_anything_else_is_unreadable(body: bytes) -> None:
    assert read_meta(body) is None


def test_content_types() -> None:
    assert is_protobuf("application/vnd.kubernetes.protobuf")
    assert is_protobuf("Application/Vnd.Kubernetes.Protobuf; charset=binary")
    assert not is_protobuf("application/vnd.kubernetes.protobuf+x")
    assert not is_protobuf("application/json")
    assert not is_protobuf(None)


@pytest.mark.parametrize(("body", "names"), [
    (CONFIGMAP_PB, ("gen-xp2jf", "gen-")),
    (NAMED_PB, ("cm-1", "")),
    (b'{"metadata": {"name": "cm-2"}}', ("cm-2", "")),
    (b' {"metadata": {"generateName": "gen-"}}', ("", "gen-")),
    (b'{"metadata": {"name": 7, "generateName": ["x"]}}', ("", "")),
    (b'{"metadata": ["name"]}', ("", "")),
    (b'{"kind": "ConfigMap"}', ("", "")),
    (b'["metadata"]', ("", "")),
    (b"\xa1dnamex", ("", "")),  # CBOR
    (b"{not json", ("", "")),
    (b"\xff\xfe", ("", "")),  # not UTF-8
    (NAMED_PB[:-1], ("", "")),
])
def test_object_names_from_protobuf_or_json(body: bytes, names: tuple[str, str]) -> None:
    assert object_names(body) == names


@pytest.mark.parametrize(("body", "fields"), [
    (CONFIGMAP_PB, ("gen-xp2jf", "60eaa7a1-e210-4b00-b658-f9c8b7573f40", "197")),
    (NAMED_PB, ("cm-1", "", "")),
    (b'{"metadata": {"name": "cm-2", "uid": "u", "resourceVersion": "7"}}', ("cm-2", "u", "7")),
    (b'{"metadata": {"uid": 5, "resourceVersion": ["7"]}}', ("", "", "")),
    (b'{"kind": "DeleteOptions", "propagationPolicy": "Background"}', ("", "", "")),
    (b"{not json", ("", "", "")),
    (NAMED_PB[:-1], ("", "", "")),
])
def test_object_ref_fields_from_protobuf_or_json(body: bytes,
                                                 fields: tuple[str, str, str]) -> None:
    assert object_ref_fields(body) == fields


def deep(depth: int) -> bytes:
    """A JSON value ``depth`` levels deep, as a preserve-unknown-fields custom resource (or its
    ``managedFields``) may be: the apiserver decodes up to 10,000 levels."""
    return b'{"a":' * (depth - 1) + b"[]" + b"}" * (depth - 1)


@pytest.mark.parametrize(("body", "names"), [
    (b'{"metadata":{"name":"cr-1"},"spec":' + deep(1999) + b"}", ("cr-1", "")),
    (b'{"spec":' + deep(9999) + b',"metadata":{"generateName":"cr-"}}', ("", "cr-")),
    (b'{"metadata":{"name":"cr-2","managedFields":[{"fieldsV1":' + deep(2000) + b"}]}}",
     ("cr-2", "")),
    (b'{"metadata":{"name":"cr-3"},"spec":' + deep(10000) + b"}", ("", "")),  # 10,001 levels
    (b'{"metadata":{"name":"cr-4"},"spec":' + deep(2000), ("", "")),  # cut short
])
def test_object_names_of_a_json_body_as_deep_as_the_apiserver_reads(
        body: bytes, names: tuple[str, str]) -> None:
    """2,000 levels is beyond Python's json (RecursionError): the name is read all the same;
    past the apiserver's own limit the body is unreadable to opgate as it is to the apiserver."""
    assert object_names(body) == names
