"""The simulator's scheduler: vLLM v1's continuous batching with chunked prefill,
prefix caching and preemption by recompute, as a synchronous core that the engine
loop drives one step at a time.

Source: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule`` and
``update_from_output``). One step:

1. Running requests first, in admission order: each gets
   ``min(num_tokens − num_computed_tokens, remaining token budget)`` new tokens (1 for
   a decoding request, a chunk for a partial prefill). If its blocks cannot be
   allocated, the newest running request is preempted (its blocks freed, its
   computed tokens reset to 0, put back at the front of the waiting queue) until the
   allocation succeeds or the request preempted itself.
2. Only if nothing was preempted this step: waiting requests, FCFS, while the token
   budget lasts and fewer than ``max_num_seqs`` run. A request not yet computed first
   takes its longest cached prefix (whole blocks, capped at ``num_tokens − 1``); it
   is admitted only if blocks for the rest of this step's chunk are free, otherwise
   the queue stops (head-of-line, as vLLM).
3. After the step (``commit``): computed tokens advance; a request whose computed
   tokens reach its token count samples one output token; requests reaching
   ``max_tokens`` finish and free their blocks.

Full prompt blocks are registered in the prefix cache when allocated (vLLM's
``allocate_slots`` caches blocks as soon as their tokens are scheduled). Generated
tokens take KV blocks but are not cached: simulated output tokens have no real
identity, so no later prompt could match them. Prefix-cache counters follow
``vllm/v1/core/kv_cache_manager.py`` / ``vllm/v1/metrics/stats.py``: recorded when a
waiting request is admitted, in tokens, excluding requests resumed after preemption.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.sim_engine.kv_cache import Block, KVCache
from loadtest.sim_engine.profiles import Profile


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


def _noop() -> None:
    return None


@dataclass(eq=False)
class SimRequest:
    """One request inside the simulated engine.

    Attributes:
        request_id: unique id.
        num_prompt_tokens: prompt length, tokens (≥ 1).
        block_hashes: chained hashes of the prompt's full blocks (salted).
        max_tokens: output tokens to generate (≥ 1).
        priority: vLLM's ``priority`` (lower is served earlier under the priority
            policy).
        notify: called (synchronously) after each step that produced a token for
            this request or finished it; the HTTP handler sets an event here.
        token_ids, cache_salt: the prompt's tokens and salt (KV events report them).
        arrival_s, first_token_s, last_token_s: engine clock times, s.
        last_itl_s: time between the last two output tokens, s.
        external_tokens: leading prompt tokens whose KV a connector loaded from a
            remote prefill (:mod:`loadtest.sim_engine.disagg`); at admission they
            count as computed, like prefix-cache hits (at most ``num_tokens − 1``).
        keep_blocks: when the request finishes, its blocks are not freed but left
            in ``blocks`` for a connector to hand to a remote decode (vLLM's
            ``request_finished`` returning ``delay_free_blocks``).
    """

    request_id: str
    num_prompt_tokens: int
    block_hashes: list[int]
    max_tokens: int
    priority: int = 0
    notify: Callable[[], None] = _noop
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    arrival_s: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    num_registered_blocks: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    last_itl_s: float | None = None
    external_tokens: int = 0
    keep_blocks: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (those the KV cache must hold)."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)


@dataclass
class StepPlan:
    """What one step computes: ``(request, new tokens)`` pairs and the cost-model
    inputs (prefill tokens, decoding sequences, KV tokens those sequences attend)."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens: int = 0


@dataclass
class Counters:
    """Monotonic totals exported as vLLM counters (tokens unless noted)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0  # preemption events
    #: vLLM's connector prefix-cache stats (``connector_prefix_cache_stats``): the
    #: prompt tokens a KV connector was asked for beyond the local hit, and those it
    #: loaded (``vllm:external_prefix_cache_queries`` / ``_hits``)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class Scheduler:
    """Continuous-batching scheduler over a :class:`KVCache` (see module doc).

    Args:
        profile: limits (``max_num_seqs``, ``max_num_batched_tokens``) and geometry.
        kv: the block pool (``profile.num_blocks`` × ``profile.block_size``).
        policy: ``fcfs`` (default) or ``priority`` (vLLM ``--scheduling-policy``:
            waiting requests ordered by ``(priority, arrival)``; vLLM also preempts
            a running lower-priority request for a waiting higher-priority one, which
            the simulator does not model).
    """

    def __init__(self, profile: Profile, kv: KVCache, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.profile = profile
        self.kv = kv
        self.policy = policy
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = Counters()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: SimRequest) -> None:
        """Queue a new request at the back of the waiting queue (under the priority
        policy: behind every waiting request of the same or a more urgent priority)."""
        req.status = Status.WAITING
        if self.policy == "priority":
            at = next((i for i, w in enumerate(self.waiting) if w.priority > req.priority),
                      len(self.waiting))
            self.waiting.insert(at, req)
        else:
            self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        """Remove ``req`` wherever it is and free its blocks at once (idempotent)."""
        if req.done:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req, Status.ABORTED)

    def schedule(self) -> StepPlan:
        """Choose this step's work (vLLM ``Scheduler.schedule``); O(batch)."""
        plan = StepPlan()
        budget = self.profile.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            self._add_to_plan(plan, req, n)
            budget -= n
            i += 1
        if not preempted:
            self._admit_waiting(plan, budget)
        return plan

    def commit(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Apply a finished step at engine time ``now`` (s): advance computed tokens,
        sample one token for each request whose computation caught up, finish those
        at ``max_tokens``. Returns the requests that got a token (each notified)."""
        out: list[SimRequest] = []
        finished = False
        for req, n in plan.scheduled:
            if req.status is not Status.RUNNING:  # aborted or preempted meanwhile
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.num_output_tokens += 1
            self.counters.generation_tokens += 1
            if req.first_token_s is None:
                req.first_token_s = now
                self.counters.prompt_tokens += req.num_prompt_tokens
            req.last_itl_s = None if req.last_token_s is None else now - req.last_token_s
            req.last_token_s = now
            out.append(req)
            if req.num_output_tokens >= req.max_tokens:
                self._release(req, Status.FINISHED)  # notifies
                finished = True
            else:
                req.notify()
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return out

    # ------------------------------------------------------------------ internals

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        bs = self.kv.block_size
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.longest_prefix(req.block_hashes, req.num_tokens)
            num_hit = len(hits) * bs
            # Tokens loaded by a connector count as computed (vLLM recomputes the
            # last prompt token to sample, _update_waiting_for_remote_kv).
            computed = max(num_hit, min(req.external_tokens, req.num_tokens - 1))
            n = min(req.num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - len(hits)
            # Hit blocks that are free now leave the free queue when touched.
            free_hits = sum(1 for b in hits if b.ref_cnt == 0)
            if need > self.kv.num_free_blocks - free_hits:
                break
            self.kv.touch(hits)
            new_blocks = self.kv.allocate(need)
            assert new_blocks is not None
            self.waiting.popleft()
            req.blocks = hits + new_blocks
            req.num_registered_blocks = len(hits)
            req.num_computed_tokens = computed
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += num_hit
                if req.external_tokens:  # a connector was asked (a decode leg)
                    self.counters.external_prefix_cache_queries += req.num_tokens - num_hit
                    self.counters.external_prefix_cache_hits += computed - num_hit
            req.status = Status.RUNNING
            self.running.append(req)
            self._register_full_blocks(req, n)
            self._add_to_plan(plan, req, n)
            budget -= n

    def _allocate(self, req: SimRequest, n: int) -> bool:
        need = -(-(req.num_computed_tokens + n) // self.kv.block_size) - len(req.blocks)
        if need > 0:
            blocks = self.kv.allocate(need)
            if blocks is None:
                return False
            req.blocks.extend(blocks)
        self._register_full_blocks(req, n)
        return True

    def _register_full_blocks(self, req: SimRequest, n: int) -> None:
        full = min((req.num_computed_tokens + n) // self.kv.block_size, len(req.block_hashes))
        if full > req.num_registered_blocks:
            lo = req.num_registered_blocks
            self.kv.cache_blocks(req.blocks[lo:full], req.block_hashes[lo:full],
                                 req.block_hashes[lo - 1] if lo else None,
                                 req.token_ids[lo * self.kv.block_size:], req.cache_salt)
            req.num_registered_blocks = full

    def _add_to_plan(self, plan: StepPlan, req: SimRequest, n: int) -> None:
        plan.scheduled.append((req, n))
        if req.num_output_tokens > 0 and n == 1 and req.num_computed_tokens == req.num_tokens - 1:
            plan.decode_seqs += 1
            plan.kv_tokens += req.num_computed_tokens
        else:
            plan.prefill_tokens += n

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.external_tokens = 0  # the loaded KV went with the blocks
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.counters.num_preemptions += 1

    def _release(self, req: SimRequest, status: Status) -> None:
        if not (req.keep_blocks and status is Status.FINISHED):
            self.kv.free(req.blocks)
            req.blocks = []
        req.status = status
        req.notify()
