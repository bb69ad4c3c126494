"""The WebSocket bearer-token subprotocol, read as k8s.io/apiserver's ``request/websocket``
authenticator reads it (``protocol.go``), and as the relays test for it."""

from __future__ import annotations

import base64

import pytest

from proxy.engine.subprotocol import PREFIX, carries_token, is_websocket, subprotocol_token
from proxy.relay.fast.wire import WireHeaders

WS = {"Upgrade": "websocket", "Connection": "Upgrade"}


def b64(token: bytes) -> str:
    return base64.urlsafe_b64encode(token).rstrip(b"=").decode()


TOK = PREFIX + b64(b"tok")


@pytest.mark.parametrize(("headers", "websocket"), [
    (WS, True),
    ({"Upgrade": "WebSocket", "Connection": "keep-alive, Upgrade"}, True),
    ({"Upgrade": " websocket ", "Connection": "upgrade,keep-alive"}, True),
    ({"Upgrade": "websocket", "Connection": "keep-alive,\tupgrade"}, True),
    ({"Upgrade": "websocket"}, False),
    ({"Upgrade": "websocket", "Connection": "close"}, False),
    ({"Upgrade": "websocket", "Connection": "upgrade-insecure"}, False),
    ({"Upgrade": "websocket", "Connection": "noupgrade"}, False),
    ({"Upgrade": "websocket, h2c", "Connection": "Upgrade"}, False),  # Upgrade as a whole
    ({"Upgrade": "SPDY/3.1", "Connection": "Upgrade"}, False),
    ({"Connection": "Upgrade"}, False),
])
def test_a_websocket_request_is_the_apiservers(headers: dict[str, str], websocket: bool) -> None:
    """wsstream.IsWebSocketRequest: Upgrade equal to websocket in any case, and the Connection
    value (lower-cased) matching ``(^|.*,\\s*)upgrade($|\\s*,)``."""
    assert is_websocket(headers) is websocket


@pytest.mark.parametrize(("protocols", "token"), [
    (f"{TOK}, v5.channel.k8s.io", "tok"),
    (f"v4.channel.k8s.io,{TOK}", "tok"),
    (f"  {TOK}  ,v4.channel.k8s.io", "tok"),  # each protocol trimmed
    (f"{TOK},", "tok"),  # the empty protocol after the comma counts as another (Go's Split)
    (f"{PREFIX}{b64(b'jwt.a-b_c')}, x", "jwt.a-b_c"),
    (f"{PREFIX}{b64('tök'.encode())}, x", "tök"),  # any UTF-8
    (f"{PREFIX}YR, x", "a"),  # trailing bits are not checked (not strict base64)
    (f"{PREFIX}, x", None),  # an empty token is no token: anonymous
    ("v4.channel.k8s.io", None),
    (f"Base64url.bearer.authorization.k8s.io.{b64(b'tok')}, x", None),  # the prefix's case
    (f"x {TOK}, y", None),  # not at the start of the protocol
])
def test_the_token_is_the_apiservers(protocols: str, token: str | None) -> None:
    assert subprotocol_token({**WS, "Sec-WebSocket-Protocol": protocols}) == token


@pytest.mark.parametrize(("protocols", "message"), [
    (TOK, "missing additional subprotocol"),
    (f"{TOK}, {TOK}, x", "multiple base64.bearer.authorization tokens specified"),
    (f"{PREFIX}, {TOK}, x", "multiple base64.bearer.authorization tokens specified"),
    (f"{PREFIX}dG9r=, x", "invalid base64.bearer.authorization token encoding"),  # padding
    (f"{PREFIX}dG9rZQ==, x", "invalid base64.bearer.authorization token encoding"),
    (f"{PREFIX}a+b/, x", "invalid base64.bearer.authorization token encoding"),  # std alphabet
    (f"{PREFIX}dG9rZ, x", "invalid base64.bearer.authorization token encoding"),  # 5 chars
    (f"{PREFIX}dG 9r, x", "invalid base64.bearer.authorization token encoding"),
    (f"{PREFIX}{b64(bytes([0xff, 0xfe]))}, x", "invalid base64.bearer.authorization token"),
    (f"{PREFIX}!!, {TOK}, x", "invalid base64.bearer.authorization token encoding"),  # first
])
def test_what_the_apiserver_refuses(protocols: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        subprotocol_token({**WS, "Sec-WebSocket-Protocol": protocols})
    assert str(refused.value) == message


def test_only_a_websocket_upgrade_has_one() -> None:
    protocols = {"Sec-WebSocket-Protocol": f"{TOK}, x"}
    assert subprotocol_token(protocols) is None
    assert subprotocol_token({**protocols, "Upgrade": "SPDY/3.1",
                              "Connection": "Upgrade"}) is None
    assert subprotocol_token({**protocols, "Upgrade": "websocket"}) is None
    # and what the apiserver refuses there it does not look at
    assert subprotocol_token({"Sec-WebSocket-Protocol": TOK}) is None


def test_every_protocol_header_counts() -> None:
    """RFC 6455: repeated Sec-WebSocket-Protocol headers are one list (as the fast relay's
    headers and aiohttp's hold them)."""
    pairs = [(b"Upgrade", b"websocket"), (b"Connection", b"Upgrade"),
             (b"Sec-WebSocket-Protocol", b"v5.channel.k8s.io"),
             (b"sec-websocket-protocol", TOK.encode())]
    assert subprotocol_token(WireHeaders(pairs)) == "tok"
    pairs.append((b"Sec-WebSocket-Protocol", TOK.encode()))
    with pytest.raises(ValueError, match="multiple"):
        subprotocol_token(WireHeaders(pairs))
    # alone in its header, with the other protocol in another: not missing
    assert subprotocol_token(WireHeaders(pairs[:4])) == "tok"


@pytest.mark.parametrize(("value", "carries"), [
    (TOK.encode(), True), (f"v4.channel.k8s.io, {TOK}".encode(), True),
    (TOK.upper().encode(), True), (f"{PREFIX}".encode(), True),
    (b"v4.channel.k8s.io", False), (b"base64.channel.k8s.io", False), (b"", False),
])
def test_the_relays_see_any_token_subprotocol(value: bytes, carries: bool) -> None:
    assert carries_token(value) is carries
    assert carries_token(value.decode()) is carries
