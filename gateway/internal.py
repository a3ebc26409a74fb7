"""Lines the gateway sends itself (the Batch API's runner, :mod:`gateway.batch_runner`):
the secret this host's gateway processes share, how a request proves it carries it,
and the tenant a batch line runs as. Kept apart from the runner so the middlewares and
the worker parent read it without importing the pipeline."""

from __future__ import annotations

import hmac
import os
import secrets

from config.schema import BatchConfig, TenantQuota

#: Headers of a line sent to this gateway: the shared secret and the tenant's name.
INTERNAL_HEADER = "x-sluice-internal"
TENANT_HEADER = "x-sluice-batch-tenant"
#: The secret shared by this host's gateway processes (``--workers N`` sets it in
#: the parent; a lone process draws its own).
SECRET_ENV = "SLUICE_INTERNAL_SECRET"

def internal_secret() -> str:
    """This host's secret for lines sent to the gateway itself (``SECRET_ENV``, set
    once per process when absent)."""
    return os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))


def is_internal(presented: str | None) -> bool:
    """Whether ``presented`` is this host's internal secret (constant time)."""
    return presented is not None and hmac.compare_digest(
        presented.encode(), internal_secret().encode())


def batch_tenant(tenant: TenantQuota, cfg: BatchConfig) -> TenantQuota:
    """``tenant`` as its batch lines run: the ``batch`` band, ``max_queue_wait_s``
    from ``cfg``; with ``batch_tokens_per_min``, that budget under its own name
    (``NAME:batch``, its own buckets) and no requests/min limit, the cache namespace
    unchanged."""
    update: dict[str, object] = {"priority": "batch", "max_queue_wait_s": cfg.max_queue_wait_s}
    if tenant.batch_tokens_per_min is not None:
        update |= {"name": f"{tenant.name}:batch", "tokens_per_min": tenant.batch_tokens_per_min,
                   "requests_per_min": None, "cache_namespace": tenant.namespace}
    return tenant.model_copy(update=update)
