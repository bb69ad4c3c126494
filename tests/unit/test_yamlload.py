"""YAML with positions (proxy.engine.yamlload): lines, scalar resolution, syntax and reader
errors, nesting and alias bounds."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from proxy.engine.schema import Located, PolicyError
from proxy.engine.yamlload import load_yaml_documents, parse_yaml_documents


def parse(text: str, file: str = "p.yaml") -> tuple[list[Located], list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file=file, errors=errors)
    return docs, [str(e) for e in errors]


def one(text: str) -> Located:
    docs, errors = parse(text)
    assert errors == []
    assert len(docs) == 1
    return docs[0]


def test_lines_of_values_and_keys() -> None:
    doc = one("a: 1\nb:\n  c: x\n  d:\n    - 1\n    - [2, 3]\n")
    assert doc.line == 1
    assert doc.value["a"] == Located(1, "p.yaml", 1)
    b = doc.value["b"]
    assert b.line == 3  # a block mapping starts at its first key
    assert doc.key_lines == {"a": 1, "b": 2}
    assert b.key_lines == {"c": 3, "d": 4}
    items = b.value["d"].value
    assert [i.line for i in items] == [5, 6]
    assert items[1].value[1].value == 3
    assert b.where() == "p.yaml:3"
    assert doc.plain() == {"a": 1, "b": {"c": "x", "d": [1, [2, 3]]}}


@pytest.mark.parametrize("scalar", [
    "1", "-7", "0x10", "1.5", "1.0e+3", ".inf", "true", "false", "yes", "off", "null", "~", "",
    "'1'", '"true"', "hello", "2026-01-01", "2026-01-01T10:00:00Z", "1_000", "0o17", "017",
])
def test_scalars_resolve_like_safe_load(scalar: str) -> None:
    expected = yaml.safe_load(f"k: {scalar}\n")["k"]
    assert one(f"k: {scalar}\n").value["k"].value == expected


@pytest.mark.parametrize(("scalar", "number"), [
    ("1e3", 1000.0), ("5E-1", 0.5), ("-2.5e2", -250.0), ("+.5e1", 5.0), ("1e-12", 1e-12),
])
def test_exponents_are_numbers_as_kubernetes_reads_them(scalar: str, number: float) -> None:
    # YAML 1.1 (PyYAML) wants a dot and a signed exponent: `qps: 1e3` was the string "1e3"
    assert one(f"k: {scalar}\n").value["k"].value == number
    assert yaml.safe_load(f"k: {scalar}\n")["k"] == scalar  # (yaml's own loader: unchanged)
    for text in ("e3", "1e", "1.2.3e4", "0x1e3", "'1e3'"):
        assert one(f"k: {text}\n").value["k"].value == yaml.safe_load(f"k: {text}\n")["k"]


def test_dates_stay_what_safe_load_makes() -> None:
    assert one("k: 2026-01-01\n").value["k"].value == datetime.date(2026, 1, 1)


def test_keys_stay_the_written_text() -> None:
    doc = one("on: 1\n1: 2\nnull: 3\n")
    assert list(doc.value) == ["on", "1", "null"]


def test_documents_and_empty_documents() -> None:
    docs, errors = parse("---\n---\na: 1\n---\n# only a comment\n")
    assert errors == []
    assert [d.value for d in docs[:2]] == [None, {"a": Located(1, "p.yaml", 3)}]
    assert parse("")[0] == []
    assert parse("# nothing\n")[0] == []


def test_duplicate_keys_are_errors() -> None:
    docs, errors = parse("a: 1\nb:\n  c: 1\n  c: 2\na: 3\n")
    assert errors == [
        'p.yaml:4: duplicate key "c" (first at line 3)',
        'p.yaml:5: duplicate key "a" (first at line 1)',
    ]
    assert docs[0].value["a"].value == 1  # the first one is kept


@pytest.mark.parametrize(("text", "expected"), [
    ("a: 1\nb: [1, 2\n", "p.yaml:3: invalid YAML: did not find expected ',' or ']'"),
    ("a: 1\nb: c: d\n", "p.yaml:2: invalid YAML: mapping values are not allowed in this context"),
    ("a:\n  - 1\n b: 2\n", "p.yaml:3: invalid YAML: did not find expected key"),
    ("a: !custom x\n", "p.yaml:1: unsupported YAML tag !custom"),
    ("a: !!set {x}\n", "p.yaml:1: unsupported YAML tag tag:yaml.org,2002:set"),
    ("? [a]\n: 1\n", "p.yaml:1: a mapping key must be a plain string"),
    ("a: &x [*x]\n", "p.yaml:1: recursive YAML alias"),
    ("a: 2026-13-45\n", "p.yaml:1: invalid value '2026-13-45': month must be in 1..12"),
])
def test_yaml_errors_have_lines(text: str, expected: str) -> None:
    assert parse(text)[1] == [expected]


def test_syntax_error_keeps_earlier_documents() -> None:
    docs, errors = parse("a: 1\n---\nb: [\n")
    assert [d.plain() for d in docs] == [{"a": 1}]
    assert errors == ["p.yaml:4: invalid YAML: did not find expected node content"]


@pytest.mark.parametrize(("data", "expected"), [
    ("a: \x01\n",
     "p.yaml:1: invalid YAML: unacceptable character #x0001: control characters are not allowed"),
    # a byte that is not UTF-8, after non-ASCII text: the line counts UTF-8 bytes right
    (b"a: \xc3\xa9\xc3\xa9\nb: 1\nc: \xff\n",
     "p.yaml:3: invalid YAML: unacceptable character #x00ff: invalid leading UTF-8 octet"),
])
def test_reader_errors_have_a_line_and_one_line(data: str | bytes, expected: str) -> None:
    assert parse(data)[1] == [expected]  # type: ignore[arg-type]


@pytest.mark.parametrize("opening", ["[", "{a: ", "- "])
@pytest.mark.parametrize("depth", [65, 5_000])
def test_deep_nesting_is_an_error_not_a_recursion_error(opening: str, depth: int) -> None:
    # the conversion recursed in Python: a few hundred levels raised RecursionError (the
    # crash of libyaml's own recursion is in test_check, in a process of its own)
    closing = {"[": "]", "{a: ": "}", "- ": ""}[opening]
    text = "x: 1\ny:\n  " + opening * depth + "1" + closing * depth + "\n"
    docs, errors = parse(text)
    assert docs == []
    assert errors == ["p.yaml:3: invalid YAML: nested more than 64 levels deep"]


def test_nesting_up_to_the_limit_is_fine() -> None:
    assert one("[" * 64 + "]" * 64).value is not None


def test_alias_bombs_are_refused_without_expanding() -> None:
    # "billion laughs": 9 levels of 9 aliases make 9**9 values from 90 written
    levels = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    for i in range(1, 9):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    docs, errors = parse("\n".join(levels) + "\n")
    returned = len(docs)  # not `docs` itself in the assert: its repr would expand the bomb
    assert returned == 0
    assert len(errors) == 1
    assert errors[0].startswith("p.yaml:4: YAML aliases expand to too many values (")


def test_a_long_list_used_through_many_aliases_is_refused() -> None:
    # linear, not exponential, but a 50 KB file made the parsers walk (and report on) 4 million
    # list items; each rule below sees the 2,000 items once more
    text = "a: &v [" + ", ".join(["1"] * 2_000) + "]\nb:\n" + "  - *v\n" * 20
    docs, errors = parse(text)
    returned = len(docs)
    assert returned == 0 and len(errors) == 1 and "YAML aliases expand" in errors[0]
    # the same aliases over a short list are ordinary reuse, and so is a merged default
    assert parse("a: &v [1, 2, 3]\nb:\n" + "  - *v\n" * 2_000)[1] == []
    defaults = "d: &d {qps: 1, burst: 2, match: {verbs: [get, list, watch, create, update]}}\n"
    rules = "".join(f"  - {{<<: *d, name: r{i}}}\n" for i in range(3_000))
    assert parse(defaults + "rules:\n" + rules)[1] == []


def test_aliases_and_merge_keys() -> None:
    doc = one(
        "base: &b {verbs: [get], qps: 1}\n"
        "use:\n"
        "  <<: *b\n"
        "  qps: 5\n"
        "many:\n"
        "  <<: [{x: 1}, {x: 2, y: 2}]\n"
    )
    use = doc.value["use"]
    assert use.plain() == {"qps": 5, "verbs": ["get"]}
    assert use.key_lines["qps"] == 4 and use.key_lines["verbs"] == 1
    assert doc.value["many"].plain() == {"x": 1, "y": 2}
    assert parse("a:\n  <<: 1\n")[1] == ["p.yaml:2: a << merge must name a mapping"]


def test_load_yaml_documents(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\n---\nb: 2\n")
    assert [d.plain() for d in load_yaml_documents(path)] == [{"a": 1}, {"b": 2}]
    assert load_yaml_documents(path)[1].file == str(path)
    path.write_text("a: 1\na: 2\n---\nb: [\n")
    with pytest.raises(PolicyError) as info:
        load_yaml_documents(path)
    assert str(info.value) == f'{path}:2: duplicate key "a" (first at line 1)'
    errors: list[PolicyError] = []
    load_yaml_documents(path, errors=errors)
    assert len(errors) == 2
    with pytest.raises(PolicyError, match="no such file or directory"):
        load_yaml_documents(tmp_path / "missing.yaml")
