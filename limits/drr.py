"""Weighted fair share between flows (tenants) by deficit round robin.

DRR: M. Shreedhar and G. Varghese, "Efficient Fair Queuing Using Deficit Round
Robin", ACM SIGCOMM 1995. Each backlogged flow, when its turn comes in the round,
adds ``quantum × weight`` to its deficit counter and is served while its head item's
size fits the deficit (the size is subtracted); then the next flow's turn comes. A
flow that empties its queue leaves the round and forgets its deficit. Over any
period in which flows stay backlogged, the size served to each is proportional to
its weight, within one quantum plus one maximal item — O(1) work per item when the
quantum is at least the largest item.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class DeficitRoundRobin(Generic[T]):
    """Items grouped by flow; :meth:`head` names the item DRR serves next and
    :meth:`pop` serves it. Items are compared by identity (and must be hashable).

    Args:
        quantum: size credited per turn to a flow of weight 1 (here: tokens).
    """

    def __init__(self, quantum: float) -> None:
        self._quantum = quantum
        self._queues: dict[str, deque[tuple[T, float]]] = {}
        self._weight: dict[str, float] = {}
        self._deficit: dict[str, float] = {}
        self._round: deque[str] = deque()  # backlogged flows; [0] has the turn
        self._keys: dict[T, float] = {}  # order keys of queued items that have one
        self._credited = False  # whether _round[0] got its quantum this turn

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, flow: str, item: T, size: float, weight: float,
             key: float | None = None) -> None:
        """Queue ``item`` of ``size`` (≥ 0) for ``flow`` with share ``weight`` (> 0).
        Inside a flow items are served in ``key`` order (earliest deadline first),
        arrival order among equal keys; without a key, at the back."""
        if flow not in self._queues:
            self._queues[flow] = deque()
            self._deficit[flow] = 0.0
            self._round.append(flow)
        queue = self._queues[flow]
        at = len(queue)
        if key is not None:
            self._keys[item] = key
            while at > 0 and self._keys.get(queue[at - 1][0], -math.inf) > key:
                at -= 1
        queue.insert(at, (item, size))
        self._weight[flow] = weight

    def head(self) -> T | None:
        """The next item in fair order (None when empty); advances turns as needed."""
        while self._round:
            flow = self._round[0]
            if not self._credited:
                self._deficit[flow] += self._quantum * self._weight[flow]
                self._credited = True
            item, size = self._queues[flow][0]
            if size <= self._deficit[flow]:
                return item
            self._round.rotate(-1)
            self._credited = False
        return None

    def pop(self) -> T:
        """Serve the item :meth:`head` returned (call ``head`` first)."""
        flow = self._round[0]
        item, size = self._queues[flow].popleft()
        self._keys.pop(item, None)
        self._deficit[flow] -= size
        if not self._queues[flow]:
            self._leave(flow)
        return item

    def remove(self, flow: str, item: T) -> None:
        """Take ``item`` out without serving it (cancelled, expired or shed)."""
        queue = self._queues[flow]
        self._keys.pop(item, None)
        for i, (queued, _) in enumerate(queue):
            if queued is item:
                del queue[i]
                break
        if not queue:
            self._leave(flow)

    def _leave(self, flow: str) -> None:
        if self._round[0] == flow:
            self._credited = False
        self._round.remove(flow)
        del self._queues[flow], self._deficit[flow], self._weight[flow]
