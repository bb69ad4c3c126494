"""The arithmetic and the words of a quota check: which limit one more object exceeds, and the
apiserver's ResourceQuota admission message for it.

Pure functions of the numbers (no counts, no store), so the entry hook of
:class:`proxy.middlewares.quota.Quota` and its tests share them: :func:`effective_limit` is the
one number the store checks a create against, :func:`exceeded_limit` which limit a denied create
exceeds, and :func:`denial_message` prints it as the apiserver does (its decimal quantities,
:func:`format_count`; a ``generateName`` create's name, :func:`generate_name`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from proxy.middlewares.quota_spec import BoundQuota, count_key, legacy_key, qualified

__all__ = ["AlignedQuota", "Exceeded", "Shift", "denial_message", "effective_limit",
           "exceeded_limit", "format_count", "generate_name", "quota_keys"]

# k8s.io/apimachinery/pkg/util/rand: what names generated from generateName are made of
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATED_PREFIX = 63 - 5

AlignedQuota = tuple[str, str, Mapping[str, int]]
"""``(kind, name, hard)``: a ResourceQuota or ClusterResourceQuota and its count limits."""
Shift = Mapping[str, int]
"""Per key of an aligned quota, what it counts besides the namespace's objects and reservations
(a ClusterResourceQuota's other namespaces; less the finished pods, for ``pods``)."""


def generate_name(prefix: str, rng: random.Random | None = None) -> str:
    """A name as the apiserver generates it from ``generateName`` (``gen-7nlsj``)."""
    choice = (rng or random).choice
    return prefix[:_MAX_GENERATED_PREFIX] + "".join(choice(_NAME_ALPHABET) for _ in range(5))


_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")


def format_count(count: int) -> str:
    """A count as the apiserver prints a decimal quantity: canonical, so ``1000`` is ``1k``
    and ``1500`` stays ``1500`` (its quota controller writes ``used`` so, and a ``hard: 1000``
    reads back as ``1k``)."""
    if count == 0:
        return "0"
    power = 0
    while count % 1000 == 0 and power < len(_DECIMAL_SUFFIXES) - 1:
        count //= 1000
        power += 1
    return f"{count}{_DECIMAL_SUFFIXES[power]}"


def _limit_text(hard: int) -> str:
    """A limit as the apiserver prints it: an aligned quota's own quantity (its ``text``, as
    ``proxy.relay.quotaobjects.Count`` carries it: ``1Ki`` stays ``1Ki``), else canonically."""
    return getattr(hard, "text", "") or format_count(hard)


Exceeded = tuple[str, int, int]
"""``(key, hard, used)``: one limit a create exceeds, and what that key counts."""


def denial_message(group: str, resource: str, name: str, quota: str,
                   exceeded: Sequence[Exceeded]) -> str:
    """The apiserver's ResourceQuota admission message (``exceeded`` sorted by key; each key
    with its own used, as the quota's status holds them: ``count/pods=3,pods=2``)."""
    what = qualified(group, resource)
    subject = f'{what} "{name}"' if name else what
    requested = ",".join(f"{key}=1" for key, _, _ in exceeded)
    used = ",".join(f"{key}={format_count(count)}" for key, _, count in exceeded)
    limited = ",".join(f"{key}={_limit_text(hard)}" for key, hard, _ in exceeded)
    return (f"{subject} is forbidden: exceeded quota: {quota}, requested: {requested}, "
            f"used: {used}, limited: {limited}")


def exceeded_limit(
    b: BoundQuota, group: str, resource: str, used: int, aligned: Sequence[AlignedQuota],
    shifts: Sequence[Shift] = (),
) -> tuple[str, list[Exceeded]] | None:
    """``(quota name, [(key, hard, used)])`` of the smallest limit that one more object exceeds
    (the entry's own ``max`` on a tie), or ``None`` when the create fits. ``used`` is the
    namespace's objects and reservations; ``shifts[i]`` what each key of ``aligned[i]`` counts
    besides (a ClusterResourceQuota's other namespaces take room here, and its "used" is the
    sum, as OpenShift says it; ``pods`` leaves the finished pods out)."""
    keys = quota_keys(group, resource)
    found: list[tuple[int, int, str, list[Exceeded]]] = []
    if b.rule.max is not None and used + 1 > b.rule.max:
        found.append((b.rule.max, 0, b.quota_name, [(keys[0], b.rule.max, used)]))
    for order, (kind, name, hard) in enumerate(aligned, start=1):
        if kind not in b.rule.align_with:
            continue
        shift = shifts[order - 1] if order <= len(shifts) else {}
        counted = {k: used + shift.get(k, 0) for k in keys if k in hard}
        over = sorted((k, hard[k], n) for k, n in counted.items() if n + 1 > hard[k])
        if over:
            room = min(h - shift.get(k, 0) for k, h, _ in over)
            found.append((room, order, name, over))
    if not found:
        return None
    _, _, name, over = min(found, key=lambda f: (f[0], f[1]))
    return name, over


def quota_keys(group: str, resource: str) -> list[str]:
    """The names a quota may count the resource by: ``count/…``, and the legacy one."""
    legacy = legacy_key(group, resource)
    return [count_key(group, resource)] + ([legacy] if legacy else [])



def effective_limit(b: BoundQuota, group: str, resource: str,
                    aligned: Sequence[AlignedQuota], shifts: Sequence[Shift] = ()) -> int | None:
    """The most objects (and reservations) an entry lets the namespace hold: its ``max``, and
    its aligned quotas' hard counts less what each key counts besides (``shifts``, as for
    :func:`exceeded_limit`: a ``pods`` limit leaves room for the finished pods, which it does
    not count); ``None`` when nothing limits it here. One number, so a pod create reserves
    room in both pod counts in one store call."""
    keys = quota_keys(group, resource)
    limits = [b.rule.max] if b.rule.max is not None else []
    for i, (kind, _name, hard) in enumerate(aligned):
        if kind in b.rule.align_with:
            shift = shifts[i] if i < len(shifts) else {}
            limits.extend(max(0, hard[k] - shift.get(k, 0)) for k in keys if k in hard)
    return min(limits) if limits else None

