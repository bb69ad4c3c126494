"""Evidence that the full chain's identity middleware verifies the bench's caller, not skips it.

Before a tier's measures, each full-chain opgate gets three probe GETs of the small ConfigMap:
with the caller's token (must be 200), with no token (401) and with the caller's claims signed
by a key the issuer never published (401). After the tier, opgate's ``/metrics`` says how every
call it served was decided (``opgate_requests_total`` by ``decision`` and ``code``) and why
identity refused any (``opgate_identity_denials_total`` by ``reason``): the measured calls all
count as ``allowed``, and only the two bad probes as ``unauthorized``. The report prints both,
and the quota counter's state from ``/readyz?verbose`` (``configmaps=synced``) when the full
chain has a quota.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.paths import Target
from bench.upstreams import SMALL


def _status(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)


def scrape(target: Target) -> dict[str, Any]:
    """Calls by ``decision/code`` and identity denials by reason, from opgate's /metrics."""
    assert target.admin is not None
    with urllib.request.urlopen(target.admin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    calls: Counter[str] = Counter()
    denials: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "opgate_requests_total":
                calls[f"{sample.labels['decision']}/{sample.labels['code']}"] += int(sample.value)
            elif sample.name == "opgate_identity_denials_total":
                denials[sample.labels["reason"]] += int(sample.value)
    return {"calls": dict(sorted(calls.items())), "identity_denials": dict(sorted(denials.items())),
            "quota_counts": quota_state(target)}


def quota_state(target: Target) -> str | None:
    """The ``quota-counts`` line of opgate's ``/readyz?verbose``, if it has one."""
    assert target.admin is not None
    try:
        with urllib.request.urlopen(target.admin + "/readyz?verbose", timeout=10) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as err:
        text = err.read().decode()
    line = next((x for x in text.splitlines() if "quota-counts" in x), None)
    if line:
        return line.split("quota-counts", 1)[1].strip(" :")
    workers = [x for x in text.splitlines() if "]worker-" in x]  # a --workers supervisor
    if workers and all(x.startswith("[+]") for x in workers):
        return f"{len(workers)} workers ready (each counts on its own)"
    return None


def probe(target: Target) -> dict[str, Any]:
    """The three probe GETs; statuses by case."""
    caller = target.upstream.caller
    assert caller is not None
    url = target.url + SMALL
    return {
        "caller_token": _status(url, caller.headers),
        "no_token": _status(url, {}),
        "foreign_key": _status(url, {"Authorization": f"Bearer {caller.foreign_token}"}),
    }


def expected(probes: dict[str, Any]) -> bool:
    return probes == {"caller_token": 200, "no_token": 401, "foreign_key": 401}
