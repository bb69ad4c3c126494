"""proxy.engine.jsonbody: JSON as deep as the apiserver decodes it, read and written without
recursion, the same values and text as the json module's."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from proxy.engine.jsonbody import MAX_DEPTH, Encoder, dumps, loads


def nested(depth: int, leaf: str = "1", *, key: str = "a") -> str:
    """``depth`` levels of objects (``{"a":…}``) around ``leaf``."""
    return f'{{"{key}":' * depth + leaf + "}" * depth


def mixed(depth: int, *, written: bool = False) -> str:
    """Objects and arrays by turns, with siblings, strings and numbers at every level; with
    ``written``, as ``json.dumps(…, separators=(",", ":"))`` writes what it reads."""
    text = '"l\\u00e9af \\ud83d\\ude00"'
    number, comma, colon = ("-1500.0", ",", ":") if written else ("-1.5e3", ", ", ": ")
    for level in range(depth):
        text = (f"[{level}{comma}{number}{comma}true{comma}null{comma}{text}{comma}{{}}]"
                if level % 2 else
                f'{{"k{level}"{colon}{text}{comma}"n"{colon}"x\\n"{comma}"e"{colon}[]'
                f'{comma}"f"{colon}false}}')
    return text


def innermost(doc: Any, levels: int, key: str = "a") -> Any:
    for _ in range(levels):
        doc = doc[key]
    return doc


def depth_of(value: Any) -> int:
    """Levels of nesting, walked with a stack (the values are too deep to recurse into)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            todo.extend((x, level + 1) for x in (item.values() if isinstance(item, dict) else item))
    return deepest


@pytest.mark.parametrize("depth", [2000, MAX_DEPTH])
def test_a_document_the_apiserver_decodes_is_read_whole(depth: int) -> None:
    text = nested(depth - 2, '{"last": [1, 2.5, "s"]}')
    doc = loads(text.encode())  # (json.loads: RecursionError on CPython 3.11)
    assert depth_of(doc) == depth
    assert innermost(doc, depth - 2) == {"last": [1, 2.5, "s"]}


def test_deeper_than_the_apiserver_decodes_is_a_value_error_as_it_says() -> None:
    for text in (nested(MAX_DEPTH + 1), nested(MAX_DEPTH, "{}"), "[" * (MAX_DEPTH + 1)):
        with pytest.raises(ValueError, match="exceeded max depth"):
            loads(text)


@pytest.mark.parametrize("text", [
    nested(1500, "1") + "x", nested(1500, "1")[:-1], nested(1500, "tru"),
    nested(1500, '{"a" 1}'), nested(1500, '{"a":1,}'), nested(1500, "[1,]"),
    nested(1500, "[1 2]"), nested(1500, "{1:2}"), nested(1500, '"\\x"'),
])
def test_a_deep_document_that_is_not_json_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        loads(text)


def test_shallow_and_deep_documents_read_as_the_json_module_reads_them() -> None:
    for text in (mixed(40), '{"a": 1, "a": 2}', " [ ] ", '"s"', "-0.0", "1e400",
                 '{"k": [{"x": {}}, []], "u": "\\u2028"}'):
        assert loads(text) == json.loads(text)  # shallow: json.loads itself
    deep = loads(mixed(3001))  # each level compared with the shallow one json reads
    shallow = json.loads(mixed(41))
    for _ in range(2960):
        deep = deep[4] if isinstance(deep, list) else deep[next(iter(deep))]
    assert deep == shallow
    utf16 = nested(1500, '{"a": 1, "a": 2}', key="k").encode("utf-16")
    assert innermost(loads(utf16), 1500, "k") == {"a": 2}


def test_writing_is_the_json_module_s_text_at_any_depth() -> None:
    for text in (mixed(40), '{"a": [1, {"b": null}], "c": "\\u00e9"}'):
        assert dumps(json.loads(text)) == json.dumps(json.loads(text), separators=(",", ":"))
    assert mixed(40, written=True) == json.dumps(json.loads(mixed(40)), separators=(",", ":"))
    assert dumps(loads(mixed(3001))) == mixed(3001, written=True)
    text = nested(MAX_DEPTH - 3, '{"é":[1.5,-2,true,false,null,{},[]]}')  # MAX_DEPTH deep
    assert Encoder(ensure_ascii=False, separators=(",", ":")).encode(loads(text)) == text
    assert dumps(loads(text)) == text.replace("é", "\\u00e9")
    assert loads(dumps(loads(text))) is not None


def test_writing_refuses_what_the_json_module_refuses() -> None:
    with pytest.raises(TypeError):
        dumps(loads(nested(1500, "1")) | {"b": object()})
    strict = Encoder(allow_nan=False)
    with pytest.raises(ValueError):
        strict.encode(loads(nested(1500, "NaN")))
    assert dumps(loads(nested(1500, "[NaN, Infinity, -Infinity]"))).count("Infinity") == 2


def test_a_thread_with_a_small_stack_reads_and_writes_the_apiserver_s_deepest() -> None:
    """No recursion: the deepest document is safe on a thread whose C stack could not hold a
    recursive walk of it (a raised recursion limit there would crash the process)."""
    text = nested(MAX_DEPTH)
    done: list[str] = []

    def work() -> None:
        done.append(dumps(loads(text)))

    old = threading.stack_size(256 * 1024)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        threading.stack_size(old)
    assert done == [text]
