"""The identity middleware and the WebSocket bearer-token subprotocol: the token a browser sends
as ``base64url.bearer.authorization.k8s.io.<token>`` is the caller's, in the apiserver's order
(``Authorization`` first), and with both a second token may not name another user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.engine.context import Identity, RequestContext
from proxy.engine.requestinfo import parse_request_info
from proxy.engine.subprotocol import PREFIX
from proxy.middlewares.identity import IdentityCheck
from proxy.relay.fast.wire import WireHeaders
from tests.unit import test_identity as ti
from tests.unit.test_subprotocol import b64

WATCH = "/api/v1/namespaces/team-a/configmaps"
EXEC = "/api/v1/namespaces/team-a/pods/p/exec"
OP = "system:serviceaccount:ops:op"


def ws_ctx(policies: Any, *, protocols: str | None, authorization: str | None = None,
           upgrade: bool = True, path: str = WATCH, wire: bool = False) -> RequestContext:
    headers = {"Host": "h"}
    if upgrade:
        headers |= {"Upgrade": "websocket", "Connection": "Upgrade",
                    "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZQ=="}
    if protocols is not None:
        headers["Sec-WebSocket-Protocol"] = protocols
    if authorization is not None:
        headers["Authorization"] = authorization
    mapping: Any = headers
    if wire:
        mapping = WireHeaders([(k.encode(), v.encode()) for k, v in headers.items()])
    return RequestContext(info=parse_request_info("GET", path, "watch=true"), method="GET",
                          path=path, query="watch=true", headers=mapping, policies=policies)


def proto(token: str) -> str:
    return f"{PREFIX}{b64(token.encode())}, v4.channel.k8s.io"


@pytest.mark.parametrize("wire", [False, True])
def test_a_websocket_subprotocol_token_is_the_caller(tmp_path: Path, wire: bool) -> None:
    check, policies = IdentityCheck(authenticator=ti.FakeAuth()), ti.policy_set(tmp_path,
                                                                                  ti.policy())
    for _ in range(2):  # and again from the cache
        ctx = ws_ctx(policies, protocols=proto(ti.sa_token()), wire=wire)
        assert ti.run(check, ctx) is None
        assert ctx.identity is not None and ctx.identity.user == OP


def test_an_opaque_subprotocol_token_goes_to_a_token_review(tmp_path: Path) -> None:
    auth = ti.FakeAuth()
    auth.reviews["opaque"] = (Identity(user="admin", groups=("system:masters",)), ())
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    ctx = ws_ctx(policies, protocols=proto("opaque"))
    assert ti.run(check, ctx) is None and ctx.identity is not None
    assert ctx.identity.user == "admin" and auth.calls == ["review"]
    refused = ti.run(check, ws_ctx(policies, protocols=proto("unknown")))
    assert refused is not None and ti.body(refused)["code"] == 401
    assert "the apiserver does not accept it" in ti.body(refused)["message"]


def test_not_without_a_websocket_upgrade(tmp_path: Path) -> None:
    """The apiserver reads the subprotocol only on a WebSocket upgrade request."""
    check, policies = IdentityCheck(authenticator=ti.FakeAuth()), ti.policy_set(tmp_path,
                                                                                  ti.policy())
    decision = ti.run(check, ws_ctx(policies, protocols=proto(ti.sa_token()), upgrade=False))
    assert decision is not None and ti.body(decision)["code"] == 401
    assert "no bearer token" in ti.body(decision)["message"]


@pytest.mark.parametrize(("protocols", "message"), [
    (f"{PREFIX}{b64(b'tok')}", "missing additional subprotocol"),
    (f"{PREFIX}dG9r=, x", "invalid base64.bearer.authorization token encoding"),
    (f"{PREFIX}{b64(bytes([0xff]))}, x", "invalid base64.bearer.authorization token"),
    (f"{PREFIX}{b64(b'a')}, {PREFIX}{b64(b'b')}, x",
     "multiple base64.bearer.authorization tokens specified"),
])
def test_a_subprotocol_the_apiserver_refuses_is_401(tmp_path: Path, protocols: str,
                                                    message: str) -> None:
    auth = ti.FakeAuth()
    check, policies = IdentityCheck(authenticator=auth), ti.policy_set(tmp_path, ti.policy())
    decision = ti.run(check, ws_ctx(policies, protocols=protocols))
    assert decision is not None and decision.decision == "unauthorized"
    got = ti.body(decision)
    assert got["code"] == 401 and f"invalid bearer token: {message} (policy" in got["message"]
    assert auth.calls == []


@pytest.mark.parametrize("authorization", ["Basic dTpw", "Bearer  two-spaces",
                                           f"Bearer {ti.forged('none')}", "Bearer unknown"])
def test_the_subprotocol_when_authorization_does_not_authenticate(
        tmp_path: Path, authorization: str) -> None:
    """The apiserver's union: the bearer token first; when it has none or it does not
    authenticate, the subprotocol's."""
    check, policies = IdentityCheck(authenticator=ti.FakeAuth()), ti.policy_set(tmp_path,
                                                                                  ti.policy())
    ctx = ws_ctx(policies, protocols=proto(ti.sa_token()), authorization=authorization)
    assert ti.run(check, ctx) is None
    assert ctx.identity is not None and ctx.identity.user == OP


@pytest.mark.parametrize("wire", [False, True])
def test_authorization_first_and_a_second_token_of_another_user_is_401(
        tmp_path: Path, wire: bool) -> None:
    """Authorization's token authenticates: it is the caller; a subprotocol token of the same
    token or user changes nothing, one of another user is refused (the apiserver, refusing
    the first one, would run the call as the second), also when the first one's shape is
    remembered."""
    check, policies = IdentityCheck(authenticator=ti.FakeAuth()), ti.policy_set(tmp_path,
                                                                                  ti.policy())
    mine = ti.sa_token()
    warm = ti.ctx_for(policies, "GET", WATCH, mine, query="watch=true")
    assert ti.run(check, warm) is None  # the shape of a watch is now remembered for it
    for other in (mine, ti.sa_token(exp_in=900)):  # the same token, another of the same SA
        ctx = ws_ctx(policies, protocols=proto(other), authorization=f"Bearer {mine}",
                     wire=wire)
        assert ti.run(check, ctx) is None and ctx.identity is not None
        assert ctx.identity.user == OP
    intruder = ti.sa_token(name="intruder")
    for first, second in ((mine, intruder), (intruder, mine)):
        decision = ti.run(check, ws_ctx(policies, protocols=proto(second),
                                        authorization=f"Bearer {first}", wire=wire))
        assert decision is not None
        got = ti.body(decision)
        assert got["code"] == 401 and "tokens of different users" in got["message"]
    # a second token that does not authenticate leaves the first the caller
    ctx = ws_ctx(policies, protocols=proto(ti.sa_token(exp_in=-120)),
                 authorization=f"Bearer {mine}", wire=wire)
    assert ti.run(check, ctx) is None and ctx.identity is not None
