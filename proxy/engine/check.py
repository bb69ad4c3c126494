"""``opgate check PATH``: validate policy files offline, the same way a reload would.

The CLI prints what :func:`check` returns, one ``file:line: message`` per line, and exits 1 when
there is anything to print (0 otherwise). Nothing here prints or touches the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from proxy.engine.policies import PolicyLoadError, load_policy_set
from proxy.engine.schema import SectionParser


def check(paths: Sequence[str | Path], *, parsers: Mapping[str, SectionParser]) -> list[str]:
    """Every problem in the policy files at ``paths`` as ``file:line: message``; ``[]`` = valid.

    ``parsers`` must be the section parsers of the middlewares this build serves with, so that a
    file passes here exactly when ``opgate serve`` would load it.
    """
    try:
        load_policy_set(paths, parsers=parsers)
    except PolicyLoadError as exc:
        return [str(error) for error in exc.errors]
    return []
