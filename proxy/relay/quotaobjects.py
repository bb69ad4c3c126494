"""What the quota counter reads in the apiserver's quota objects: the ``hard`` quantities of a
ResourceQuota or ClusterResourceQuota as object counts (:func:`parse_limit`, keeping the text
the apiserver prints in its denial), and whether a ClusterResourceQuota's selector picks a
namespace (:func:`selects`). Pure functions: the watches that feed them are
:mod:`proxy.relay.counts`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["Count", "hard_counts", "parse_limit", "selects"]

_QUANTITY = re.compile(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "m": Decimal("0.001")}


class Count(int):
    """An object-count limit (``int``), with its quantity as the apiserver prints it in a quota
    denial (``text``: ``"1k"``, ``"1Ki"``; ``""`` for a bare number, printed canonically)."""

    text: str

    def __new__(cls, value: int, text: str = "") -> Count:
        self = super().__new__(cls, value)
        self.text = text
        return self


def parse_limit(raw: object) -> Count | None:
    """A ``hard`` quantity (``"10"``, ``"1k"``, ``5``) as the most objects it admits: n objects
    fit while n <= the quantity (the apiserver compares quantities, so ``"1.5"`` admits one);
    ``None`` when it is not one. A typed quota's quantities come canonical from the apiserver,
    so their text is what its denial prints."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return Count(raw) if raw >= 0 else None
    if not isinstance(raw, str):
        return None
    text = raw.strip()
    m = _QUANTITY.fullmatch(text)
    if m is None or m.group(2) not in _SUFFIXES:
        return None
    try:
        value = Decimal(m.group(1)) * _SUFFIXES[m.group(2)]
    except InvalidOperation:
        return None
    if value < 0:
        return None
    return Count(int(value.to_integral_value(rounding="ROUND_FLOOR")), text)


def hard_counts(raw: object) -> dict[str, int]:
    """A quota's ``hard`` map: the keys whose value is an object count."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, int] = {}
    for key, value in raw.items():
        count = parse_limit(value)
        if count is not None and isinstance(key, str):
            out[key] = count
    return out


def _requirement(req: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = req.get("key", ""), req.get("operator", "")
    values = req.get("values") or ()
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # an operator this code does not know selects nothing


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str],
            annotations: Mapping[str, str]) -> bool:
    """Whether a ClusterResourceQuota's ``spec.selector`` (``labels``: a LabelSelector, null =
    every namespace; ``annotations``: all must be equal) selects a namespace."""
    if not selector:
        return False
    label_selector = selector.get("labels")
    if label_selector is not None:
        for key, value in (label_selector.get("matchLabels") or {}).items():
            if labels.get(key) != value:
                return False
        for req in label_selector.get("matchExpressions") or ():
            if not _requirement(req, labels):
                return False
    for key, value in (selector.get("annotations") or {}).items():
        if annotations.get(key) != value:
            return False
    return True
