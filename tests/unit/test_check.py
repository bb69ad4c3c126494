"""``opgate check`` (proxy.engine.check): the file:line: message lines the CLI prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.app import section_parsers
from proxy.engine.check import check
from tests.unit.test_policies import GOOD, PARSERS, policy_doc

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def test_valid_files_give_no_lines(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD + "---\n" + policy_doc("beta"))
    (tmp_path / "b.yml").write_text(policy_doc("gamma", "  mode: dryrun\n  failure: open\n"))
    assert check([tmp_path], parsers=PARSERS) == []
    assert check([tmp_path / "a.yaml", str(tmp_path / "b.yml")], parsers=PARSERS) == []


@pytest.mark.parametrize("parsers", [{}, PARSERS])
def test_minimal_example_is_valid(parsers: dict[str, object]) -> None:
    assert check([EXAMPLES / "minimal.yaml"], parsers=parsers) == []  # type: ignore[arg-type]


def test_broken_files_give_one_line_per_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        GOOD.replace("opgate.dev/v1alpha1", "opgate.dev/v2")
            .replace("mode: dryrun", "mode: strict")
            .replace("code: 409", "code: many")
        + "      colour: red\n"
        + "  quotas:\n    - max: 1\n"
    )
    (tmp_path / "b.yaml").write_text(policy_doc("alpha") + "---\n" + policy_doc("Beta"))
    (tmp_path / "c.yaml").write_text(policy_doc("gamma") + "  faults: [\n")
    assert check([tmp_path], parsers=PARSERS) == [
        f'{tmp_path}/a.yaml:1: apiVersion: must be "opgate.dev/v1alpha1" (got "opgate.dev/v2")',
        f'{tmp_path}/a.yaml:5: spec.mode: must be one of enforce, dryrun (got "strict")',
        f"{tmp_path}/a.yaml:8: spec.faults[0].code: expected an integer, got a string",
        f'{tmp_path}/a.yaml:10: unknown field "colour" in spec.faults[0]',
        f'{tmp_path}/a.yaml:11: spec.quotas: "quotas" is not supported by this opgate build yet '
        "(its middleware is not built in)",
        f'{tmp_path}/b.yaml:11: metadata.name: "Beta" is not a valid name (lower-case letters, '
        "digits, '-' and '.', starting and ending with a letter or digit)",
        f"{tmp_path}/c.yaml:8: invalid YAML: did not find expected node content",
    ]


def test_duplicate_names_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy_doc("same"))
    (tmp_path / "b.yaml").write_text(policy_doc("other") + "---\n" + policy_doc("same"))
    assert check([tmp_path], parsers=PARSERS) == [
        f'{tmp_path}/b.yaml:11: duplicate policy name "same" (also at {tmp_path}/a.yaml:4)']


def test_file_without_a_policy_document(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy_doc("alpha"))
    (tmp_path / "b.yaml").write_text("# emptied\n---\n")
    assert check([tmp_path], parsers=PARSERS) == [
        f"{tmp_path}/b.yaml:1: no policy document in this file"]


def test_cli_check_fails_on_an_empty_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy_doc("alpha"))
    (tmp_path / "b.yaml").write_text("")
    done = subprocess.run([sys.executable, "-m", "proxy", "check", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1, done
    assert f"{tmp_path}/b.yaml:1: no policy document in this file" in done.stdout + done.stderr


def test_cli_check_reports_deep_nesting_instead_of_crashing(tmp_path: Path) -> None:
    # libyaml's composer recurses in C: 200,000 "[" (200 KB) overflowed the stack, and a
    # segfault took `opgate check` (or the serving process, on a reload) down without a word
    (tmp_path / "a.yaml").write_text(policy_doc("alpha", "  faults: " + "[" * 200_000 + "\n"))
    done = subprocess.run([sys.executable, "-m", "proxy", "check", str(tmp_path)],
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (
        1, f"{tmp_path}/a.yaml:6: invalid YAML: nested more than 64 levels deep\n", "")


def test_values_with_line_breaks_stay_on_their_error_line(tmp_path: Path) -> None:
    # the message quotes the value: a block scalar or a "\n" split the error over lines, and a
    # file could print lines of its own that look like opgate's
    (tmp_path / "a.yaml").write_text(
        'apiVersion: "opgate.dev/v1alpha1\\nb.yaml:1: all good"\nkind: |\n  Policy\n'
        "metadata: {name: alpha}\nspec: {mode: enforce}\n")
    assert check([tmp_path], parsers=PARSERS) == [
        f'{tmp_path}/a.yaml:1: apiVersion: must be "opgate.dev/v1alpha1" '
        '(got "opgate.dev/v1alpha1\\nb.yaml:1: all good")',
        f'{tmp_path}/a.yaml:2: kind: must be "Policy" (got "Policy\\n")',
    ]


def test_a_document_of_another_kind_is_one_error_not_its_fields(tmp_path: Path) -> None:
    """kubectl users keep several kinds in one file: a ConfigMap among the policies was
    reported field by field as if it were a broken Policy (its data "unknown", its spec
    "missing"), four lines for one mistake. Now its apiVersion and kind say it."""
    (tmp_path / "a.yaml").write_text(
        policy_doc("alpha") + "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: cfg}\n"
        "data: {k: v}\n")
    assert check([tmp_path], parsers=PARSERS) == [
        f'{tmp_path}/a.yaml:8: apiVersion: must be "opgate.dev/v1alpha1" (got "v1")',
        f'{tmp_path}/a.yaml:9: kind: must be "Policy" (got "ConfigMap")',
    ]


def test_missing_paths(tmp_path: Path) -> None:
    assert check([tmp_path / "nope.yaml"], parsers=PARSERS) == [
        f"{tmp_path}/nope.yaml: no such file or directory"]
    assert check([tmp_path], parsers=PARSERS) == [
        f"{tmp_path}: no policy files (*.yaml, *.yml) here"]


# --- fields about the verified caller need an identity section somewhere in the set -----

_NO_CALLER = "never matches: no policy of the set has spec.identity, so no caller is verified"
_IDENTITY = ("  identity:\n    allow: [{group: system:authenticated}]\n"
             "    rules: [{verbs: ['*'], resources: ['*']}]\n")
_ABOUT_USERS = (
    "  rateLimits:\n    - name: ops\n      match: {users: [alice]}\n      key: '{user}'\n"
    "      qps: 1\n      burst: 1\n"
    "  faults:\n    - match:\n        users: [bob]\n      probability: 1\n"
    "      respond: {code: 409}\n"
    "  capture:\n    - match: {verbs: [get], users: ['system:serviceaccount:ops:*']}\n"
    "  audit:\n    rules:\n      - {level: Request, users: [carol]}\n"
    "      - {level: Request, userGroups: ['system:masters']}\n")


def test_users_without_any_identity_section_are_an_error_each(tmp_path: Path) -> None:
    """Without spec.identity no caller is verified: a rule naming users applies to no call,
    which the README counts among what never matches (an error), not a silent no-op."""
    (tmp_path / "a.yaml").write_text(policy_doc("alpha", _ABOUT_USERS))
    done = subprocess.run([sys.executable, "-m", "proxy", "check", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1, done
    assert done.stdout.splitlines() == check([tmp_path], parsers=section_parsers()) == [
        f"{tmp_path}/a.yaml:8: spec.rateLimits[0].match.users {_NO_CALLER}",
        f"{tmp_path}/a.yaml:14: spec.faults[0].match.users {_NO_CALLER}",
        f"{tmp_path}/a.yaml:18: spec.capture[0].match.users {_NO_CALLER}",
        f"{tmp_path}/a.yaml:21: spec.audit.rules[0].users {_NO_CALLER}",
        f"{tmp_path}/a.yaml:22: spec.audit.rules[1].userGroups {_NO_CALLER}"]


def test_users_are_fine_with_an_identity_section_in_any_policy(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy_doc("alpha", _ABOUT_USERS))
    (tmp_path / "b.yaml").write_text(policy_doc("beta", _IDENTITY))
    assert check([tmp_path], parsers=section_parsers()) == []
    # a broken identity section is its own error: not also "no policy has spec.identity"
    (tmp_path / "b.yaml").write_text(policy_doc("beta", _IDENTITY.replace("rules", "rulez")))
    assert [e for e in check([tmp_path], parsers=section_parsers()) if _NO_CALLER in e] == []


def test_a_user_key_without_identity_is_one_bucket_not_an_error(tmp_path: Path) -> None:
    """``key: "{user}"`` is ``-`` for every call without identity (one bucket for all, as the
    README says): the chart's default policy uses it, with or without identity."""
    (tmp_path / "a.yaml").write_text(policy_doc("alpha", (
        "  rateLimits:\n    - {name: reads, match: {verbs: [get]}, key: '{user}/{resource}',"
        " qps: 1, burst: 1}\n")))
    assert check([tmp_path], parsers=section_parsers()) == []
