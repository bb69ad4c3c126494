"""The section parsers' toolkit (proxy.engine.schema): PolicyError's one line, describe_type,
the Fields getters and their file:line errors, sequence."""

from __future__ import annotations

import datetime

import pytest

from proxy.engine.schema import Fields, PolicyError, describe_type, sequence
from tests.unit.test_yamlload import one


def test_policy_error_formats() -> None:
    assert str(PolicyError("a.yaml", 3, "bad")) == "a.yaml:3: bad"
    assert str(PolicyError("a.yaml", 0, "cannot read")) == "a.yaml: cannot read"
    err = PolicyError("a.yaml", 3, "bad")
    assert (err.file, err.line, err.message) == ("a.yaml", 3, "bad")


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


@pytest.mark.parametrize(("scalar", "number"), [
    ("1e6", 1_000_000), ("1E3", 1000), ("10.0", 10), ("-2.0", -2), ("2.5e1", 25),
])
def test_a_whole_number_written_as_a_float_is_an_integer(scalar: str, number: int) -> None:
    """Kubernetes' YAML goes through JSON, where 1e6 and 10.0 are the integer they equal
    (``replicas: 1e3`` is 1000 to kubectl): ``burst: 1e6``, as the README writes the bound,
    was "expected an integer, got a number"."""
    f, errors = fields(f"a: {scalar}\n")
    value = f.int("a")
    assert (value, type(value), errors) == (number, int, [])


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
