"""API keys: who may call /v1, and which prefix-cache salt a caller's requests get."""
from __future__ import annotations

import hashlib
import hmac


def bearer_token(authorization: str | None) -> str | None:
    """The key in an `Authorization: Bearer KEY` header, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_matches(token: str | None, api_keys: list[str]) -> bool:
    # Every key is compared (in constant time each), so timing tells nothing about which one came close.
    given = (token or "").encode()
    return bool(sum(hmac.compare_digest(given, k.encode()) for k in api_keys))


def tenant_cache_salt(token: str | None, requested: str | None) -> str:
    """A salt that starts with a digest of the caller's key: callers with different keys never share a
    prefix-cache entry, whatever cache_salt they send (theirs only divides their own entries further).
    Only the digest travels to the engine, never the key. Callers without a key share one salt."""
    tenant = "key:" + (hashlib.sha256(token.encode()).hexdigest() if token else "none")
    return tenant if requested is None else f"{tenant}|{requested}"
