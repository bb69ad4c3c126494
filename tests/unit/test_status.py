"""Status bodies look exactly like the apiserver's, so kubectl and client-go decode them."""

from __future__ import annotations

import json

import pytest

from proxy.engine import status


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (status.bad_request("no"), 400, "BadRequest"),
        (status.unauthorized(), 401, "Unauthorized"),
        (status.forbidden("rule r in p.yaml denies"), 403, "Forbidden"),
        (status.too_many_requests("slow down", retry_after=0.2), 429, "TooManyRequests"),
        (status.internal_error("boom"), 500, "InternalError"),
        (status.service_unavailable("apiserver unreachable"), 503, "ServiceUnavailable"),
        (status.gateway_timeout("apiserver slow"), 504, "Timeout"),
    ],
)
def test_status_body_shape(error: status.StatusError, code: int, reason: str) -> None:
    body = json.loads(error.body())
    assert body["kind"] == "Status"
    assert body["apiVersion"] == "v1"
    assert body["status"] == "Failure"
    assert body["code"] == code == error.code
    assert body["reason"] == reason
    assert body["metadata"] == {}
    assert ("Content-Type", "application/json") in error.response_headers()
    assert code != 422


@pytest.mark.parametrize(("method", "path", "details"), [
    ("GET", "/api/v1/namespaces/a/configmaps/c", {"name": "c", "kind": "configmaps"}),
    ("GET", "/api/v1/namespaces/a/configmaps", {"kind": "configmaps"}),
    ("POST", "/apis/apps/v1/namespaces/a/deployments/d/scale",
     {"name": "d", "group": "apps", "kind": "deployments"}),
    ("GET", "/apis/apps/v1/deployments", {"group": "apps", "kind": "deployments"}),
    ("GET", "/healthz", {}),
])
def test_a_403_has_the_apiservers_details(method: str, path: str,
                                          details: dict[str, str]) -> None:
    """As ``apierrors.NewForbidden`` from the authorization attributes: name, group, and the
    resource (not the subresource) as ``kind``, in ``StatusDetails``' order; ``{}``, sent as
    such, for a non-resource path."""
    from proxy.engine.requestinfo import parse_request_info

    got = status.call_details(parse_request_info(method, path, ""))
    assert (got, list(got)) == (details, [k for k in ("name", "group", "kind") if k in details])
    body = json.loads(status.forbidden("opgate: no", details=got).body())
    assert body["details"] == details
    assert list(body) == ["kind", "apiVersion", "metadata", "status", "message", "reason",
                          "details", "code"]  # metav1.Status' order
    assert "details" not in json.loads(status.forbidden("opgate: no").body())


@pytest.mark.parametrize(("after", "header"), [(0.01, "1"), (1.0, "1"), (1.2, "2"), (30, "30")])
def test_retry_after_is_an_integer_of_at_least_one(after: float, header: str) -> None:
    error = status.too_many_requests("x", retry_after=after)
    assert dict(error.headers)["Retry-After"] == header
    assert json.loads(error.body())["details"] == {"retryAfterSeconds": int(header)}


def test_warning_header_quotes_like_rfc7234() -> None:
    name, value = status.warning_header('rule "w" would deny')
    assert name == "Warning"
    assert value == '299 - "opgate: rule \\"w\\" would deny"'


def test_warning_header_percent_encodes_what_would_break_a_head() -> None:
    # request text (a percent-decoded path, a user name) may hold CR LF or non-latin-1 text
    _, value = status.warning_header('path "/a\r\nX-Evil: 1" of Jos\xe9 \u20ac\tend')
    assert value == '299 - "opgate: path \\"/a%0D%0AX-Evil: 1\\" of Jos%C3%A9 %E2%82%AC%09end"'
    value.encode("ascii")


def test_warning_header_takes_lone_surrogates() -> None:
    # a token's claims are JSON, whose "\udcff" escapes decode to lone surrogates (no UTF-8)
    _, value = status.warning_header("user \udcff")
    assert value == '299 - "opgate: user %ED%B3%BF"'
