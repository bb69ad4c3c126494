"""What the README and the example policies claim, checked against the code.

The ``opgate serve`` flag table has a row for every flag, with the parser's defaults; every
policy the README shows and every file under ``policies/`` passes ``opgate check``; every policy
field the README's examples use appears in some file under ``policies/``, so a reader finds it
in a complete example; the metrics the README lists are the ones ``/metrics`` serves, with
their labels (what a dashboard or an alert is written against).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.app import section_parsers
from proxy.cli_parser import build_parser
from proxy.engine import telemetry
from proxy.engine.check import check
from proxy.middlewares.audit_event import _DECISIONS
from proxy.middlewares.ratelimit_spec import RESULTS
from proxy.stores import REDIS_SCHEMES
from proxy.stores.breaker import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SHIPPED = sorted((ROOT / "policies").glob("*/*.yaml"))
HEAD = "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: readme}\nspec:\n"


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _flag_rows() -> list[tuple[list[str], list[str]]]:
    """``(flags, defaults)`` of each row of the README's ``opgate serve`` table."""
    rows = []
    for line in README.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = line.split("|")
        flags = re.findall(r"`(--[a-z-]+)`", cells[1])
        rows.append((flags, re.findall(r"`([^`]*)`", cells[2])))
    return rows


def _policy_blocks() -> list[str]:
    """The README's policy examples as whole documents (a ``spec`` section gets a head)."""
    docs = []
    for block in re.findall(r"```yaml\n(.*?)```", README, re.S):
        if block.startswith("apiVersion: opgate.dev/"):
            docs.append(block)
        elif re.match(r"  [a-zA-Z]+:", block):  # a section of spec, indented as under it
            docs.append(HEAD + block)
    return docs


def _keys(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item)


def test_the_flag_table_has_the_parsers_flags_and_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("OPGATE_")]:
        monkeypatch.delenv(var)
    actions = {opt: a for a in _serve_parser()._actions for opt in a.option_strings}
    parsed = vars(build_parser().parse_args(["serve"]))
    rows = _flag_rows()
    assert len(rows) >= 15
    checked = 0
    for flags, defaults in rows:
        for flag in flags:
            assert flag in actions, f"the README's table names {flag}, which serve has not"
        if len(defaults) != len(flags):  # "in-cluster", or no default
            continue
        for flag, documented in zip(flags, defaults, strict=True):
            action = actions[flag]
            assert (action.type or str)(documented) == parsed[action.dest], flag
            checked += 1
    assert checked >= 13


def test_every_serve_flag_has_a_row_in_the_flag_table() -> None:
    """The table is where a reader looks a flag up: one that only ``--help`` names (the Redis
    timeout and replicas that the failure modes hang on, the log level) is one they never
    learn of."""
    tabled = {flag for flags, _ in _flag_rows() for flag in flags}
    served = {opt for a in _serve_parser()._actions for opt in a.option_strings
              if opt.startswith("--") and opt != "--help"}
    assert served - tabled == set()


def test_the_redis_url_row_names_every_scheme_opgate_takes() -> None:
    """``rediss+sentinel://`` (a Sentinel on TLS) and ``rediss+cluster://`` were taken but
    named nowhere a user reads."""
    [row] = [line for line in README.splitlines() if line.startswith("| `--redis-url` |")]
    assert [s for s in REDIS_SCHEMES if f"`{s}://`" not in row] == []


def test_the_readme_policies_are_valid(tmp_path: Path) -> None:
    docs = _policy_blocks()
    assert len(docs) >= 5  # the policy and its faults, quotas, audit and capture sections
    for i, doc in enumerate(docs):
        (tmp_path / f"readme-{i}.yaml").write_text(doc.replace("name: readme", f"name: r{i}"))
    assert check([tmp_path], parsers=section_parsers()) == []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_policy_is_valid(path: Path) -> None:
    """Each with the identity example, as its "Check it with" line says: users and userGroups
    need some policy of the set to verify callers (a file that is that policy is read once)."""
    identity = ROOT / "policies" / "examples" / "identity.yaml"
    assert check([path, identity], parsers=section_parsers()) == []


def test_every_field_the_readme_shows_is_in_an_example() -> None:
    shown = {key for doc in _policy_blocks() for key in _keys(yaml.safe_load(doc))}
    examples = {key for path in SHIPPED
                for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
                for key in _keys(doc)}
    assert len(SHIPPED) >= 7
    assert shown - examples == set()


def _served_metrics() -> dict[str, set[str]]:
    """Each metric family ``/metrics`` serves (a counter with its ``_total``) and its labels."""
    served = {}
    for collector in telemetry.REGISTRY._collector_to_names:
        name = getattr(collector, "_name", None)
        if name is None:  # the flusher, which serves nothing
            continue
        suffix = "_total" if collector._type == "counter" else ""
        served[name.removeprefix("opgate_") + suffix] = set(collector._labelnames)
    return served


def test_the_readme_lists_the_served_metrics_with_their_labels() -> None:
    listed = _metric_list()
    while (bare := re.sub(r"\([^()]*\)", "", listed)) != listed:  # a label's values, notes
        listed = bare
    shown = {name: set(filter(None, labels.split(",")))
             for name, labels in re.findall(r"`([a-z]+_[a-z_]+)(?:\{([a-z_,]*)\})?`", listed)}
    served = _served_metrics()
    assert len(served) >= 20
    assert shown == served


def test_the_layout_names_every_top_level_part_and_package() -> None:
    """A reader finds each part of the tree in the Layout block: what git tracks at the top
    (``scripts/``, which ``make test`` runs, was in none of it) and each package of ``proxy``."""
    layout = README.split("## Layout", 1)[1].split("```", 2)[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    tops = {path.split("/", 1)[0] + ("/" if "/" in path else "") for path in tracked}
    parts = {top for top in tops if not top.startswith(".") or top == ".ci/"}
    packages = {f"{p.parent.name}/" for p in (ROOT / "proxy").glob("*/__init__.py")}
    assert len(parts) >= 10 and len(packages) >= 5
    missing = {part for part in parts | packages
               if not re.search(rf"(^|[\s·])({re.escape(part)}|{re.escape(part.rstrip('/'))})"
                                rf"($|[\s/·])", layout, re.M)}
    assert missing == set()


def _metric_list() -> str:
    return README.split("Metrics (`opgate_` prefix): ", 1)[1].split("\nLabels never", 1)[0]


@pytest.mark.parametrize(("metric", "values"), [
    ("ratelimit_decisions_total", RESULTS),
    ("ratelimit_backend", BACKENDS),
    ("policy_reloads_total", ("success", "error", "unchanged")),
    ("requests_total", tuple(_DECISIONS)),
    ("identity_denials_total", ("missing_token", "invalid_token", "not_allowed", "rule_denied",
                                "no_rule", "sar_denied")),  # identity.py, identity_sar.py
    ("upstream_errors_total", ("connect", "connect_timeout", "timeout", "tls", "disconnect",
                               "other")),  # relay/errors.py
])
def test_the_readme_lists_a_metrics_label_values(metric: str, values: tuple[str, ...]) -> None:
    """What an alert on a bounded label is written against: ``result="denied"`` or
    ``"unavailable"`` of the rate limits was nowhere but in the code."""
    text = _metric_list().split(f"`{metric}{{", 1)[1].split("}`", 1)[1].lstrip()
    assert text.startswith("("), f"no (values) after {metric}"
    depth = end = 0
    while end == 0 or depth:  # the parenthesis after the metric, to its close
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    described = text[1:end - 1]
    assert {v for v in values if f"`{v}`" not in described} == set()
