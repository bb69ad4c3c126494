"""The answers to upstream failures (proxy/relay/errors.py): what the client reads in them."""

from __future__ import annotations

import errno

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict

from proxy.engine.context import RequestContext
from proxy.engine.policies import EMPTY
from proxy.engine.requestinfo import parse_request_info
from proxy.relay import errors

PATH = "/api/v1/namespaces/a/configmaps"


def _ctx() -> RequestContext:
    return RequestContext(info=parse_request_info("GET", PATH, ""), method="GET", path=PATH,
                          query="", headers=CIMultiDict(), policies=EMPTY, trace_id="t-1")


def _emfile() -> OSError:
    return OSError(errno.EMFILE, "Too many open files")


def _aiohttp_emfile() -> aiohttp.ClientConnectorError:
    key = ConnectionKey("127.0.0.1", 6443, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, _emfile())


@pytest.mark.parametrize("exc", [_emfile, _aiohttp_emfile], ids=["fast", "aiohttp"])
def test_out_of_descriptors_is_said_to_be_opgates_not_the_apiservers(exc: object) -> None:
    """A call that cannot get a descriptor for its upstream connection is answered 503 with
    Retry-After, naming opgate's open files limit: it said 'the apiserver is unavailable
    (OSError: Too many open files)', sending its reader to look at a healthy apiserver."""
    ctx = _ctx()
    status = errors.upstream_failed(exc(), ctx, "https://127.0.0.1:6443",  # type: ignore[operator]
                                    sent=False).status
    assert status.code == 503
    assert "apiserver is unavailable" not in status.message, status.message
    assert "opgate is out of file descriptors" in status.message, status.message
    assert "open files limit" in status.message, status.message
    assert "Retry-After" in dict(status.response_headers())
