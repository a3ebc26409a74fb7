"""Workloads for load tests and trace replay: loaders for the shared traces and
prompt sets (``$SLUICE_DATA_DIR`` or ``../shared/data``) and scenario sets.

``build_workload(name, opts)`` with ``name`` one of :data:`WORKLOADS` or a path to a
file in the Mooncake trace format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from loadtest.workloads.arena import arena_hard
from loadtest.workloads.azure import azure
from loadtest.workloads.base import RequestSpec, Workload, WorkloadOptions, data_dir
from loadtest.workloads.mooncake import ideal_hit_rate, mooncake, read_trace
from loadtest.workloads.scenarios import high_concurrency, long_context, mixed_tenants, short

#: Workload builders by name (read-only).
WORKLOADS: MappingProxyType[str, Callable[[WorkloadOptions], Workload]] = MappingProxyType({
    "mooncake-conversation": mooncake,
    "azure-code": lambda o: azure("code", o),
    "azure-conv": lambda o: azure("conv", o),
    "arena-hard": arena_hard,
    "arena-hard-v2": lambda o: arena_hard(o, "v2.0"),
    "short": short,
    "long-context": long_context,
    "high-concurrency": high_concurrency,
    "mixed-tenants": mixed_tenants,
})


def build_workload(name: str, opts: WorkloadOptions) -> Workload:
    """The workload called ``name``, or a Mooncake-format trace at path ``name``."""
    if name in WORKLOADS:
        return WORKLOADS[name](opts)
    if Path(name).is_file():
        return mooncake(opts, Path(name))
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)} or a path")


__all__ = ["WORKLOADS", "RequestSpec", "Workload", "WorkloadOptions", "build_workload",
           "data_dir", "ideal_hit_rate", "read_trace"]
