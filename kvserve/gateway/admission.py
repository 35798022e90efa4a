"""Admission for one model: a bounded priority queue in front of its replicas' slots.

Each replica has `slots` places (its engine's max_num_seqs, counted in sequences: a request with n = 3
takes 3). A request that finds a place is routed at once; otherwise it waits here, in (priority, arrival)
order (lower priority value first, as in vLLM), and is routed when a place frees, to the replica the routing
policy picks among those with room then (late binding: the decision uses the load of that moment). More
than `max_waiting` waiting requests: the next one is refused (QueueFull -> HTTP 429 with Retry-After), unless
it is more urgent than the least urgent waiter, which is then refused in its place.

Long jobs cannot starve interactive ones: requests with a priority above 0 (background work) may fill a
replica only up to `slots - reserved`; the last `reserved` places stay for requests of priority <= 0, which
therefore start at once even while a burst of background generations has every other place (the engine's
continuous batching then runs both together). Within a class, order is first come first served.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.engine.block_hash import BlockHash
from kvserve.gateway.routing import ReplicaLoad, RoutingPolicy

# Finishes within this window give the drain rate behind Retry-After.
_RATE_WINDOW_S = 10.0
_MAX_RETRY_AFTER_S = 30


class QueueFull(Exception):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoReplica(Exception):
    """Every replica's engine is down (being replaced): nothing can be admitted now."""


@dataclass
class Placement:
    """Where a request runs, and what it was counted as there until release()."""
    replica: int
    weight: int = 1                 # sequences (n)
    prefill_tokens: int = 0         # prompt tokens expected to be computed there (not cached)


@dataclass(order=True)
class _Ticket:
    priority: int
    seq: int
    weight: int = field(compare=False)
    digests: Sequence[BlockHash] = field(compare=False)
    num_tokens: int = field(compare=False)
    placed: asyncio.Future = field(compare=False)   # resolves to a Placement


@dataclass
class EngineView:
    """What the queue reads of a replica's engine when it places a request."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    alive: bool = True


class AdmissionQueue:
    def __init__(self, num_replicas: int, slots: int, policy: RoutingPolicy,
                 engine_view: Callable[[int], EngineView], *, max_waiting: int | None = None,
                 reserved: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        assert num_replicas >= 1 and slots >= 1
        self.num_replicas, self.slots, self.policy = num_replicas, slots, policy
        self.max_waiting = max_waiting
        # Default: an eighth of the places, at least one, never all of them.
        self.reserved = min(slots - 1, max(1, slots // 8)) if reserved is None else min(reserved, slots - 1)
        self.in_flight = [0] * num_replicas          # sequences placed on each replica and not yet released
        self.pending_prefill = [0] * num_replicas    # their uncached prompt tokens whose first token is still due
        self._engine_view = engine_view
        self._heap: list[_Ticket] = []
        self._seq = itertools.count()
        self._finishes: deque[float] = deque()
        self._clock = clock
        # Makes what acquire() raises once the server stops taking requests (a new one each time: one raised
        # by many tasks would collect all their frames in its traceback).
        self._closed: Callable[[], Exception] | None = None

    # ---- state -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(1 for t in self._heap if not t.placed.done())

    def cap(self, priority: int) -> int:
        return self.slots if priority <= 0 else self.slots - self.reserved

    def refusal(self, priority: int, weight: int, count: int) -> str | None:
        """Why `count` requests of `weight` sequences each could never all be admitted, even into an idle queue
        (placed or waiting): the reason, else None. Without it such a request waited for ever, or was refused
        with a 429 whose retries could never succeed."""
        cap = self.cap(priority)
        if weight > cap:  # a background request this wide would take the places kept for interactive ones
            return (f"n={weight} is more than the {cap} of a replica's {self.slots} places that requests of "
                    f"priority > 0 may hold ({self.reserved} are kept for priority <= 0): lower n or the priority")
        if self.max_waiting is not None:
            most = self.num_replicas * (cap // weight) + self.max_waiting
            if count > most:
                return (f"{count} prompts are more than this model admits at once ({most}: its replicas' places "
                        f"and max_waiting={self.max_waiting}); send at most {most} per request")
        return None

    def loads(self, priority: int = 0, weight: int = 1) -> list[ReplicaLoad]:
        out = []
        for i in range(self.num_replicas):
            e = self._engine_view(i)
            room = self.in_flight[i] + weight <= max(self.cap(priority), weight)  # max: n = slots, priority 0
            out.append(ReplicaLoad(self.in_flight[i], e.num_running, e.num_waiting, e.kv_cache_usage,
                                   self.pending_prefill[i], available=e.alive and room))
        return out

    def retry_after_s(self) -> int:
        """Seconds until a place is likely to free: the time between finishes, lately."""
        now = self._clock()
        while self._finishes and self._finishes[0] < now - _RATE_WINDOW_S:
            self._finishes.popleft()
        if not self._finishes:
            return 5
        rate = len(self._finishes) / _RATE_WINDOW_S
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(1.0 / rate)))

    # ---- acquire / release -------------------------------------------------------------------------
    async def acquire(self, digests: Sequence[BlockHash], priority: int = 0, weight: int = 1,
                      num_tokens: int = 0) -> Placement:
        """Where this request may run now; waits in line if every replica is full. Cancelling the wait leaves
        the line. Raises QueueFull, or NoReplica when every engine is down. Give the Placement back with
        release(), and say first_token() when its first token arrives."""
        if self._closed is not None:
            raise self._closed()
        if not any(self._engine_view(i).alive for i in range(self.num_replicas)):
            raise NoReplica("no engine of this model is running (being replaced); retry shortly")
        placed: asyncio.Future = asyncio.get_running_loop().create_future()
        ticket = _Ticket(priority, next(self._seq), weight, digests, num_tokens, placed)
        if not self._heap or ticket < self._heap[0]:
            if self._try_place(ticket):
                return placed.result()
        if self.max_waiting is not None and self.num_waiting + 1 > self.max_waiting:
            self._make_room_for(ticket)       # raises QueueFull unless a less urgent waiter can give way
        heapq.heappush(self._heap, ticket)
        self.pump()
        try:
            return await placed
        except asyncio.CancelledError:
            if placed.done() and not placed.cancelled() and placed.exception() is None:   # placed as it left
                self.release(placed.result(), finished=False)
            raise

    def admits(self, priority: int = 0, count: int = 1) -> bool:
        """Whether `count` more requests of this priority would be admitted now (placed, or let into the line)."""
        if self.max_waiting is None or self.num_waiting + count <= self.max_waiting:
            return True
        waiting = [t for t in self._heap if not t.placed.done()]
        if not waiting or priority < min(waiting).priority:
            if any(ld.available for ld in self.loads(priority)):
                return True                   # it would not wait at all
        return sum(t.priority > priority for t in waiting) >= count

    def _make_room_for(self, ticket: _Ticket) -> None:
        """The line is full: the least urgent waiter (latest among equals) leaves it with QueueFull if it is less
        urgent than `ticket`; otherwise `ticket` is the one refused."""
        waiting = [t for t in self._heap if not t.placed.done()]
        worst = max(waiting, key=lambda t: (t.priority, t.seq), default=None)
        error = QueueFull(f"too many requests waiting (max_waiting={self.max_waiting}); retry later",
                          self.retry_after_s())
        if worst is None or worst.priority <= ticket.priority:
            raise error
        worst.placed.set_exception(error)     # its waiter raises QueueFull (429); pump() drops the ticket

    def fail_waiting(self, error: Callable[[], Exception]) -> None:
        """Every waiter leaves the line with error(); later requests are taken as before."""
        for ticket in self._heap:
            if not ticket.placed.done():
                ticket.placed.set_exception(error())
        self._heap.clear()

    def close(self, error: Callable[[], Exception]) -> None:
        """Shutdown: every waiter leaves the line with error(), and later acquire() calls raise one (so that places
        freed by stopped requests are not handed to waiting ones)."""
        self._closed = error
        self.fail_waiting(error)

    def first_token(self, placement: Placement) -> None:
        """Its prompt is computed: no longer prefill work ahead of later requests there."""
        self.pending_prefill[placement.replica] -= placement.prefill_tokens
        placement.prefill_tokens = 0

    def release(self, placement: Placement, finished: bool = True) -> None:
        self.first_token(placement)
        self.in_flight[placement.replica] -= placement.weight
        assert self.in_flight[placement.replica] >= 0
        if finished:
            self._finishes.append(self._clock())
        self.pump()

    def pump(self) -> None:
        """Place waiting requests, best first, while the best one fits somewhere (no overtaking)."""
        while self._heap:
            head = self._heap[0]
            if head.placed.done():            # its waiter left the line
                heapq.heappop(self._heap)
                continue
            if not self._try_place(head):
                return
            heapq.heappop(self._heap)

    def _try_place(self, ticket: _Ticket) -> bool:
        loads = self.loads(ticket.priority, ticket.weight)
        if not any(ld.available for ld in loads):
            return False
        replica = self.policy.choose(ticket.digests, loads)
        if not loads[replica].available:      # a policy must pick among available replicas
            replica = next(i for i, ld in enumerate(loads) if ld.available)
        prefill = max(0, ticket.num_tokens - self.policy.cached_tokens(replica, ticket.digests))
        self.policy.on_routed(replica, ticket.digests)
        self.in_flight[replica] += ticket.weight
        self.pending_prefill[replica] += prefill
        ticket.placed.set_result(Placement(replica, ticket.weight, prefill))
        return True
