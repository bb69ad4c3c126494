"""Status bodies look exactly like the apiserver's, so kubectl and client-go decode them."""

from __future__ import annotations

import json
import re

import pytest

from proxy.engine import status
from proxy.engine.context import RequestContext
from proxy.engine.requestinfo import parse_request_info


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


def _warn_texts(ctx: RequestContext) -> list[str]:
    """The warn-texts of the call's ``Warning`` headers, unquoted as client-go does."""
    texts = []
    for name, value in ctx.response_headers:
        if name == "Warning":
            assert value.startswith('299 - "') and value.endswith('"'), value
            texts.append(value[7:-1].replace('\\"', '"').replace("\\\\", "\\"))
    return texts


def _ctx() -> RequestContext:
    return RequestContext(info=parse_request_info("GET", "/version", ""), method="GET",
                          path="/version", query="", headers={},
                          policies=None)  # type: ignore[arg-type]


def test_a_warning_given_twice_is_sent_once() -> None:
    # the apiserver's warning recorder drops a text it already sent (k8s.io/apiserver's
    # filters/warning.go); client-go would print it twice
    ctx = _ctx()
    for text in ("a", "b", "a"):
        ctx.warn(text)
    assert _warn_texts(ctx) == ["opgate: a", "opgate: b"]


def test_warnings_within_4096_characters_are_sent_whole() -> None:
    ctx = _ctx()
    texts = [f"{i} " + "x" * 1000 for i in range(4)]  # 4 x 1010 characters with "opgate: "
    for text in texts:
        ctx.warn(text)
    assert _warn_texts(ctx) == [f"opgate: {text}" for text in texts]


def test_warnings_past_4096_characters_are_cut_to_256_each_as_the_apiserver_cuts_them() -> None:
    """A dryrun identity warning names the path: a long one made a header line an aiohttp
    client (kopf: at most 8190 bytes a line) refused, failing the call a dryrun must not fail.
    The apiserver's recorder: once the texts pass 4096 runes, each is cut to its first 256
    (those before too) and, once 4096 are sent, later ones are dropped."""
    ctx = _ctx()
    long = 'would deny (dryrun): cannot get path "/version/' + "a" * 9000 + '"'
    ctx.warn("short one")
    ctx.warn(long)
    ctx.warn("short two")
    assert _warn_texts(ctx) == ["opgate: short one", f"opgate: {long}"[:256], "opgate: short two"]
    assert all(len(value) < 300 for name, value in ctx.response_headers if name == "Warning")

    many = _ctx()
    for i in range(40):
        many.warn(f"{i:02d} " + "y" * 300)
    sent = _warn_texts(many)
    assert sent == [f"opgate: {i:02d} " + "y" * 245 for i in range(len(sent))]
    assert len(sent) == 16  # 16 x 256 = 4096: the 17th is dropped


def test_a_cut_warning_never_ends_inside_an_escape() -> None:
    # the text is cut as kubectl prints it (non-ASCII percent-encoded), never inside a
    # percent-encoding, and quoted after the cut (a cut between a backslash and the quote it
    # escapes would end the quoted string early)
    for pad in range(8, 12):
        ctx = _ctx()
        ctx.warn("x" * 4000)
        ctx.warn("z" * pad + '"\u20ac' * 200)
        _, value = [h for h in ctx.response_headers if h[0] == "Warning"][1]
        quoted = value[len('299 - "'):-1]
        assert len(quoted.replace('\\"', '"')) <= 256  # as kubectl prints it
        assert not re.search(r'(?<!\\)(\\\\)*"', quoted), quoted  # no quote left unescaped
        assert not re.search(r"%.?$", quoted) and not quoted.endswith("\\"), quoted
