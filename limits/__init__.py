"""Admission control: who may run now.

* :mod:`limits.interfaces` — ``CounterStore``, ``Clock``, ``EngineLoad`` protocols.
* :mod:`limits.stores` — ``open_store(url)``: :mod:`~limits.memory_store`,
  :mod:`~limits.redis_store`, wrapped by :mod:`~limits.failover` for Redis.
* :mod:`limits.rate_limit` — ``RateLimiter.reserve`` → ``Reservation`` (settle/release).
* :mod:`limits.admission` — ``AdmissionQueue`` (priority bands, :mod:`~limits.drr`
  fair share, deadlines, shedding, :mod:`~limits.drain_rate` Retry-After).
* :mod:`limits.saturation` — ``SaturationDetector`` and ``kv_blocks``.
* :mod:`limits.degrade` — the degradation ladder.
* :mod:`limits.outcome` — ``Outcome`` and ``Rejected``.
"""
