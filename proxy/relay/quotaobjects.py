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

__all__ = ["Count", "canonical", "hard_counts", "parse_limit", "selects"]

_QUANTITY = re.compile(r"([+-]?[0-9.]+)((?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "m": Decimal("0.001")}


_BINARY = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


def canonical(value: Decimal, suffix: str) -> str:
    """A quantity as the apiserver prints it (``Quantity.String``), from its value and the
    suffix it was written with, which sets its format: binary (``Ki``…, shown so only when it
    is a whole number of at least 1024), an exponent (``e3``), else decimal SI. The digits are
    an integer, the exponent a multiple of 3 (``1000`` is ``1k``, ``1.5`` is ``1500m``)."""
    if value == 0:
        return "0"
    if suffix in _BINARY and value >= 1024 and value == value.to_integral_value():
        number, power = int(value), 0
        while number % 1024 == 0 and power < len(_BINARY):
            number //= 1024
            power += 1
        return f"{number}{_BINARY[power - 1] if power else ''}"
    _sign, digits, exponent = value.normalize().as_tuple()
    assert isinstance(exponent, int)  # a finite value
    mantissa = int("".join(map(str, digits))) * 10 ** (exponent % 3)
    exponent -= exponent % 3
    if suffix[:1] in ("e", "E") and suffix[1:]:
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{_DECIMAL.get(exponent, f'e{exponent}')}"


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
    ``None`` when it is not one. Its text is :func:`canonical`, what the apiserver's denial
    prints: a ResourceQuota's quantities come so from the apiserver, but a
    ClusterResourceQuota (a custom resource on OpenShift) keeps the spelling it was written
    with, which OpenShift's admission prints canonically too."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return Count(raw) if raw >= 0 else None
    if not isinstance(raw, str):
        return None
    text = raw.strip()
    m = _QUANTITY.fullmatch(text)
    if m is None or m.group(3) not in _SUFFIXES or (m.group(2) and m.group(3)):
        return None
    try:
        value = Decimal(m.group(1) + m.group(2)) * _SUFFIXES[m.group(3)]
    except InvalidOperation:
        return None
    if value < 0:
        return None
    return Count(int(value.to_integral_value(rounding="ROUND_FLOOR")),
                 canonical(value, m.group(2) or m.group(3)))


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
