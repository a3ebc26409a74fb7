"""API key → tenant.

Keys are configured as SHA-256 hex digests (``printf %s KEY | sha256sum``). A
presented key is hashed and compared with :func:`hmac.compare_digest` against every
configured digest, so the time taken does not depend on which digest matched or how
many leading characters agree.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress

from aiohttp import web

from config.schema import TenantQuota, TenantsConfig
from limits.outcome import Outcome, Rejected


def hash_key(key: str) -> str:
    """SHA-256 hex digest of an API key (UTF-8; header bytes that are not UTF-8, which
    aiohttp hands over surrogate-escaped, hash as the bytes they were)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def presented_key(request: web.Request) -> str | None:
    """The key from ``Authorization: Bearer KEY`` or ``x-api-key: KEY``; None if
    neither header is present (an empty key is a key, and matches no tenant)."""
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()  # may be empty: a presented key that matches nothing
        return auth.strip()  # present but not a bearer token: still a key that must match
    key = request.headers.get("x-api-key")
    return None if key is None else key.strip()


@functools.lru_cache(maxsize=1024)
def is_loopback(remote: str | None) -> bool:
    """Whether ``remote`` (a peer address string) is a loopback address; cached, as
    parsing an address costs more than the rest of resolving a tenant."""
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


class TenantDirectory:
    """Resolves a request's key to its :class:`TenantQuota`.

    Rules: a presented key that matches no tenant → 401 always; no key → the
    anonymous tenant if ``allow_anonymous`` and the client is on loopback, else 401.
    """

    def __init__(self, cfg: TenantsConfig) -> None:
        self.replace(cfg)

    def replace(self, cfg: TenantsConfig) -> None:
        """Swap in a new configuration (reload); lookups see either the old or the
        new one, never a mix."""
        digests = [(h.encode(), t) for t in cfg.tenants for h in t.api_key_hashes]
        self.cfg, self._digests = cfg, digests

    def by_name(self, name: str) -> TenantQuota:
        """The tenant called ``name`` (the anonymous one while ``allow_anonymous``):
        the owner of a batch line the gateway sends itself.

        Raises:
            Rejected: ``Outcome.UNAUTHORIZED`` when no such tenant is configured
                (any more).
        """
        cfg = self.cfg
        if cfg.allow_anonymous and name == cfg.anonymous.name:
            return cfg.anonymous
        for tenant in cfg.tenants:
            if tenant.name == name:
                return tenant
        raise Rejected(Outcome.UNAUTHORIZED, f"Tenant {name!r} is not configured.")

    def resolve(self, key: str | None, remote: str | None) -> TenantQuota:
        """Raises:
            Rejected: ``Outcome.UNAUTHORIZED`` (401) as described above.
        """
        if key is None:
            if self.cfg.allow_anonymous and is_loopback(remote):
                return self.cfg.anonymous
            raise Rejected(
                Outcome.UNAUTHORIZED,
                "Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
            )
        digest = hash_key(key).encode()
        found: TenantQuota | None = None
        for candidate, tenant in self._digests:  # no early exit: constant time
            if hmac.compare_digest(candidate, digest):
                found = tenant
        if found is None:
            raise Rejected(Outcome.UNAUTHORIZED, "Incorrect API key provided.")
        return found
