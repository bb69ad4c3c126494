"""What may differ between the same call made directly and through opgate: exactly this, no more.

The e2e tier runs each command twice, against kube-apiserver and through opgate, and compares
the outputs byte for byte after these substitutions. Each one is a value the apiserver itself
assigns per write or per moment, so two honest runs differ in it:

- ``resourceVersion`` (objects, lists, watch events) and list ``continue`` tokens (which embed it)
- ``uid`` of objects
- ``creationTimestamp``, ``deletionTimestamp`` and ``managedFields[].time``
- in tables, the AGE column (``5s``, ``2m3s``, ``<unknown>``)
- in ``too old resource version: A (B)`` messages, the numbers

Everything else (field order, indentation, names, labels, annotations, managedFields entries,
Status bodies, headers we compare) must be identical. The substitutions work on the text, so a
difference in formatting or ordering still shows.
"""

from __future__ import annotations

import re
from typing import Any

PLACEHOLDER = "<normalized>"

VOLATILE_KEYS = ("resourceVersion", "uid", "creationTimestamp", "deletionTimestamp", "time",
                 "continue")
_KEYS = "|".join(VOLATILE_KEYS)
# JSON: "key": "value"  (also compact "key":"value")
_JSON_RE = re.compile(rf'("(?:{_KEYS})":\s*)"[^"]*"')
# YAML: key: value  or  key: "value"  or  - key: value  (managedFields is a list of maps)
_YAML_RE = re.compile(rf"^(\s*(?:- )?(?:{_KEYS}):)[ ]+\S.*$", re.MULTILINE)
# kubectl table ages: 5s 2m3s 10m 3h4m 2d <unknown>; only whole whitespace-separated tokens
_AGE_RE = re.compile(r"(?<!\S)(?:(?:\d+[dhms])+|<unknown>)(?!\S)")
_TOO_OLD_RE = re.compile(r"too old resource version: \d+ \(\d+\)")


def json_text(text: str) -> str:
    """Blank the volatile values in JSON text (kubectl ``-o json``, raw API bodies)."""
    return _too_old(_JSON_RE.sub(rf'\1"{PLACEHOLDER}"', text))


def yaml_text(text: str) -> str:
    """Blank the volatile values in kubectl ``-o yaml`` output."""
    return _too_old(_YAML_RE.sub(rf"\1 {PLACEHOLDER}", text))


def table_text(text: str) -> str:
    """Blank AGE-like tokens in kubectl's human-readable tables (widths may then differ, so
    runs of spaces are collapsed too)."""
    lines = (re.sub(r"[ ]{2,}", "  ", _AGE_RE.sub("<age>", line)).rstrip()
             for line in text.splitlines())
    return "\n".join(lines)


def obj(value: Any) -> Any:
    """The same for decoded JSON (dicts/lists): volatile keys set to the placeholder."""
    if isinstance(value, dict):
        return {k: (PLACEHOLDER if k in VOLATILE_KEYS and isinstance(v, str) else obj(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [obj(v) for v in value]
    if isinstance(value, str):
        return _too_old(value)
    return value


def _too_old(text: str) -> str:
    return _TOO_OLD_RE.sub("too old resource version: <n> (<n>)", text)
