"""What opgate needs to know about API groups and instance annotations, shared by the rate-limit
middleware (which decides) and the relay's informer (which watches custom resources).
"""

from __future__ import annotations

import math

# the smallest rate a bucket takes: one token in ~31.7 years (an emission interval of 1e15 µs,
# still exact as a double in gcra.lua). Below it the bucket's arithmetic leaves what Redis takes
# (PEXPIRE refuses the expiry: every decision an error, and the breaker trips for every rule)
MIN_QPS = 1e-9
MAX_QPS = 1e6  # one token a µs, the interval's unit
MAX_BURST = 1_000_000  # with MIN_QPS, a full bucket spans 1e21 µs: PEXPIRE's ms still fit int64

# API groups served by kube-apiserver itself that do not end in ".k8s.io"
BUILTIN_GROUPS = frozenset({"", "apps", "batch", "autoscaling", "policy", "extensions"})


def is_custom_group(group: str) -> bool:
    """Whether an API group can hold custom resources (not core, not ``*.k8s.io``, not apps…)."""
    return group not in BUILTIN_GROUPS and not group.endswith(".k8s.io") and group != "k8s.io"


def parse_qps(raw: object) -> float | None:
    """An annotation's qps: a finite number of at least ``MIN_QPS`` written as a string, else
    ``None`` (the rule's own qps then applies: whoever may annotate an instance must not be
    able to break the buckets of every other caller)."""
    try:
        value = float(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= MIN_QPS else None
