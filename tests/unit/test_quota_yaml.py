"""The name of a YAML create body (proxy.middlewares.quota_yaml): read as the apiserver would
read it, from parser events only, and a large body off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from proxy.middlewares import quota_yaml
from proxy.middlewares.quota_yaml import INLINE_BYTES, read_names, yaml_names


@pytest.mark.parametrize(("body", "names"), [
    (b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm-1\n", ("cm-1", "")),
    (b'metadata: {generateName: "g-", labels: {a: [1, 2]}}\n', ("", "g-")),
    (b"apiVersion: v1\ndata:\n  k: v\nkind: ConfigMap\nmetadata:\n  name: after-data\n",
     ("after-data", "")),
    (b"{? [a, b] : 1, data: {x: [1, {y: 2}]}, metadata: {name: ok}}", ("ok", "")),
    (b"metadata:\n  name: '123'\n", ("123", "")),
    (b"metadata:\n  name: !!str 123\n", ("123", "")),
    (b"metadata:\n  annotations: {name: no}\n  name: yes-it-is\n", ("yes-it-is", "")),
    (b"metadata:\n  name: a\n---\nmetadata: {name: b}\n", ("a", "")),  # the first document
])
def test_the_name_and_generate_name_are_read(body: bytes, names: tuple[str, str]) -> None:
    assert yaml_names(body) == names


@pytest.mark.parametrize("body", [
    b"metadata:\n  name: 123\n",  # a number: the apiserver refuses it, no name to hold room for
    b"metadata:\n  name: true\n",
    b"metadata:\n  name: null\n",
    b"a: &x b\nmetadata:\n  name: *x\n",  # aliases are not followed
    b"metadata:\n  name: !!python/object/apply:os.system [echo]\n",  # no constructor runs
    b"!!python/object/apply:os.system [echo]\n",
    b"- a\n- b\n", b"just text", b"", b"metadata: [1", b"\xff\xfe\x00", b"name: x\n",
])
def test_anything_else_leaves_the_name_out(body: bytes) -> None:
    assert yaml_names(body) == ("", "")


def test_a_large_body_is_read_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kubectl … -o yaml`` prints ``data`` before ``metadata``: a body of megabytes is read to
    its end, which is not done on the event loop."""
    threads: list[str] = []
    read = quota_yaml.yaml_names

    def recorded(body: bytes) -> tuple[str, str]:
        threads.append(threading.current_thread().name)
        return read(body)

    monkeypatch.setattr(quota_yaml, "yaml_names", recorded)
    data = "".join(f"  k{i}: {'x' * 80}\n" for i in range(INLINE_BYTES // 40))
    large = f"apiVersion: v1\ndata:\n{data}kind: ConfigMap\nmetadata:\n  name: big\n".encode()
    small = b"metadata:\n  name: small\n"
    assert asyncio.run(read_names(large)) == ("big", "")
    assert asyncio.run(read_names(small)) == ("small", "")
    assert threads[0] != threading.main_thread().name
    assert threads[1] == threading.main_thread().name
