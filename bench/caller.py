"""The bench's caller: a ServiceAccount-shaped JWT, and the issuer documents that vouch for it.

The full chain verifies its caller (``spec.identity``), so every client of every path sends
``Authorization: Bearer <token>`` (the same header everywhere: no path gets a cheaper request).
For the static upstream the bench is its own issuer: an RSA key made with ``cryptography``, a
JWKS and an OIDC discovery document that nginx serves where the apiserver serves them
(``/openid/v1/jwks``, ``/.well-known/openid-configuration``), and a token shaped like a bound
service-account token (``iss``, ``sub`` = ``system:serviceaccount:bench:caller``, ``aud`` = the
issuer, ``exp``, the ``kubernetes.io`` claim) signed with pyjwt. On the real apiserver tier the
token comes from the TokenRequest API instead (a real ServiceAccount with RBAC to read).

``foreign_token`` is the same claims signed by a key the issuer never published: the full
chain must answer it 401, which shows the token is checked, not waved through.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

ISSUER = "https://kubernetes.default.svc.cluster.local"
NAMESPACE, NAME = "bench", "caller"
USER = f"system:serviceaccount:{NAMESPACE}:{NAME}"
DISCOVERY = "/.well-known/openid-configuration"
JWKS = "/openid/v1/jwks"
LIFETIME = 6 * 3600  # longer than any run; opgate re-verifies a cached token every 5 min anyway


@dataclass(frozen=True, slots=True)
class Caller:
    token: str
    foreign_token: str  # same claims, a key nobody published
    user: str = USER

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _claims(now: int) -> dict[str, object]:
    return {
        "iss": ISSUER, "sub": USER, "aud": [ISSUER], "iat": now, "nbf": now,
        "exp": now + LIFETIME, "jti": f"bench-{now}",
        "kubernetes.io": {"namespace": NAMESPACE,
                          "serviceaccount": {"name": NAME,
                                             "uid": "5b0e3e9a-bench-4c2f-9d41-0000caller00"}},
    }


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def write_issuer(root: Path) -> tuple[Caller, dict[str, Path]]:
    """Write the discovery document and the JWKS under ``root``; returns the caller and the
    files nginx serves, by URL path."""
    key, stranger = _key(), _key()
    kid = "bench-key-1"
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid=kid, use="sig", alg="RS256")
    files = {DISCOVERY: root / "openid-configuration.json", JWKS: root / "jwks.json"}
    files[DISCOVERY].write_text(json.dumps({
        "issuer": ISSUER, "jwks_uri": f"{ISSUER}{JWKS}", "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256"],
    }) + "\n")
    files[JWKS].write_text(json.dumps({"keys": [jwk]}) + "\n")
    claims = _claims(int(time.time()))
    token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})
    foreign = jwt.encode(claims, stranger, algorithm="RS256", headers={"kid": "bench-key-2"})
    return Caller(token, foreign), files


def foreign_like(token: str) -> str:
    """A token with the claims of ``token`` signed by a key its issuer never published."""
    header = jwt.get_unverified_header(token)
    claims = jwt.decode(token, options={"verify_signature": False})
    return jwt.encode(claims, _key(), algorithm="RS256",
                      headers={"kid": f"{header.get('kid', 'x')}-not-published"})
