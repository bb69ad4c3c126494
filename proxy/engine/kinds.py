"""What opgate needs to know about API groups and instance annotations, shared by the rate-limit
middleware (which decides) and the relay's informer (which watches custom resources).
"""

from __future__ import annotations

import math

# API groups served by kube-apiserver itself that do not end in ".k8s.io"
BUILTIN_GROUPS = frozenset({"", "apps", "batch", "autoscaling", "policy", "extensions"})


def is_custom_group(group: str) -> bool:
    """Whether an API group can hold custom resources (not core, not ``*.k8s.io``, not apps…)."""
    return group not in BUILTIN_GROUPS and not group.endswith(".k8s.io") and group != "k8s.io"


def parse_qps(raw: object) -> float | None:
    """An annotation's qps: a finite positive number written as a string, else ``None``."""
    try:
        value = float(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None
