"""The simulated engine's step loop: schedule, sleep the modelled step time, commit.

One coroutine per engine drives every request (no per-request timers), so an
engine costs O(batch) Python work per step whatever the token rate; several engines
with ``speed`` factors fit on a couple of cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Counter

from limits.clock import MONOTONIC
from limits.interfaces import Clock
from loadtest.sim_engine.kv_cache import KVCache
from loadtest.sim_engine.kv_events import SimEventPublisher
from loadtest.sim_engine.metrics import sim_metrics
from loadtest.sim_engine.profiles import Profile
from loadtest.sim_engine.scheduler import Scheduler, SimRequest


class FrontEnd:
    """The engine's API server as one FIFO server (``profiles``, "Front end"): a job
    of ``cost`` simulated seconds starts when the jobs before it are done and takes
    ``cost / speed`` of wall time. Jobs are reserved in arrival order
    (``busy_until``), so no task runs the queue.

    Args:
        request_s: time per request taken in (``Profile.frontend_request_s``), s.
        token_s: time per streamed output token (``Profile.frontend_token_s``), s.
        clock: monotonic wall clock, s.
        speed: returns the engine's speed factor now.
    """

    def __init__(self, request_s: float, token_s: float, clock: Clock,
                 speed: Callable[[], float]) -> None:
        self.request_s, self.token_s = request_s, token_s
        self.clock, self.speed = clock, speed
        self.busy_until = 0.0
        #: requests taken in but not yet handed to the scheduler (counted in no
        #: metric, as in the real engine)
        self.intake_queue = 0

    async def _serve(self, cost_s: float) -> None:
        if cost_s <= 0:
            return
        now = self.clock.now()
        self.busy_until = max(now, self.busy_until) + cost_s / self.speed()
        await asyncio.sleep(self.busy_until - now)

    async def intake(self) -> None:
        """Wait for one request's turn through the front end (cancellable)."""
        self.intake_queue += 1
        try:
            await self._serve(self.request_s)
        finally:
            self.intake_queue -= 1

    async def output(self, tokens: int) -> None:
        """Wait for ``tokens`` output tokens' turn through the front end."""
        await self._serve(self.token_s * tokens)


class SimEngine:
    """A simulated vLLM engine core.

    Args:
        profile: geometry, limits and cost model (see ``profiles.py``).
        model_name: served model name (metric label).
        speed: simulated seconds per wall second (> 0); 2.0 runs twice as fast as
            the modelled device, 0.5 half as fast. :meth:`set_speed` changes it
            while running (``POST /sim/speed``).
        clock: monotonic wall clock, s (injectable for tests).
        scheduling_policy: ``fcfs`` or ``priority`` (vLLM ``--scheduling-policy``).
        prompt_tokens_details: report ``usage.prompt_tokens_details.cached_tokens``
            (vLLM ``--enable-prompt-tokens-details``).
        publisher: publishes the KV cache's events after every step (vLLM's
            ``--kv-events-config``); None: no events.

    Attributes:
        priorities: ``sim:requests_by_priority_total{priority}``, a series vLLM does
            not have: requests received per ``priority`` value (so tests can see what
            the gateway sent).
    """

    def __init__(self, profile: Profile, model_name: str, speed: float = 1.0,
                 clock: Clock = MONOTONIC, *, scheduling_policy: str = "fcfs",
                 publisher: SimEventPublisher | None = None,
                 prompt_tokens_details: bool = False) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        capacity = (profile.num_blocks - 1) * profile.block_size
        if capacity < profile.max_model_len:
            # vLLM refuses to start in this case too (vllm/v1/core/kv_cache_utils.py,
            # check_enough_kv_cache_memory).
            raise ValueError(f"KV cache holds {capacity} tokens, less than "
                             f"max_model_len {profile.max_model_len}")
        self.profile = profile
        self.model_name = model_name
        self.speed = speed
        self.clock = clock
        self.publisher = publisher
        self.kv = KVCache(profile.num_blocks, profile.block_size, events=publisher is not None)
        self.scheduler = Scheduler(profile, self.kv, scheduling_policy)
        self.prompt_tokens_details = prompt_tokens_details
        self.frontend = FrontEnd(profile.frontend_request_s, profile.frontend_token_s,
                                 clock, lambda: self.speed)
        self.metrics = sim_metrics(self.scheduler, model_name)
        self.priorities = Counter("sim:requests_by_priority", "Requests received by priority.",
                                  ["priority"], registry=self.metrics.registry)
        self._wake = asyncio.Event()
        self._thawed = asyncio.Event()  # cleared while frozen
        self._thawed.set()

    def set_speed(self, speed: float) -> None:
        """Run at ``speed`` (> 0) from the next step on."""
        if not speed > 0:
            raise ValueError("speed must be > 0")
        self.speed = speed

    def freeze(self) -> None:
        """Stop stepping (fault injection): running requests get no more tokens and
        new ones wait, while ``/health`` and ``/metrics`` keep answering — an engine
        hung with a healthy health check. :meth:`thaw` resumes."""
        self._thawed.clear()

    def thaw(self) -> None:
        """Resume stepping after :meth:`freeze`."""
        self._thawed.set()

    def submit(self, req: SimRequest) -> None:
        """Queue ``req`` (its ``arrival_s`` is set to now)."""
        req.arrival_s = self.clock.now()
        self.scheduler.add(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop ``req`` now: it stops counting as running/waiting, its blocks are
        freed (idempotent)."""
        self.scheduler.abort(req)
        self._wake.set()

    def wake(self) -> None:
        """Make the step loop look for work (blocks were freed from outside)."""
        self._wake.set()

    async def run(self) -> None:
        """Step forever (cancel to stop)."""
        while True:
            await self._thawed.wait()
            plan = self.scheduler.schedule() if self.scheduler.has_work else None
            if plan is None or not plan.scheduled:
                self._wake.clear()
                await self._wake.wait()
                continue
            step_s = self.profile.step_seconds(plan.prefill_tokens, plan.decode_seqs,
                                               plan.kv_tokens)
            await asyncio.sleep(step_s / self.speed)
            now = self.clock.now()
            for req in self.scheduler.commit(plan, now):
                if req.last_itl_s is None:
                    self.metrics.ttft.observe(now - req.arrival_s)
                else:
                    self.metrics.itl.observe(req.last_itl_s)
            if self.publisher is not None:
                events = self.kv.take_events()
                if events:
                    self.publisher.publish(events)
