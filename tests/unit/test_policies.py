"""Policy files → PolicySet (proxy.engine.policies): envelope, sections, errors, store."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.engine import policies, telemetry
from proxy.engine.policies import (
    EMPTY,
    KNOWN_SECTIONS,
    Policy,
    PolicyLoadError,
    PolicySet,
    PolicyStore,
    load_policy_set,
)
from proxy.engine.schema import Fields, Located, PolicyError, SectionParser, sequence


@dataclasses.dataclass(frozen=True)
class FaultRule:
    probability: float
    code: int
    verbs: tuple[str, ...]


def parse_faults(node: Located, errors: list[PolicyError]) -> tuple[FaultRule, ...]:
    """A tiny stand-in for a middleware's section parser (the real ones live elsewhere)."""
    rules = []
    for index, item in enumerate(sequence(node, what="spec.faults", errors=errors)):
        f = Fields(item, what=f"spec.faults[{index}]", errors=errors)
        rules.append(FaultRule(
            probability=f.number("probability", required=True, minimum=0, maximum=1) or 0.0,
            code=f.int("code", default=500, minimum=400, maximum=599) or 500,
            verbs=f.str_list("verbs"),
        ))
        f.finish()
    return tuple(rules)


PARSERS: Mapping[str, SectionParser] = {"faults": parse_faults}

GOOD = """\
apiVersion: opgate.dev/v1alpha1
kind: Policy
metadata: {name: alpha}
spec:
  mode: dryrun
  faults:
    - probability: 0.1
      code: 409
      verbs: [update]
"""


def policy_doc(name: str, spec: str = "  mode: enforce\n") -> str:
    return (f"apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata:\n  name: {name}\n"
            f"spec:\n{spec}")


def errors_of(*paths: Path | str, parsers: Mapping[str, SectionParser] = PARSERS) -> list[str]:
    with pytest.raises(PolicyLoadError) as info:
        load_policy_set(list(paths), parsers=parsers)
    return [str(e) for e in info.value.errors]


def reloads(result: str) -> float:
    value = telemetry.REGISTRY.get_sample_value("opgate_policy_reloads_total", {"result": result})
    return value or 0.0


def test_valid_multi_document_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD + "---\n---\n" + policy_doc("beta", "  failure: open\n"
                                                    "  allowImpersonation: true\n"))
    pset = load_policy_set([path], parsers=PARSERS)
    alpha, beta = pset.policies
    assert alpha == Policy(name="alpha", mode="dryrun", source=f"{path}:1", failure="closed",
                           sections={"faults": (FaultRule(0.1, 409, ("update",)),)})
    assert alpha.dryrun and not alpha.allow_impersonation
    assert (beta.name, beta.mode, beta.failure, beta.source) == ("beta", "enforce", "open",
                                                                f"{path}:12")
    assert beta.allow_impersonation and dict(beta.sections) == {}
    assert pset.allow_impersonation
    assert pset.files == (str(path),)
    assert len(pset.digest) == 64 and pset.loaded_at > 0
    assert pset.section("faults") == ((alpha, alpha.sections["faults"]),)
    assert pset.section("quotas") == ()


def test_sets_and_policies_are_immutable(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(GOOD)
    pset = load_policy_set([tmp_path / "p.yaml"], parsers=PARSERS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pset.policies = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        pset.policies[0].sections["faults"] = ()  # type: ignore[index]
    assert not hasattr(pset, "__dict__")  # slotted


def test_empty_set_and_hand_built_sets() -> None:
    assert EMPTY.policies == () and EMPTY.section("faults") == () and not EMPTY.allow_impersonation
    p = Policy(name="p", sections={"faults": "spec"}, allow_impersonation=True)
    pset = PolicySet(policies=(p,))
    assert pset.section("faults") == ((p, "spec"),) and pset.allow_impersonation


BROKEN = [
    ("wrong apiVersion",
     GOOD.replace("opgate.dev/v1alpha1", "opgate.dev/v1"),
     ['{f}:1: apiVersion: must be "opgate.dev/v1alpha1" (got "opgate.dev/v1")']),
    ("wrong kind",
     GOOD.replace("kind: Policy", "kind: Pod"),
     ['{f}:2: kind: must be "Policy" (got "Pod")']),
    ("unknown key at a nested line",
     GOOD + "      colour: red\n",
     ['{f}:10: unknown field "colour" in spec.faults[0]']),
    ("unknown key in spec",
     GOOD.replace("  mode: dryrun\n", "  mode: dryrun\n  rateLimit: []\n"),
     ['{f}:6: unknown field "rateLimit" in spec']),
    ("unknown top-level key",
     GOOD + "status: {}\n",
     ['{f}:10: unknown field "status" in the document']),
    ("wrong type",
     GOOD.replace("code: 409", "code: '409'"),
     ["{f}:8: spec.faults[0].code: expected an integer, got a string"]),
    ("bad mode",
     GOOD.replace("mode: dryrun", "mode: audit"),
     ['{f}:5: spec.mode: must be one of enforce, dryrun (got "audit")']),
    ("bad failure and allowImpersonation",
     GOOD.replace("  mode: dryrun\n", "  failure: fail\n  allowImpersonation: maybe\n"),
     ['{f}:5: spec.failure: must be one of closed, open (got "fail")',
      "{f}:6: spec.allowImpersonation: expected true or false, got a string"]),
    ("YAML syntax error",
     GOOD.replace("metadata: {name: alpha}", "metadata: {name: alpha"),
     ["{f}:4: invalid YAML: did not find expected ',' or '}}'"]),
    ("duplicate key",
     GOOD.replace("  mode: dryrun\n", "  mode: dryrun\n  mode: enforce\n"),
     ['{f}:6: duplicate key "mode" (first at line 5)']),
    ("unsupported section",
     GOOD + "  quotas:\n    - {resources: [configmaps], max: 100}\n",
     ['{f}:10: spec.quotas: "quotas" is not supported by this opgate build yet '
      "(its middleware is not built in)"]),
    ("bad name",
     GOOD.replace("name: alpha", "name: Alpha_1"),
     ['{f}:3: metadata.name: "Alpha_1" is not a valid name (lower-case letters, digits, '
      "'-' and '.', starting and ending with a letter or digit)"]),
    ("empty name",  # taken: denials, /metrics and the Redis keys named policy ""
     GOOD.replace("name: alpha", 'name: ""'),
     ["{f}:3: metadata.name: must not be empty"]),
    ("missing envelope",
     "metadata: {}\n",
     ['{f}:1: missing required field "apiVersion"', '{f}:1: missing required field "kind"',
      '{f}:1: missing required field "name" in metadata', '{f}:1: missing required field "spec"']),
    ("not a mapping",
     "- a\n- b\n",
     ["{f}:1: document: expected a mapping, got a list"]),
    ("spec not a mapping",
     GOOD.split("spec:")[0] + "spec: enforce\n",
     ["{f}:4: spec: expected a mapping, got a string"]),
    ("section parser errors",
     GOOD.replace("probability: 0.1", "probability: 2"),
     ["{f}:7: spec.faults[0].probability: must be at most 1 (got 2.0)"]),
]


@pytest.mark.parametrize(("text", "expected"), [(t, e) for _, t, e in BROKEN],
                         ids=[i for i, _, _ in BROKEN])
def test_broken_files_report_file_and_line(tmp_path: Path, text: str,
                                           expected: list[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert errors_of(path) == [e.format(f=path) for e in expected]


@pytest.mark.parametrize(("text", "expected"), [
    (GOOD.replace("spec:", "spec: !!python/object:os.system"),
     ["{f}:4: unsupported YAML tag tag:yaml.org,2002:python/object:os.system"]),
    (GOOD.replace("0.1", "!!python/name:os.system"),
     ["{f}:7: unsupported YAML tag tag:yaml.org,2002:python/name:os.system"]),
    (GOOD.replace("    - probability", "    - !!set\n      probability"),
     ["{f}:7: unsupported YAML tag tag:yaml.org,2002:set"]),
    (GOOD.replace("{name: alpha}", "{name: alpha, labels: {team: !!set {}}}"),
     ["{f}:3: unsupported YAML tag tag:yaml.org,2002:set"]),
])
def test_a_value_the_yaml_refused_is_reported_once(tmp_path: Path, text: str,
                                                   expected: list[str]) -> None:
    """A value refused while reading (an unsupported tag, a recursive alias) is that one
    error: it was then also read as null, which added a false second one ('missing required
    field "spec"', "spec.faults[0]: expected a mapping, got null")."""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert errors_of(path) == [e.format(f=path) for e in expected]


def test_metadata_labels_and_annotations_as_kubernetes_objects_have(tmp_path: Path) -> None:
    """A Kubernetes-style document may carry labels and annotations (a team, a ticket, what
    kustomize or a template adds): they were "unknown field" errors that refused the set."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.replace("metadata: {name: alpha}", "metadata:\n  name: alpha\n"
                                 "  labels: {team: platform}\n"
                                 "  annotations: {opgate.dev/owner: 'ops@example.com'}"))
    assert [p.name for p in load_policy_set([path], parsers=PARSERS).policies] == ["alpha"]
    path.write_text(GOOD.replace("metadata: {name: alpha}", "metadata:\n  name: alpha\n"
                                 "  labels: {replicas: 3}\n  annotations: [a]\n"
                                 "  namespace: ops"))
    assert errors_of(path) == [
        f"{path}:5: metadata.labels.replicas: expected a string, got an integer",
        f"{path}:6: metadata.annotations: expected a mapping of strings, got a list",
        f'{path}:7: unknown field "namespace" in metadata',
    ]


def test_duplicate_name_across_two_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text("# second\n" + GOOD.replace("mode: dryrun", "mode: enforce"))
    assert errors_of(tmp_path) == [
        f'{tmp_path}/b.yaml:4: duplicate policy name "alpha" (also at {tmp_path}/a.yaml:3)']


def test_all_errors_of_all_files_are_collected(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD.replace("mode: dryrun", "mode: x") + "---\n"
                                     + policy_doc("two", "  faults: {}\n"))
    (tmp_path / "b.yml").write_text("a: [\n")
    assert errors_of(tmp_path, tmp_path / "missing.yaml") == [
        f"{tmp_path}/missing.yaml: no such file or directory",
        f'{tmp_path}/a.yaml:5: spec.mode: must be one of enforce, dryrun (got "x")',
        f"{tmp_path}/a.yaml:16: spec.faults: expected a list, got a mapping",
        f"{tmp_path}/b.yml:2: invalid YAML: did not find expected node content",
    ]


def test_null_sections_are_absent(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("p", "  mode:\n  quotas:\n  faults:\n"))
    (policy,) = load_policy_set([path], parsers=PARSERS).policies
    assert policy.mode == "enforce" and dict(policy.sections) == {}


def test_every_known_section_needs_a_parser(tmp_path: Path) -> None:
    assert KNOWN_SECTIONS == ("identity", "rateLimits", "quotas", "faults")
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("p", "  identity: {}\n  rateLimits: []\n  faults: []\n"))
    assert errors_of(path, parsers={}) == [
        f'{path}:6: spec.identity: "identity" is not supported by this opgate build yet '
        "(its middleware is not built in)",
        f'{path}:7: spec.rateLimits: "rateLimits" is not supported by this opgate build yet '
        "(its middleware is not built in)",
        f'{path}:8: spec.faults: "faults" is not supported by this opgate build yet '
        "(its middleware is not built in)",
    ]


def test_a_new_middleware_brings_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("p", "  audit: {level: full}\n  faults: []\n"))
    parsers = {**PARSERS, "audit": lambda node, errors: node.plain()}
    (policy,) = load_policy_set([path], parsers=parsers).policies
    assert list(policy.sections) == ["faults", "audit"]
    assert policy.sections["audit"] == {"level": "full"}


def test_a_crashing_parser_is_an_error_not_a_crash(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("p", "  faults: []\n"))

    def boom(node: Located, errors: list[PolicyError]) -> object:
        raise RuntimeError("bug")

    with caplog.at_level(logging.ERROR, "opgate.policies"):
        assert errors_of(path, parsers={"faults": boom}) == [
            f"{path}:6: spec.faults: could not be validated (RuntimeError('bug'))"]


def test_an_unreadable_directory_is_an_error_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.listdir raised out of the loader (a directory without read permission, or one removed
    # between the isdir check and the listing): a traceback from `check`, and a reload that
    # was neither counted nor shown on /debug/policies
    (tmp_path / "p.yaml").write_text(GOOD)
    listdir = os.listdir

    def denied(path: str) -> list[str]:
        if os.fspath(path) == str(tmp_path):
            raise PermissionError(13, "Permission denied")
        return listdir(path)

    monkeypatch.setattr(policies.os, "listdir", denied)
    assert errors_of(tmp_path) == [f"{tmp_path}: cannot read: Permission denied"]
    store = PolicyStore([tmp_path], parsers=PARSERS)
    errors = reloads("error")
    assert store.reload() is False and store.failing and reloads("error") == errors + 1
    assert store.describe()["last_error"] == f"{tmp_path}: cannot read: Permission denied"


def test_a_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    # the digest encoded the name strictly: UnicodeEncodeError out of check, reload and the
    # safety poll (and out of `opgate serve` at start); printing it failed the same way
    raw = os.fsencode(tmp_path) + b"/caf\xe9.yaml"
    with open(raw, "wb") as fh:
        fh.write(GOOD.encode())
    store = PolicyStore([tmp_path], parsers=PARSERS)
    assert store.reload() and [p.name for p in store.current.policies] == ["alpha"]
    # a denial's message and Warning header name the source: it must be encodable
    assert store.current.policies[0].source == f"{tmp_path}/caf\\xe9.yaml:1"
    assert not store.changed() and store.reload()
    with open(raw, "wb") as fh:
        fh.write(GOOD.replace("mode: dryrun", "mode: x").encode())
    assert store.reload() is False
    assert store.last_error == (f"{tmp_path}/caf\\xe9.yaml:5: spec.mode: must be one of "
                                'enforce, dryrun (got "x")')
    assert store.last_error.encode()  # printable as UTF-8


def test_a_file_far_too_large_is_not_read_whole(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies, "MAX_FILE_BYTES", len(GOOD))
    (tmp_path / "a.yaml").write_text(GOOD)  # at the limit: fine
    assert load_policy_set([tmp_path / "a.yaml"], parsers=PARSERS).policies
    (tmp_path / "a.yaml").write_text(GOOD + "\n")
    assert errors_of(tmp_path) == [f"{tmp_path}/a.yaml: larger than 0 MiB: not a policy file"]


def test_a_file_larger_than_a_configmap_holds_is_refused_unparsed(tmp_path: Path) -> None:
    """Composing YAML costs about 125 times the file's size in memory and 3.5 s of CPU per MiB:
    under the old 16 MiB limit a 4 MiB file dropped in the directory (a CRD bundle) took 16 s
    and 500 MB, which the chart's 256Mi limit answers by killing the serving process. Nothing
    a ConfigMap can hold (1 MiB) is refused."""
    comments = b"# a comment line, 32 bytes long\n" * (2**20 // 32)
    assert len(comments) == 2**20
    (tmp_path / "a.yaml").write_bytes(comments)  # at the limit: read (and it holds no policy)
    assert errors_of(tmp_path) == [f"{tmp_path}/a.yaml:1: no policy document in this file"]
    (tmp_path / "a.yaml").write_bytes(comments + b"#")
    assert errors_of(tmp_path) == [f"{tmp_path}/a.yaml: larger than 1 MiB: not a policy file"]


def test_a_loader_crash_is_a_file_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)

    def boom(data: bytes, *, file: str, errors: list[PolicyError]) -> list[Located]:
        raise RecursionError("bug")

    monkeypatch.setattr(policies, "parse_yaml_documents", boom)
    with caplog.at_level(logging.ERROR, "opgate.policies"):
        assert errors_of(path) == [f"{path}: could not be read as YAML (RecursionError('bug'))"]


def test_a_crashing_reload_is_counted_and_stays_failing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore([path], parsers=PARSERS)
    assert store.reload()
    good, errors = store.current, reloads("error")

    def boom(*args: object, **kwargs: object) -> PolicySet:
        raise RuntimeError("bug")

    monkeypatch.setattr(policies, "build_policy_set", boom)
    path.write_text(GOOD.replace("mode: dryrun", "mode: enforce"))
    with caplog.at_level(logging.ERROR, "opgate.policies"):
        assert store.reload() is False
    assert store.current is good and store.failing and reloads("error") == errors + 1
    assert store.last_error == f"{path}: could not be validated (RuntimeError('bug'))"
    # the digest was taken before the crash: the same files must not now pass as unchanged
    assert store.reload() is False and store.failing


def test_directory_loading(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(policy_doc("b"))
    (tmp_path / "a.yml").write_text(policy_doc("a"))
    (tmp_path / "c.yaml").write_text("# the rest\n---\n" + policy_doc("c"))
    (tmp_path / "notes.txt").write_text("not yaml: [")
    (tmp_path / ".hidden.yaml").write_text("not yaml: [")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.yaml").write_text("not yaml: [")
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")  # dangling: skipped
    pset = load_policy_set([tmp_path], parsers=PARSERS)
    assert [p.name for p in pset.policies] == ["a", "b", "c"]
    assert pset.files == tuple(str(tmp_path / n) for n in ("a.yml", "b.yaml", "c.yaml"))
    # the same file named twice is read once
    again = load_policy_set([tmp_path, tmp_path / "a.yml"], parsers=PARSERS)
    assert again.files == pset.files


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    assert errors_of(tmp_path) == [f"{tmp_path}: no policy files (*.yaml, *.yml) here"]


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing yet\n", "---\n", "---\n# c\n---\n...\n",
                                  "%YAML 1.1\n---\n"])
def test_file_without_a_policy_document_is_an_error(tmp_path: Path, text: str) -> None:
    """An emptied or cut-short file (a ConfigMap key) must not drop its policies silently."""
    (tmp_path / "a.yaml").write_text(policy_doc("a"))
    (tmp_path / "b.yaml").write_text(text)
    assert errors_of(tmp_path) == [f"{tmp_path}/b.yaml:1: no policy document in this file"]
    assert errors_of(tmp_path / "b.yaml") == [
        f"{tmp_path}/b.yaml:1: no policy document in this file"]


def test_empty_documents_beside_a_policy_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("# policies\n---\n---\n" + policy_doc("a") + "---\n# more later\n")
    assert [p.name for p in load_policy_set([path], parsers=PARSERS).policies] == ["a"]


def test_a_syntax_error_is_not_also_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("metadata: {name: a\n")
    errors = errors_of(path)
    assert len(errors) == 1 and "invalid YAML" in errors[0]


def make_configmap(root: Path, files: Mapping[str, str], stamp: str) -> None:
    """Do what the kubelet's AtomicWriter does to a ConfigMap volume."""
    root.mkdir(exist_ok=True)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    data_dir = root / f"..{stamp}"
    data_dir.mkdir()
    for name, text in files.items():
        (data_dir / name).write_text(text)
    (root / "..data_tmp").symlink_to(data_dir.name)
    os.replace(root / "..data_tmp", root / "..data")  # the atomic swap
    for name in files:
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")
    for entry in root.iterdir():
        if entry.is_symlink() and entry.name not in files and not entry.name.startswith("."):
            entry.unlink()
    if old is not None:
        shutil.rmtree(root / old)


def test_configmap_mount(tmp_path: Path) -> None:
    mount = tmp_path / "policies"
    make_configmap(mount, {"policy.yaml": GOOD, "more.yaml": policy_doc("more")},
                   "2026_11_30_01_00_00.123")
    assert sorted(p.name for p in mount.iterdir()) == [
        "..2026_11_30_01_00_00.123", "..data", "more.yaml", "policy.yaml"]
    pset = load_policy_set([mount], parsers=PARSERS)
    assert [p.name for p in pset.policies] == ["more", "alpha"]
    assert pset.files == (str(mount / "more.yaml"), str(mount / "policy.yaml"))
    assert pset.policies[1].source == f"{mount}/policy.yaml:1"
    make_configmap(mount, {"policy.yaml": policy_doc("beta")}, "2026_11_30_01_05_00.456")
    assert [p.name for p in load_policy_set([mount], parsers=PARSERS).policies] == ["beta"]
    # a single file of a mount works too
    assert load_policy_set([mount / "policy.yaml"], parsers=PARSERS).policies[0].name == "beta"


def test_digest_follows_bytes(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    first = load_policy_set([path], parsers=PARSERS).digest
    assert load_policy_set([path], parsers=PARSERS).digest == first
    path.write_text(GOOD + "# a comment\n")
    assert load_policy_set([path], parsers=PARSERS).digest != first


# --- PolicyStore ------------------------------------------------------------------------------

def test_store_starts_empty(tmp_path: Path) -> None:
    store = PolicyStore([tmp_path / "p.yaml"], parsers=PARSERS)
    assert store.current is EMPTY and not store.loaded and store.last_error == ""
    assert store.describe()["loaded"] is False


def test_store_reload_swaps_keeps_last_good_and_counts(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore([path], parsers=PARSERS)
    success, error, unchanged = reloads("success"), reloads("error"), reloads("unchanged")

    assert store.reload() is True
    good = store.current
    assert store.loaded and [p.name for p in good.policies] == ["alpha"]
    assert reloads("success") == success + 1
    assert store.reload() is True  # same bytes: no new set
    assert store.current is good and reloads("unchanged") == unchanged + 1

    in_flight = store.current  # what a request holds from its start
    path.write_text(GOOD.replace("mode: dryrun", "mode: sometimes"))
    with caplog.at_level(logging.ERROR, "opgate.policies"):
        assert store.reload() is False
    assert store.current is good and store.failing
    assert store.last_error == (f"{path}:5: spec.mode: must be one of enforce, dryrun "
                                '(got "sometimes")')
    assert store.last_error_at is not None
    assert reloads("error") == error + 1
    assert "sometimes" in caplog.text
    assert store.reload() is False  # the same broken bytes are not reported again
    assert reloads("error") == error + 1

    path.write_text(policy_doc("gamma"))
    assert store.reload() is True
    assert [p.name for p in store.current.policies] == ["gamma"]
    assert not store.failing and "sometimes" in store.last_error  # the last error stays visible
    assert in_flight is good and [p.name for p in in_flight.policies] == ["alpha"]


def test_store_keeps_the_set_when_a_file_is_emptied(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy_doc("a"))
    (tmp_path / "b.yaml").write_text(policy_doc("b"))
    store = PolicyStore([tmp_path], parsers=PARSERS)
    assert store.reload()
    good, errors = store.current, reloads("error")
    (tmp_path / "b.yaml").write_text("")  # a ConfigMap key emptied
    assert store.reload() is False
    assert store.current is good and store.failing
    assert store.last_error == f"{tmp_path}/b.yaml:1: no policy document in this file"
    assert store.describe()["last_error"] == store.last_error
    assert reloads("error") == errors + 1


def test_store_first_load_failure(tmp_path: Path) -> None:
    store = PolicyStore([tmp_path / "missing.yaml"], parsers=PARSERS)
    assert store.reload() is False
    assert store.current is EMPTY and not store.loaded
    assert store.last_error == f"{tmp_path}/missing.yaml: no such file or directory"


def test_store_changed(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore([path], parsers=PARSERS)
    assert store.changed()
    store.reload()
    assert not store.changed()
    path.write_text(GOOD + "\n")
    assert store.changed()


def test_describe(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore([tmp_path], parsers=PARSERS)
    store.reload()
    path.write_text("a: [\n")
    store.reload()
    info = store.describe()
    assert info == {
        "loaded": True,
        "failing": True,
        "paths": [str(tmp_path)],
        "digest": store.current.digest,
        "files": [str(path)],
        "loaded_at": info["loaded_at"],
        "policies": [{"name": "alpha", "mode": "dryrun", "failure": "closed",
                      "source": f"{path}:1", "sections": ["faults"],
                      "allow_impersonation": False}],
        "last_error": f"{path}:2: invalid YAML: did not find expected node content",
        "last_error_at": info["last_error_at"],
    }
    assert info["loaded_at"].endswith("+00:00") and info["last_error_at"].endswith("+00:00")
