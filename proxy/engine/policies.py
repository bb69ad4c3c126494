"""Policy files → one immutable, validated :class:`PolicySet`, and the store that swaps it in.

The engine validates the envelope of each YAML document (``apiVersion``, ``kind``,
``metadata.name``, ``.labels``, ``.annotations``, ``spec.mode``/``failure``/``allowImpersonation``);
each section of ``spec`` belongs to the middleware that enforces it and is validated by that
middleware's :data:`~proxy.engine.schema.SectionParser`, passed in ``parsers`` (so a new
middleware brings its schema with it). A parsed section may also have to agree with the same
section of earlier policies (its ``check_against``), and a field about the verified caller (a
spec's ``caller_fields``: ``users``) needs a policy of the set with ``spec.identity``, without
which no call has a user. Every problem in every file is collected, then reported together.

:class:`PolicyStore` holds the active set. A reload reads every file, validates, and replaces
``store.current`` with one attribute assignment, only when everything is valid: the last good set
stays active otherwise. A request takes ``ctx.policies = store.current`` once, at its start, and
uses only that reference until it ends, so it finishes under the set it started with however
many reloads happen meanwhile (sets are immutable and never change in place).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from proxy.engine import telemetry
from proxy.engine.logformat import KEEP_LINES
from proxy.engine.schema import (
    CallerField,
    Fields,
    Located,
    PolicyError,
    SectionParser,
    describe_type,
)
from proxy.engine.yamlload import parse_yaml_documents, read_error

log = logging.getLogger("opgate.policies")

API_VERSION = "opgate.dev/v1alpha1"
KIND = "Policy"
KNOWN_SECTIONS = ("identity", "rateLimits", "quotas", "faults")
MODES = ("enforce", "dryrun")
FAILURES = ("closed", "open")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SUFFIXES = (".yaml", ".yml")
# A ConfigMap holds at most 1 MiB; beyond that a file is a mistake (a CRD bundle, a log,
# /dev/zero). Composing YAML into located values holds about 125 times the file's size and
# takes about 3.5 s of CPU per MiB: 16 MiB was 2 GB, and 4 MiB past the chart's 256Mi limit.
MAX_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Policy:
    """One validated policy document. ``sections`` maps a YAML key (``rateLimits``) to the spec
    its middleware parsed; ``source`` is ``file:line`` of the document."""

    name: str
    mode: str = "enforce"
    source: str = ""
    failure: str = "closed"
    sections: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    allow_impersonation: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sections, MappingProxyType):
            object.__setattr__(self, "sections", MappingProxyType(dict(self.sections)))

    @property
    def dryrun(self) -> bool:
        return self.mode == "dryrun"


@dataclass(frozen=True, slots=True)
class PolicySet:
    """Every active policy, in file order then document order. Immutable; replaced, never edited."""

    policies: tuple[Policy, ...] = ()
    files: tuple[str, ...] = ()
    digest: str = ""
    loaded_at: float = 0.0  # wall-clock time.time()
    allow_impersonation: bool = field(init=False, default=False)  # any policy allows it
    _sections: Mapping[str, tuple[tuple[Policy, object], ...]] = field(
        init=False, repr=False, compare=False, default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        by_key: dict[str, list[tuple[Policy, object]]] = {}
        for policy in self.policies:
            for key, spec in policy.sections.items():
                by_key.setdefault(key, []).append((policy, spec))
        sections = {key: tuple(pairs) for key, pairs in by_key.items()}
        object.__setattr__(self, "_sections", MappingProxyType(sections))
        object.__setattr__(self, "allow_impersonation",
                           any(p.allow_impersonation for p in self.policies))

    def section(self, key: str) -> tuple[tuple[Policy, object], ...]:
        """``(policy, parsed spec)`` for every policy that has section ``key``, in order."""
        return self._sections.get(key, ())


EMPTY = PolicySet()

P = TypeVar("P")


class PlanPerSet(Generic[P]):
    """A middleware's plan built from one ``spec`` section of the policy set in force, rebuilt
    only when another set is in force (compared by identity: the set is held, so its identity
    stays meaningful). Call it with ``ctx.policies``."""

    __slots__ = ("_build", "_for", "_plan", "_section")

    def __init__(self, section: str, build: Callable[[Sequence[tuple[Any, object]]], P],
                 empty: P) -> None:
        self._section, self._build, self._plan = section, build, empty
        self._for: object = None

    def __call__(self, policies: object) -> P:
        if policies is not self._for:
            section = getattr(policies, "section", None)
            self._plan = self._build(section(self._section) if section is not None else ())
            self._for = policies
        return self._plan


class PolicyLoadError(Exception):
    """The files do not make a valid set; ``errors`` lists every problem found."""

    def __init__(self, errors: Sequence[PolicyError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


def policy_files(paths: Sequence[str | Path], errors: list[PolicyError]) -> list[str]:
    """The files to read, in order: a file as given; a directory's ``*.yaml``/``*.yml``, sorted,
    not recursive, hidden entries skipped (``..data``, dotfiles). Symlinks are followed, which is
    how a ConfigMap volume's ``name.yaml -> ..data/name.yaml`` links are read."""
    found: list[str] = []
    seen: set[str] = set()
    for raw in paths:
        path = str(raw)
        if os.path.isdir(path):
            try:
                listed = os.listdir(path)
            except OSError as exc:  # unreadable, or removed since isdir
                errors.append(PolicyError(path, 0, read_error(exc)))
                continue
            names = sorted(n for n in listed
                           if not n.startswith(".") and n.endswith(_SUFFIXES)
                           and os.path.isfile(os.path.join(path, n)))  # a dangling link is not
            if not names:
                errors.append(PolicyError(path, 0, "no policy files (*.yaml, *.yml) here"))
            candidates = [os.path.join(path, n) for n in names]
        elif os.path.exists(path):
            candidates = [path]
        else:
            errors.append(PolicyError(path, 0, "no such file or directory"))
            candidates = []
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if real not in seen:
                seen.add(real)
                found.append(candidate)
    return found


def read_policy_files(
    paths: Sequence[str | Path],
) -> tuple[list[tuple[str, bytes]], list[PolicyError], str]:
    """``([(file, bytes)], read errors, digest)``. The digest is a sha256 over each file's name
    and bytes, in order (and any read error, so an unchanged failure has a stable digest)."""
    errors: list[PolicyError] = []
    files: list[tuple[str, bytes]] = []
    for name in policy_files(paths, errors):
        try:
            with open(name, "rb") as fh:
                data = fh.read(MAX_FILE_BYTES + 1)
        except OSError as exc:  # e.g. removed since it was listed
            errors.append(PolicyError(name, 0, read_error(exc)))
            continue
        if len(data) > MAX_FILE_BYTES:
            errors.append(PolicyError(name, 0, f"larger than {MAX_FILE_BYTES // 2**20} MiB: "
                                               "not a policy file"))
            continue
        files.append((name, data))
    sha = hashlib.sha256()
    for name, data in files:  # a name that is not UTF-8 holds surrogates: its own bytes back
        sha.update(f"{name}\0{len(data)}\0".encode("utf-8", "surrogateescape"))
        sha.update(data)
    for error in errors:
        sha.update(f"error\0{error}\0".encode())
    return files, errors, sha.hexdigest()


def _parse_policy(doc: Located, *, parsers: Mapping[str, SectionParser],
                  errors: list[PolicyError]) -> Policy | None:
    """Validate one document's envelope and hand each section to its parser."""
    before = len(errors)
    top = Fields(doc, what="", errors=errors)
    if not top.ok:
        return None
    api_version = top.str("apiVersion", required=True)
    if api_version is not None and api_version != API_VERSION:
        top.fail("apiVersion", f'must be "{API_VERSION}" (got "{api_version}")')
    kind = top.str("kind", required=True)
    if kind is not None and kind != KIND:
        # another kind (a ConfigMap kept beside the policies): what it holds is no policy's
        # fields, so they are not reported one by one as a broken Policy's
        top.fail("kind", f'must be "{KIND}" (got "{kind}")')
        return None
    name = ""
    metadata_node = top.node("metadata", required=True)
    if metadata_node is not None:
        metadata = Fields(metadata_node, what="metadata", errors=errors)
        name = metadata.str("name", required=True) or ""
        if name and (len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name)):
            metadata.fail("name", f'"{name}" is not a valid name (lower-case letters, digits, '
                           "'-' and '.', starting and ending with a letter or digit)")
        for key in ("labels", "annotations"):
            _string_map(metadata, key)
        metadata.finish()
    spec_node = top.node("spec", required=True)
    top.finish()
    if spec_node is None:
        return None
    spec = Fields(spec_node, what="spec", errors=errors)
    mode = spec.str("mode", default="enforce", choices=MODES) or "enforce"
    failure = spec.str("failure", default="closed", choices=FAILURES) or "closed"
    impersonation = spec.bool("allowImpersonation", default=False)
    sections: dict[str, object] = {}
    for key in (*KNOWN_SECTIONS, *(k for k in parsers if k not in KNOWN_SECTIONS)):
        node = spec.node(key)
        if node is None:  # absent or null: the policy has no such section
            continue
        parser = parsers.get(key)
        if parser is None:
            spec.fail(key, f'"{key}" is not supported by this opgate build yet '
                       "(its middleware is not built in)")
            continue
        try:
            sections[key] = parser(node, errors)
        except Exception as exc:  # a parser bug must not take the reload task down
            log.exception("section parser for %s crashed", key)
            errors.append(node.error(f"spec.{key}: could not be validated ({exc!r})"))
    spec.finish()
    if len(errors) > before or not spec.ok:
        return None
    return Policy(name=name, mode=mode, source=doc.where(), failure=failure,
                  sections=sections, allow_impersonation=impersonation)


def _string_map(fields: Fields, key: str) -> None:
    """``metadata.labels`` / ``metadata.annotations``: strings to strings, as a Kubernetes
    object's (opgate reads neither; they are the authors', and templates add them)."""
    node = fields.node(key)
    if node is None:
        return
    if not isinstance(node.value, dict):
        fields.fail(key, f"expected a mapping of strings, got {describe_type(node.value)}")
        return
    for name, item in node.value.items():
        if not isinstance(item.value, str) and not item.reported:
            fields.errors.append(item.error(
                f"{fields.path(key)}.{name}: expected a string, got {describe_type(item.value)}",
                line=node.key_lines.get(name, item.line)))


def _shown(file: str) -> str:
    """A file name as errors and ``Policy.source`` show it: one that is not UTF-8 comes from
    os.listdir with lone surrogates, which no UTF-8 output (a log line, a header) can encode."""
    if file.isprintable():
        return file
    return file.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def build_policy_set(files: Sequence[tuple[str, bytes]], *, parsers: Mapping[str, SectionParser],
                     digest: str = "", errors: list[PolicyError] | None = None) -> PolicySet:
    """Parse and validate already-read files; raise :class:`PolicyLoadError` with every problem
    (plus any in ``errors``, e.g. from reading) when there is one."""
    errors = [] if errors is None else list(errors)
    policies: list[Policy] = []
    first_seen: dict[str, str] = {}
    identified = False  # a document declares spec.identity (valid or not)
    for raw, data in files:
        file = _shown(raw)
        before = len(errors)
        try:
            documents = parse_yaml_documents(data, file=file, errors=errors)
        except Exception as exc:  # a loader bug must not take `check` or the reload task down
            log.exception("reading %s as YAML crashed", file)
            errors.append(PolicyError(file, 0, f"could not be read as YAML ({exc!r})"))
            continue
        if len(errors) == before and all(doc.value is None for doc in documents):
            # empty, only comments or only "---": a ConfigMap key emptied or cut short must not
            # take its policies away without a word
            errors.append(PolicyError(file, 1, "no policy document in this file"))
        for doc in documents:
            if doc.value is None:
                continue  # an empty document between others
            identified = identified or _declares_identity(doc)
            policy = _parse_policy(doc, parsers=parsers, errors=errors)
            if policy is None:
                continue
            line = doc.value["metadata"].key_lines.get("name", doc.line)
            if policy.name in first_seen:
                errors.append(doc.error(f'duplicate policy name "{policy.name}" '
                                        f"(also at {first_seen[policy.name]})", line=line))
                continue
            first_seen[policy.name] = f"{file}:{line}"
            policies.append(policy)
    _check_across(policies, errors)
    if not identified:
        _check_callers(policies, errors)
    if errors:
        order = {_shown(file): index for index, (file, _) in enumerate(files)}
        errors.sort(key=lambda e: (order.get(e.file, -1), e.line))
        raise PolicyLoadError(errors)
    return PolicySet(policies=tuple(policies), files=tuple(file for file, _ in files),
                     digest=digest, loaded_at=time.time())


def _check_across(policies: Sequence[Policy], errors: list[PolicyError]) -> None:
    """What one section must agree on with the same section of earlier policies: a parsed spec
    with a ``check_against(earlier specs) -> [PolicyError]`` method says so (identity: one claim
    mapping per issuer, since a token is verified once and is then one user for every policy)."""
    earlier: dict[str, list[object]] = {}
    for policy in policies:
        for key, spec in policy.sections.items():
            check = getattr(spec, "check_against", None)
            if check is not None and key in earlier:
                errors.extend(check(tuple(earlier[key])))
            earlier.setdefault(key, []).append(spec)


def _declares_identity(doc: Located) -> bool:
    """Whether a Policy document has a ``spec.identity`` (a broken one too: its own errors say
    what is wrong, not that no policy verifies callers)."""
    top = doc.value if isinstance(doc.value, dict) else {}
    kind, spec = top.get("kind"), top.get("spec")
    return (kind is not None and kind.value == KIND and spec is not None
            and isinstance(spec.value, dict) and spec.value.get("identity") is not None
            and spec.value["identity"].value is not None)


def _caller_fields(spec: object) -> Iterator[CallerField]:
    """Every field of a parsed section about the verified caller: the spec's own
    ``caller_fields``, or, for a list of rules, each rule's (or its ``match``'s)."""
    for item in spec if isinstance(spec, tuple) else (spec,):
        found = getattr(item, "caller_fields", None)
        if found is None:  # a rule whose match block holds them
            found = getattr(getattr(item, "match", None), "caller_fields", ())
        yield from found


def _check_callers(policies: Sequence[Policy], errors: list[PolicyError]) -> None:
    """A set without ``spec.identity`` verifies no caller: every call's user is empty, so a
    field naming users matches no call (``{user}`` in a rate-limit key is ``-``, one bucket for
    all, which is allowed). What never matches is an error, as an empty list or an upper-case
    verb is, rather than a rule that silently applies to nobody."""
    for policy in policies:
        for spec in policy.sections.values():
            for where in _caller_fields(spec):
                errors.append(PolicyError(where.file, where.line, (
                    f"{where.path} never matches: no policy of the set has spec.identity, "
                    "so no caller is verified")))


def load_policy_set(paths: Sequence[str | Path], *,
                    parsers: Mapping[str, SectionParser]) -> PolicySet:
    """Read, parse and validate every policy file; raise :class:`PolicyLoadError` listing every
    problem in every file when any is invalid."""
    files, errors, digest = read_policy_files(paths)
    return build_policy_set(files, parsers=parsers, digest=digest, errors=errors)


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


class PolicyStore:
    """The active :class:`PolicySet` and how it got there.

    ``current`` starts as :data:`EMPTY` and is only ever replaced whole by :meth:`reload`; read
    it once per request and keep that reference. ``last_error`` is the text of the most recent
    failed load (kept after a later success, with ``last_error_at``); ``failing`` says whether
    the files as they are now fail to validate.
    """

    def __init__(self, paths: Sequence[str | Path], *,
                 parsers: Mapping[str, SectionParser]) -> None:
        self.paths: tuple[str, ...] = tuple(str(p) for p in paths)
        self.parsers = MappingProxyType(dict(parsers))
        self.current: PolicySet = EMPTY
        self.loaded = False
        self.failing = False
        self.last_error = ""
        self.last_error_at: float | None = None
        self.last_loaded_at: float | None = None
        self.seen_digest = ""  # digest of the files at the last attempt, good or bad
        self._lock = threading.Lock()

    def changed(self) -> bool:
        """Whether the files differ from what the last reload saw (a cheap read, no parsing)."""
        return read_policy_files(self.paths)[2] != self.seen_digest

    def reload(self) -> bool:
        """Read and validate the files; swap them in when valid. Safe to call from any thread.

        Returns whether the active set matches the files: ``True`` after a swap or when the
        files are the ones already active, ``False`` when they fail to validate.
        """
        with self._lock:
            files, errors, digest = read_policy_files(self.paths)
            if digest == self.seen_digest:
                telemetry.POLICY_RELOADS.labels(result="unchanged").inc()
                return not self.failing
            self.seen_digest = digest
            try:
                new = build_policy_set(files, parsers=self.parsers, digest=digest, errors=errors)
            except Exception as exc:
                if isinstance(exc, PolicyLoadError):
                    failure = exc
                else:  # a bug, but these files failed: say so, or the next reload would find
                    # them "unchanged" and report the set as good
                    log.exception("policy validation crashed")
                    failure = PolicyLoadError([PolicyError(
                        ", ".join(self.paths), 0, f"could not be validated ({exc!r})")])
                self.failing = True
                self.last_error = str(failure)
                self.last_error_at = time.time()
                telemetry.POLICY_RELOADS.labels(result="error").inc()
                log.error("policy reload failed, keeping the active set (%s): %d error(s)\n%s",
                          self.current.digest[:12] or "none", len(failure.errors), failure,
                          extra=KEEP_LINES)
                return False
            self.current = new  # the atomic swap: requests that already hold the old set keep it
            self.loaded = True
            self.failing = False
            self.last_loaded_at = new.loaded_at
            telemetry.POLICY_RELOADS.labels(result="success").inc()
            log.info("loaded %d policies from %d files (sha256 %s)",
                     len(new.policies), len(new.files), digest[:12])
            return True

    def describe(self) -> dict[str, Any]:
        """What ``/debug/policies`` shows (JSON-ready)."""
        current = self.current
        return {
            "loaded": self.loaded,
            "failing": self.failing,
            "paths": list(self.paths),
            "digest": current.digest,
            "files": list(current.files),
            "loaded_at": _iso(self.last_loaded_at),
            "policies": [
                {"name": p.name, "mode": p.mode, "failure": p.failure, "source": p.source,
                 "sections": list(p.sections), "allow_impersonation": p.allow_impersonation}
                for p in current.policies
            ],
            "last_error": self.last_error or None,
            "last_error_at": _iso(self.last_error_at),
        }
