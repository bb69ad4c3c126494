"""Grouped, immutable settings for ``opgate serve``, read from flags and ``OPGATE_*`` variables.

Every flag ``--some-flag`` can also be given as ``OPGATE_SOME_FLAG`` (the flag wins). The groups
mirror the parts they configure, so each part receives only its own settings. With
``--workers N`` the supervisor hands the settings to its workers as JSON (:meth:`Settings.to_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from proxy.relay.hostguard import DEFAULT_ACCEPT_HOSTS


@dataclass(frozen=True, slots=True)
class ListenSettings:
    listen: str = "127.0.0.1:8001"  # HOST:PORT, [V6]:PORT or unix:/path
    tls_cert: str | None = None
    tls_key: str | None = None
    admin_listen: str = "127.0.0.1:9091"
    # comma-separated regular expressions of the Host names the API listener answers (as
    # kubectl proxy's; proxy.relay.hostguard)
    accept_hosts: str = DEFAULT_ACCEPT_HOSTS


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    url: str | None = None
    kubeconfig: str | None = None
    ca_file: str | None = None
    insecure: bool = False
    token_file: str | None = None
    connect_timeout: float = 5.0
    header_timeout: float = 30.0
    request_timeout: float = 300.0
    watch_idle_timeout: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicySettings:
    paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RateLimitSettings:
    redis_url: str | None = None
    redis_password_file: str | None = None
    redis_timeout: float = 0.05
    replicas: int = 1


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "info"
    access_log: bool = True
    audit_log: str | None = None  # a file, "-" for stdout; None: no audit log
    audit_log_maxsize: int = 100  # MB before the audit log is rotated (0: never)
    audit_log_maxbackup: int = 5  # rotated audit logs kept (0: all)
    capture: str | None = None  # a mitmproxy flow file for traffic capture; None: no capture
    capture_maxsize: int = 100  # MB before the capture file is rotated (0: never)
    capture_maxbackup: int = 5  # rotated capture files kept (0: all)


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    workers: int = 1  # > 1: a supervisor process and this many worker processes
    loop: str = "auto"  # auto (uvloop when importable) | asyncio | uvloop
    relay: str = "fast"  # fast (asyncio protocols + httptools) | aiohttp
    shutdown_grace: float = 10.0  # seconds the calls in flight get after SIGTERM


@dataclass(frozen=True, slots=True)
class Settings:
    listen: ListenSettings = field(default_factory=ListenSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    policies: PolicySettings = field(default_factory=PolicySettings)
    ratelimit: RateLimitSettings = field(default_factory=RateLimitSettings)
    log: LogSettings = field(default_factory=LogSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def to_json(self) -> str:
        """The settings as JSON, for handing them to worker processes."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        raw = json.loads(text)
        return cls(
            listen=ListenSettings(**raw["listen"]),
            upstream=UpstreamSettings(**raw["upstream"]),
            policies=PolicySettings(paths=tuple(raw["policies"]["paths"])),
            ratelimit=RateLimitSettings(**raw["ratelimit"]),
            log=LogSettings(**raw["log"]),
            runtime=RuntimeSettings(**raw["runtime"]),
        )
