"""The simulated engine's KV connector: prefill–decode disaggregation as vLLM's
``NixlConnector`` does it in pull mode (``vllm/distributed/kv_transfer/kv_connector/
v1/nixl/pull_scheduler.py``), with the same request fields and response fields.

* **Prefill leg** (an engine that produces: ``--role prefill`` or ``both``): a request
  with ``kv_transfer_params: {"do_remote_decode": true, …}`` runs as usual (the router
  sends ``max_tokens: 1``, no stream). When it finishes its blocks are not freed but
  held for pickup for ``--kv-lease-s`` (vLLM's ``kv_lease_duration``, 30 s), and the
  response carries ``kv_transfer_params`` as ``request_finished`` builds them:
  ``do_remote_prefill: true``, ``do_remote_decode: false``, ``remote_block_ids`` (one
  list per KV-cache group), ``remote_engine_id``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``tp_size``, ``dcp_size``, ``pp_size``,
  ``remote_num_tokens``, ``remote_blocks_expiry_time`` (None on the prefill side),
  ``transfer_mode: "pull"`` and ``remote_prefill_cached_tokens`` (the scheduler's
  addition, ``vllm/v1/core/sched/scheduler.py``).
* **Decode leg** (``--role decode`` or ``both``): a request carrying those parameters
  reads the blocks from ``remote_host:remote_port`` — the blocks its own prefix cache
  does not already hold — which takes ``blocks × bytes per block × 8 / (Gbit/s × 1e9)``
  seconds of simulated time (bytes per block from the profile's model geometry,
  :attr:`Profile.kv_bytes_per_block`; bandwidth ``--kv-transfer-gbps``). The read frees
  the blocks on the prefill engine. The loaded tokens then count as computed
  (``SimRequest.external_tokens``) and the engine recomputes the last prompt token
  to sample the first output token, as vLLM does.
* **Blocks gone** (lease expired, prefill engine restarted — a new
  ``remote_engine_id`` — or unreachable): with ``--kv-load-failure-policy recompute``
  (the simulator's default) the decode engine prefills the prompt itself; with
  ``fail`` (vLLM 0.32's default, ``vllm/config/kv_transfer.py``) the request fails
  with HTTP 500.
* **Read channel**: NIXL's side channel is a separate port; the simulator serves the
  read as ``POST /sim/nixl/read`` on its HTTP port, so ``remote_port`` is that port.
* **Metrics**, vLLM's NIXL names (``nixl/stats.py``): ``vllm:nixl_xfer_time_seconds``
  (histogram: count = transfers, sum = simulated seconds),
  ``vllm:nixl_bytes_transferred`` (histogram, bytes), ``vllm:nixl_num_failed_transfers``
  and ``vllm:nixl_num_kv_expired_reqs`` (prefill side).

Simplifications: the decode engine allocates its blocks after the transfer rather than
before it (vLLM's ``WAITING_FOR_REMOTE_KV``), so a request being transferred is not in
``vllm:num_requests_waiting``; transfers do not share bandwidth with each other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram

from loadtest.sim_engine.engine import SimEngine
from loadtest.sim_engine.kv_cache import Block
from loadtest.sim_engine.metrics import _LABELS
from loadtest.sim_engine.scheduler import SimRequest, Status

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
#: Connectors the simulator models.
CONNECTORS = ("NixlConnector",)
FailurePolicy = Literal["recompute", "fail"]
READ_PATH = "/sim/nixl/read"
#: ``vllm:nixl_xfer_time_seconds`` buckets (``NixlPromMetrics``), s.
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
#: ``vllm:nixl_bytes_transferred`` buckets: 2 KiB … 8 GiB, ×4.
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
#: Seconds a decode engine waits for the prefill engine's read channel.
READ_TIMEOUT_S = 5.0


class KVLoadFailed(Exception):
    """The blocks could not be read and the failure policy is ``fail``."""


@dataclass
class _Held:
    blocks: list[Block]
    timer: asyncio.TimerHandle


class SimConnector:
    """One engine's side of the KV transfer.

    Args:
        engine: the engine whose KV cache and metrics registry it uses.
        role: ``prefill`` produces (holds blocks for a remote decode), ``decode``
            consumes (loads a remote prefill), ``both`` does either.
        transfer_gbps: read bandwidth, Gbit/s (10⁹ bit/s), > 0.
        lease_s: how long finished prefill blocks wait for their read, simulated s.
        failure_policy: what a failed read does (see the module docstring).
        host, port: this engine's read channel, advertised as ``remote_host`` /
            ``remote_port`` (set by :func:`loadtest.sim_engine.server.serve`).

    Raises:
        ValueError: bad role, bandwidth or lease, or a profile without model
            geometry (``kv_bytes_per_token``), so transfers could not be timed.
    """

    def __init__(self, engine: SimEngine, role: Role = "both", transfer_gbps: float = 100.0,
                 lease_s: float = 30.0, failure_policy: FailurePolicy = "recompute",
                 host: str = "127.0.0.1", port: int = 0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if transfer_gbps <= 0 or lease_s <= 0:
            raise ValueError("transfer_gbps and lease_s must be > 0")
        if engine.profile.kv_bytes_per_block is None:
            raise ValueError(f"profile {engine.profile.name} has no kv_bytes_per_token")
        self.engine = engine
        self.role = role
        self.transfer_gbps = transfer_gbps
        self.lease_s = lease_s
        self.failure_policy = failure_policy
        self.host, self.port = host, port
        #: vLLM's engine_id (a new uuid per start): a restarted prefill engine no
        #: longer serves reads addressed to its previous life.
        self.engine_id = str(uuid.uuid4())
        self._held: dict[str, _Held] = {}
        self._session: aiohttp.ClientSession | None = None
        reg, labels = engine.metrics.registry, (engine.model_name, "0")
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.",
                                   _LABELS, registry=reg, buckets=XFER_TIME_BUCKETS).labels(*labels)
        self.xfer_bytes = Histogram("vllm:nixl_bytes_transferred",
                                    "Histogram of bytes transferred per NIXL KV Cache transfers.",
                                    _LABELS, registry=reg, buckets=BYTES_BUCKETS).labels(*labels)
        self.failed = Counter("vllm:nixl_num_failed_transfers",
                              "Number of failed NIXL KV Cache transfers.",
                              _LABELS, registry=reg).labels(*labels)
        self.expired = Counter("vllm:nixl_num_kv_expired_reqs",
                               "Number of requests that had their KV expire.",
                               _LABELS, registry=reg).labels(*labels)

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def held_requests(self) -> int:
        """Finished prefills whose blocks wait for a read."""
        return len(self._held)

    # ------------------------------------------------------------ prefill side

    def remote_decode(self, params: Mapping[str, Any] | None) -> bool:
        """Whether a request with ``params`` is a prefill leg this engine serves."""
        return self.produces and bool(params and params.get("do_remote_decode"))

    def hold(self, req: SimRequest) -> dict[str, Any] | None:
        """After a prefill leg finished: keep its blocks for ``lease_s`` and return the
        ``kv_transfer_params`` of the response; None (blocks already freed) for a
        request that did not finish normally. Idempotent."""
        if req.status is not Status.FINISHED or not req.keep_blocks:
            return None
        if req.request_id not in self._held and req.blocks:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(self.lease_s / self.engine.speed, self._expire,
                                    req.request_id)
            self._held[req.request_id] = _Held(req.blocks, timer)
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in req.blocks]],
            "remote_engine_id": self.engine_id, "remote_request_id": req.request_id,
            "remote_host": self.host, "remote_port": self.port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": req.num_prompt_tokens,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": req.num_cached_tokens,
        }

    def read(self, remote_request_id: str, remote_engine_id: str) -> int | None:
        """Serve a decode engine's read: free the held blocks and return how many
        there were; None if this engine holds nothing under that id."""
        if remote_engine_id != self.engine_id:
            return None
        held = self._held.pop(remote_request_id, None)
        if held is None:
            return None
        held.timer.cancel()
        self._free(held.blocks)
        return len(held.blocks)

    def _expire(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._free(held.blocks)
            self.expired.inc()

    def _free(self, blocks: list[Block]) -> None:
        self.engine.kv.free(blocks)
        self.engine.wake()

    def release_all(self) -> None:
        """Free every held block (engine shutdown)."""
        for rid in list(self._held):
            held = self._held.pop(rid)
            held.timer.cancel()
            self._free(held.blocks)

    # ------------------------------------------------------------- decode side

    def remote_prefill(self, params: Mapping[str, Any] | None) -> bool:
        """Whether a request with ``params`` is a decode leg this engine serves."""
        return self.consumes and bool(params and params.get("do_remote_prefill"))

    def transfer_seconds(self, num_blocks: int) -> float:
        """Simulated time to read ``num_blocks`` blocks, s."""
        assert self.engine.profile.kv_bytes_per_block is not None
        return num_blocks * self.engine.profile.kv_bytes_per_block * 8 / (self.transfer_gbps * 1e9)

    async def load(self, params: Mapping[str, Any], num_prompt_tokens: int,
                   local_blocks: int) -> int:
        """Read the remote blocks this engine's prefix cache lacks (``local_blocks``
        leading blocks are already here) and wait the transfer time. Returns the
        prompt tokens now computed by the remote prefill (0: prefill locally).

        Raises:
            KVLoadFailed: the read failed and the policy is ``fail``.
        """
        remote_blocks = _num_remote_blocks(params.get("remote_block_ids"))
        try:
            held = await self._read_remote(params)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            held = None
        if held is None or remote_blocks is None:
            self.failed.inc()
            if self.failure_policy == "fail":
                raise KVLoadFailed("KV transfer from the prefill engine failed")
            return 0
        moved = max(0, min(held, remote_blocks) - local_blocks)
        seconds = self.transfer_seconds(moved)
        await asyncio.sleep(seconds / self.engine.speed)
        self.xfer_time.observe(seconds)
        self.xfer_bytes.observe(moved * (self.engine.profile.kv_bytes_per_block or 0))
        return min(int(params.get("remote_num_tokens") or 0), num_prompt_tokens,
                   held * self.engine.profile.block_size)

    async def _read_remote(self, params: Mapping[str, Any]) -> int | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S))
        url = f"http://{params['remote_host']}:{int(params['remote_port'])}{READ_PATH}"
        body = {"remote_request_id": str(params["remote_request_id"]),
                "remote_engine_id": str(params["remote_engine_id"])}
        async with self._session.post(url, json=body) as r:
            if r.status != 200:
                return None
            return int((await r.json())["num_blocks"])

    async def close(self) -> None:
        self.release_all()
        if self._session is not None:
            await self._session.close()


def _num_remote_blocks(ids: Any) -> int | None:
    """Blocks in ``remote_block_ids``: one list per KV-cache group (vLLM's
    ``BlockIds``) or a flat list; None when malformed."""
    if isinstance(ids, list) and ids and all(isinstance(g, list) for g in ids):
        ids = ids[0]
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return len(ids)
    return None


#: The app's connector (``loadtest.sim_engine.server.create_app``).
CONNECTOR = web.AppKey("sim_connector", SimConnector)


async def handle_read(request: web.Request) -> web.Response:
    """``POST /sim/nixl/read {"remote_request_id", "remote_engine_id"}`` →
    ``{"num_blocks": N}``, or 404 when the blocks are gone."""
    connector = request.app[CONNECTOR]
    try:
        body = await request.json()
        n = connector.read(str(body["remote_request_id"]), str(body["remote_engine_id"]))
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": "bad read request"}, status=400)
    if n is None:
        return web.json_response({"error": "no such blocks (expired or never held)"},
                                 status=404)
    return web.json_response({"num_blocks": n})


def engine_request_id(external_id: str) -> str:
    """vLLM's internal request id: the external one plus 8 random hex digits
    (``vllm/v1/engine/input_processor.py``), unique even when a router reuses one
    ``X-Request-Id`` for both legs."""
    return f"{external_id}-{uuid.uuid4().hex[:8]}"
