"""Fault injection: parsing with file:line errors, matching, probability, answers, dryrun."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from proxy.engine import telemetry
from proxy.engine.chain import settle
from proxy.engine.check import check
from proxy.engine.context import Delay, Deny, RequestContext
from proxy.engine.policies import load_policy_set
from proxy.engine.requestinfo import parse_request_info
from proxy.middlewares import faults, identity_spec
from proxy.middlewares.faults import Faults

PARSERS = {faults.SECTION: faults.parse_section,
           identity_spec.SECTION: identity_spec.parse_section}  # users need an identity section
HEAD = "apiVersion: opgate.dev/v1alpha1\nkind: Policy\nmetadata: {name: chaos}\nspec:\n"


def policies(tmp_path: Path, body: str, *, mode: str = "enforce"):  # type: ignore[no-untyped-def]
    path = tmp_path / "chaos.yaml"
    path.write_text(HEAD + f"  mode: {mode}\n" + body)
    return load_policy_set([path], parsers=PARSERS)


def ctx_for(policy_set: object, method: str, path: str) -> RequestContext:
    return RequestContext(info=parse_request_info(method, path, ""), method=method, path=path,
                          query="", headers={}, policies=policy_set)  # type: ignore[arg-type]


CONFLICTS = """\
  faults:
    - name: widget-conflicts
      match: {verbs: [update], resources: [widgets]}
      respond: {code: 409}
"""
WIDGET = "/apis/demo.opgate.dev/v1/namespaces/a/widgets/w"


@pytest.mark.parametrize(("method", "path", "fires"), [
    ("PUT", WIDGET, True),
    ("GET", WIDGET, False),
    ("PUT", WIDGET + "/status", False),  # RBAC rules: widgets is not widgets/status
    ("PUT", "/api/v1/namespaces/a/configmaps/c", False),
])
def test_match(tmp_path: Path, method: str, path: str, fires: bool) -> None:
    ctx = ctx_for(policies(tmp_path, CONFLICTS), method, path)
    decision = asyncio.run(settle(Faults().entry(ctx)))
    assert isinstance(decision, Deny) is fires


def test_conflict_answer_is_an_apiserver_like_status(tmp_path: Path) -> None:
    ctx = ctx_for(policies(tmp_path, CONFLICTS), "PUT", WIDGET)
    decision = asyncio.run(settle(Faults().entry(ctx)))
    assert isinstance(decision, Deny)
    assert decision.decision == "fault"
    body = json.loads(decision.status.body())
    assert (body["code"], body["reason"], body["kind"]) == (409, "Conflict", "Status")
    assert "widget-conflicts" in body["message"]


@pytest.mark.parametrize(("respond", "method", "path", "reason"), [
    ("{code: 409}", "POST", "/api/v1/namespaces/a/configmaps", "AlreadyExists"),
    ("{code: 409}", "PUT", "/api/v1/namespaces/a/configmaps/c", "Conflict"),
    ("{code: 409}", "PATCH", "/api/v1/namespaces/a/configmaps/c", "Conflict"),
    ("{code: 409, reason: Conflict}", "POST", "/api/v1/namespaces/a/configmaps", "Conflict"),
])
def test_a_409_on_a_create_is_already_exists_as_the_apiservers(
        tmp_path: Path, respond: str, method: str, path: str, reason: str) -> None:
    """The apiserver's 409 to a create is ``AlreadyExists`` (client-go's ``IsAlreadyExists``,
    which controllers' create-or-get paths test; it names a POST's bare 409 so too), to an
    update or patch ``Conflict``; a ``reason`` given says otherwise."""
    p = policies(tmp_path, f"  faults:\n    - respond: {respond}\n")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, method, path))))
    assert isinstance(decision, Deny)
    assert json.loads(decision.status.body())["reason"] == reason


def test_a_403_has_the_details_of_the_apiservers_own(tmp_path: Path) -> None:
    """An injected 403 looks like the apiserver's Forbidden of the same call (name, group, the
    resource as kind); other codes get no details."""
    p = policies(tmp_path, "  faults:\n    - respond: {code: 403}\n")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, "PUT", WIDGET + "/status"))))
    assert isinstance(decision, Deny)
    body = json.loads(decision.status.body())
    assert (body["code"], body["reason"]) == (403, "Forbidden")
    assert body["details"] == {"name": "w", "group": "demo.opgate.dev", "kind": "widgets"}
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, "GET", "/version"))))
    assert isinstance(decision, Deny) and json.loads(decision.status.body())["details"] == {}
    decision = asyncio.run(settle(Faults().entry(ctx_for(
        policies(tmp_path, CONFLICTS), "PUT", WIDGET))))
    assert isinstance(decision, Deny) and "details" not in json.loads(decision.status.body())


def test_429_carries_an_integer_retry_after(tmp_path: Path) -> None:
    p = policies(tmp_path, "  faults:\n    - respond: {code: 429, retryAfter: 3s}\n")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, "GET", "/api/v1/pods"))))
    assert isinstance(decision, Deny)
    assert ("Retry-After", "3") in decision.status.headers


@pytest.mark.parametrize(("code", "method"), [
    (429, "GET"), (409, "POST"), (409, "PUT"), (500, "GET"), (403, "PUT"),
])
def test_a_reason_it_is_given_is_the_status_reason_whatever_the_code(
        tmp_path: Path, code: int, method: str) -> None:
    p = policies(tmp_path, f"  faults:\n    - respond: {{code: {code}, reason: Rehearsed}}\n")
    path = "/apis/demo.opgate.dev/v1/namespaces/a/widgets" + ("" if method == "POST" else "/w")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, method, path))))
    assert isinstance(decision, Deny)
    status = json.loads(decision.status.body())
    assert (status["code"], status["reason"]) == (code, "Rehearsed")


@pytest.mark.parametrize(("respond", "method", "retry_after", "details"), [
    ("{code: 503, retryAfter: 3s}", "GET", "3", {"retryAfterSeconds": 3}),
    ("{code: 504, retryAfter: 1500ms}", "GET", "2", {"retryAfterSeconds": 2}),
    ("{code: 500, retryAfter: 1s}", "GET", "1", {"retryAfterSeconds": 1}),
    ("{code: 403, retryAfter: 2s}", "PUT", "2",
     {"name": "w", "group": "demo.opgate.dev", "kind": "widgets", "retryAfterSeconds": 2}),
    ("{code: 503}", "GET", None, None),
    ("{code: 429}", "GET", "1", {"retryAfterSeconds": 1}),
])
def test_retry_after_is_sent_with_any_code_it_is_given_for(
        tmp_path: Path, respond: str, method: str, retry_after: str | None,
        details: dict[str, object] | None) -> None:
    """As the apiserver sends a Status whose ``details.retryAfterSeconds`` is set (its 504
    Timeout, its 500 ServerTimeout): with a ``Retry-After`` header, which client-go honours on a
    429 or a 5xx (it retries after it). A 503 rehearsing an outage without one is not retried;
    a 429 always has one."""
    p = policies(tmp_path, f"  faults:\n    - respond: {respond}\n")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, method, WIDGET))))
    assert isinstance(decision, Deny)
    assert dict(decision.status.headers).get("Retry-After") == retry_after
    assert json.loads(decision.status.body()).get("details") == details


def test_probability_uses_the_rng(tmp_path: Path) -> None:
    p = policies(tmp_path, "  faults:\n    - probability: 0.25\n      respond: {code: 500}\n")
    values = iter([0.1, 0.3, 0.2, 0.9])
    mw = Faults(rng=lambda: next(values))
    fired = [isinstance(asyncio.run(settle(mw.entry(ctx_for(p, "GET", "/api/v1/pods")))), Deny)
             for _ in range(4)]
    assert fired == [True, False, True, False]


def test_delay_only_relays_after_waiting(tmp_path: Path) -> None:
    p = policies(tmp_path, "  faults:\n    - match: {verbs: [list]}\n      delay: 250ms\n")
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, "GET", "/api/v1/pods"))))
    assert decision == Delay(0.25)


def test_delay_then_answer(tmp_path: Path) -> None:
    p = policies(tmp_path, "  faults:\n    - delay: 100ms\n      respond: {code: 503}\n")
    started = time.monotonic()
    decision = asyncio.run(settle(Faults().entry(ctx_for(p, "GET", "/api/v1/pods"))))
    assert time.monotonic() - started >= 0.1
    assert isinstance(decision, Deny) and decision.status.code == 503


@pytest.mark.parametrize("own", ["", "      mode: enforce\n"])  # a dryrun policy never denies
def test_dryrun_warns_and_never_fires(tmp_path: Path, own: str) -> None:
    ctx = ctx_for(policies(tmp_path, CONFLICTS + own, mode="dryrun"), "PUT", WIDGET)
    assert asyncio.run(settle(Faults().entry(ctx))) is None
    [(name, value)] = ctx.response_headers
    assert name == "Warning" and "widget-conflicts" in value and "dryrun" in value


def test_dryrun_counts_and_logs_the_fault_it_would_fire(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DESIGN.md: a dryrun policy "counts the would-be denial in metrics, logs it, and adds a
    Warning": the log is where a team rehearsing faults in dryrun reads what would have fired
    (quota, rate limits and identity log theirs)."""
    ctx = ctx_for(policies(tmp_path, CONFLICTS, mode="dryrun"), "PUT", WIDGET)
    before = telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "faults"}) or 0.0
    with caplog.at_level(logging.INFO, logger="opgate.faults"):
        assert asyncio.run(settle(Faults().entry(ctx))) is None
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "faults"}) == before + 1
    [record] = [r for r in caplog.records if r.name == "opgate.faults"]
    message = record.getMessage()
    assert "dryrun" in message and "widget-conflicts" in message and WIDGET in message


@pytest.mark.parametrize(("fault", "said", "denial"), [
    ("respond: {code: 409}", "would answer 409 Conflict (dryrun)", True),
    ("delay: 250ms", "would delay this call by 0.25s (dryrun)", False),
    ("delay: 100ms\n      respond: {code: 503}",
     "would delay this call by 0.1s, then answer 503 ServiceUnavailable (dryrun)", True),
])
def test_a_dryrun_fault_says_what_it_would_do(tmp_path: Path, fault: str, said: str,
                                              denial: bool) -> None:
    # it said only "would fire", and counted a fault that only delays as a would-be denial
    body = f"  faults:\n    - name: f\n      {fault}\n"
    ctx = ctx_for(policies(tmp_path, body, mode="dryrun"), "PUT", WIDGET)
    before = telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "faults"}) or 0.0
    assert asyncio.run(settle(Faults().entry(ctx))) is None
    [(header, value)] = ctx.response_headers
    assert header == "Warning"
    assert value == f'299 - "opgate: fault f of policy chaos {said}"', value
    assert telemetry.REGISTRY.get_sample_value(
        "opgate_dryrun_denials_total", {"middleware": "faults"}) == before + denial


def test_duplicate_names_are_reported_at_the_duplicate(tmp_path: Path) -> None:
    # they were reported at the line of the list, in the order of a set (varying by run)
    path = tmp_path / "chaos.yaml"
    path.write_text(HEAD + "  faults:\n" + "".join(
        f"    - {{name: {n}, respond: {{code: 500}}}}\n" for n in ("b", "a", "b", "a", "c")))
    start = HEAD.count("\n") + 2  # the line of the first fault
    assert check([path], parsers=PARSERS) == [
        f'{path}:{start + 2}: spec.faults[2]: two faults are named "b" (also at {path}:{start})',
        f'{path}:{start + 3}: spec.faults[3]: two faults are named "a" '
        f"(also at {path}:{start + 1})"]


@pytest.mark.parametrize(("body", "message"), [
    ("  faults:\n    - match: {verbs: [get]}\n", "needs `respond`"),
    ("  faults:\n    - respond: {code: 200}\n", "code"),
    ("  faults:\n    - respond: {code: 500}\n      probability: 2\n", "probability"),
    ("  faults:\n    - respond: {code: 500, colour: red}\n", 'unknown field "colour"'),
    ("  faults:\n    - {name: a, respond: {code: 500}}\n    - {name: a, respond: {code: 500}}\n",
     'two faults are named "a"'),
])
def test_errors_have_file_and_line(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "chaos.yaml"
    path.write_text(HEAD + body)
    errors = check([path], parsers=PARSERS)
    assert errors, "the broken file was accepted"
    assert any(message in e for e in errors), errors
    assert all(e.startswith(f"{path}:") for e in errors), errors
