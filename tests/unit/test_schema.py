"""YAML with positions (proxy.engine.schema): lines, scalar resolution, errors, Fields getters."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from proxy.engine.schema import (
    Fields,
    Located,
    PolicyError,
    describe_type,
    load_yaml_documents,
    parse_yaml_documents,
    sequence,
)


def parse(text: str, file: str = "p.yaml") -> tuple[list[Located], list[str]]:
    errors: list[PolicyError] = []
    docs = parse_yaml_documents(text, file=file, errors=errors)
    return docs, [str(e) for e in errors]


def one(text: str) -> Located:
    docs, errors = parse(text)
    assert errors == []
    assert len(docs) == 1
    return docs[0]


def test_policy_error_formats() -> None:
    assert str(PolicyError("a.yaml", 3, "bad")) == "a.yaml:3: bad"
    assert str(PolicyError("a.yaml", 0, "cannot read")) == "a.yaml: cannot read"
    err = PolicyError("a.yaml", 3, "bad")
    assert (err.file, err.line, err.message) == ("a.yaml", 3, "bad")


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


@pytest.mark.parametrize(("value", "name"), [
    (None, "null"), (True, "a boolean"), (1, "an integer"), (1.5, "a number"), ("s", "a string"),
    ({}, "a mapping"), ([], "a list"), (datetime.date(2026, 1, 1), "a date"),
])
def test_describe_type(value: object, name: str) -> None:
    assert describe_type(value) == name


# --- Fields -----------------------------------------------------------------------------------

DOC = """\
name: web
count: 3
ratio: 0.5
flag: true
wait: 500ms
verbs: [get, list]
nested:
  x: 1
empty:
"""


def fields(text: str = DOC, what: str = "spec.x") -> tuple[Fields, list[PolicyError]]:
    errors: list[PolicyError] = []
    return Fields(one(text), what=what, errors=errors), errors


def test_fields_reads_every_type() -> None:
    f, errors = fields()
    assert f.str("name") == "web"
    assert f.int("count", minimum=1) == 3
    assert f.number("ratio", maximum=1) == 0.5
    assert f.number("count") == 3.0
    assert f.bool("flag") is True
    assert f.duration("wait") == 0.5
    assert f.str_list("verbs") == ("get", "list")
    nested = f.node("nested")
    assert nested is not None and nested.value["x"].value == 1
    assert f.node("empty") is None  # null counts as absent
    f.finish()
    assert errors == []


def test_fields_defaults_when_absent() -> None:
    f, errors = fields("{}\n")
    assert f.str("a", default="d") == "d"
    assert f.int("b", default=7) == 7
    assert f.number("c") is None
    assert f.bool("d") is False and f.bool("d", default=True) is True
    assert f.duration("e", default=2.0) == 2.0
    assert f.str_list("f") == ()
    assert f.node("g") is None
    f.finish()
    assert errors == []


@pytest.mark.parametrize(("text", "read", "expected"), [
    ("a: 1\n", lambda f: f.str("a"), "p.yaml:1: spec.x.a: expected a string, got an integer"),
    ("a: x\n", lambda f: f.str("a", choices=("y", "z")),
     'p.yaml:1: spec.x.a: must be one of y, z (got "x")'),
    ("a: '1'\n", lambda f: f.int("a"), "p.yaml:1: spec.x.a: expected an integer, got a string"),
    ("a: true\n", lambda f: f.int("a"), "p.yaml:1: spec.x.a: expected an integer, got a boolean"),
    ("a: 1.5\n", lambda f: f.int("a"), "p.yaml:1: spec.x.a: expected an integer, got a number"),
    ("a: 0\n", lambda f: f.int("a", minimum=1), "p.yaml:1: spec.x.a: must be at least 1 (got 0)"),
    ("a: 2\n", lambda f: f.number("a", maximum=1),
     "p.yaml:1: spec.x.a: must be at most 1 (got 2.0)"),
    ("a: .nan\n", lambda f: f.number("a"), "p.yaml:1: spec.x.a: must be a finite number (got nan)"),
    ("a: [1]\n", lambda f: f.number("a"), "p.yaml:1: spec.x.a: expected a number, got a list"),
    ("a: 'yes'\n", lambda f: f.bool("a"),
     "p.yaml:1: spec.x.a: expected true or false, got a string"),
    ("a: 2 s\n", lambda f: f.duration("a"),
     'p.yaml:1: spec.x.a: invalid duration "2 s" (use e.g. "500ms", "2s", "1m")'),
    ("a: -1\n", lambda f: f.duration("a"),
     "p.yaml:1: spec.x.a: must be a non-negative duration (got -1)"),
    ("a: {}\n", lambda f: f.duration("a"), 'p.yaml:1: spec.x.a: expected a duration ("500ms", '
     '"2s", "1m") or a number of seconds, got a mapping'),
    ("a: x\n", lambda f: f.str_list("a"),
     "p.yaml:1: spec.x.a: expected a list of strings, got a string"),
    ("a:\n  - x\n  - 2\n", lambda f: f.str_list("a"),
     "p.yaml:3: spec.x.a[1]: expected a string, got an integer"),
    ("b: 1\n", lambda f: f.str("a", required=True),
     'p.yaml:1: missing required field "a" in spec.x'),
    ("b: 1\na:\n", lambda f: f.str("a", required=True),
     'p.yaml:2: missing required field "a" in spec.x'),
    ("b: 1\n", lambda f: f.node("a", required=True),
     'p.yaml:1: missing required field "a" in spec.x'),
    ("a:\n  b: 1\n", lambda f: f.int("a"),
     "p.yaml:1: spec.x.a: expected an integer, got a mapping"),
    # integers beyond every float raised OverflowError out of the section parser (its other
    # errors lost); beyond int64 they were accepted, and overflowed per call (burst * interval)
    (f"a: {10**400}\n", lambda f: f.number("a"),
     f"p.yaml:1: spec.x.a: must be a finite number (got {10**400})"),
    (f"a: -{10**400}\n", lambda f: f.duration("a"),
     f"p.yaml:1: spec.x.a: must be a non-negative duration (got -{10**400})"),
    (f"a: {10**400}\n", lambda f: f.duration("a"),
     f"p.yaml:1: spec.x.a: must be a non-negative duration (got {10**400})"),
    (f"a: {2**63}\n", lambda f: f.int("a", minimum=1),
     f"p.yaml:1: spec.x.a: must be at most {2**63 - 1} (got {2**63})"),
    (f"a: {-2**63 - 1}\n", lambda f: f.int("a"),
     f"p.yaml:1: spec.x.a: must be at least {-2**63} (got {-2**63 - 1})"),
])
def test_fields_errors(text: str, read: object, expected: str) -> None:
    f, errors = fields(text)
    read(f)  # type: ignore[operator]
    assert [str(e) for e in errors] == [expected]


def test_fields_bad_value_returns_default() -> None:
    f, _ = fields("a: x\nb: 'x'\n")
    assert f.str("a", choices=("y",), default="y") == "y"
    assert f.int("b", default=4) == 4


@pytest.mark.parametrize(("text", "seconds"), [
    ("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("1h", 3600.0), ("1m30s", 90.0), ("1.5s", 1.5),
    ("250us", 0.00025), ("0", 0.0), ("3", 3.0), ("2.5", 2.5), ("0s", 0.0),
])
def test_durations(text: str, seconds: float) -> None:
    f, errors = fields(f"a: {text}\n")
    assert f.duration("a") == pytest.approx(seconds)
    assert errors == []


@pytest.mark.parametrize("text", ["'2 s'", "s", "1d", "'-1s'", "''", "1s2"])
def test_bad_durations(text: str) -> None:
    f, errors = fields(f"a: {text}\n")
    assert f.duration("a", default=9.0) == 9.0
    assert len(errors) == 1


def test_finish_reports_unknown_keys_at_their_lines() -> None:
    f, errors = fields("name: x\ncolour: red\nnested:\n  deep: 1\n")
    f.str("name")
    f.finish()
    f.finish()  # reported once
    assert [str(e) for e in errors] == [
        'p.yaml:2: unknown field "colour" in spec.x',
        'p.yaml:3: unknown field "nested" in spec.x',
    ]


def test_top_level_fields_name_the_document() -> None:
    f, errors = fields("x: 1\n", what="")
    f.str("kind", required=True)
    f.finish()
    assert [str(e) for e in errors] == [
        'p.yaml:1: missing required field "kind"',
        'p.yaml:1: unknown field "x" in the document',
    ]
    assert f.path("kind") == "kind"


def test_fields_on_a_non_mapping() -> None:
    errors: list[PolicyError] = []
    f = Fields(one("a: [1]\n").value["a"], what="spec.identity", errors=errors)
    assert not f.ok
    assert f.str("x", required=True) is None  # no "missing" noise on top of the type error
    f.finish()
    assert [str(e) for e in errors] == ["p.yaml:1: spec.identity: expected a mapping, got a list"]


def test_fail_and_path() -> None:
    f, errors = fields("qps: 5\n")
    assert f.path("qps") == "spec.x.qps"
    f.fail("qps", "must be lower than burst")
    assert [str(e) for e in errors] == ["p.yaml:1: spec.x.qps: must be lower than burst"]


def test_sequence_helper() -> None:
    errors: list[PolicyError] = []
    doc = one("a: [1, 2]\nb:\nc: {x: 1}\n")
    assert [i.value for i in sequence(doc.value["a"], what="spec.a", errors=errors)] == [1, 2]
    assert sequence(doc.value["b"], what="spec.b", errors=errors) == []
    assert sequence(doc.value["c"], what="spec.c", errors=errors) == []
    assert [str(e) for e in errors] == ["p.yaml:3: spec.c: expected a list, got a mapping"]
