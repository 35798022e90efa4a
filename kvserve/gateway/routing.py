"""Which replica of a model serves a request: round_robin, least_loaded, or cache_aware.

The policies are plain objects over plain data (the prompt's block digests and a load snapshot per
replica), so they are tested without engines. cache_aware keeps, per replica, an approximate and bounded
(LRU) set of the block digests it has sent there: the same sha256 chain the engine's prefix cache keys its
blocks by (kvserve/engine/block_hash.py, DESIGN.md §7), so "this replica has seen this prefix" is a lookup,
and a request's cache_salt keeps salted prefixes apart exactly as in the engine.

cache_aware, per request (in this order):
  1. Replicas whose KV cache is nearly full (kv_cache_usage >= kv_full) are avoided while another is not:
     a warm prefix there would only be evicted to make room.
  2. Imbalance first: when the busiest replica holds more than `balance_abs` requests more than the idlest
     and more than `balance_rel` times as many, the request goes to the least loaded one. A hot prefix
     therefore spills onto a second replica (which then learns it) instead of collapsing onto one.
  3. Otherwise the replica with the least prefill work ahead of this request's first token, counted in
     prompt tokens: those routed there and not yet answered (pending_prefill), less `cache_weight` (2) times
     the prompt's tokens that replica has cached. A cached token weighs double: computing the prefix again
     elsewhere costs its time now and, on a full cache, another prefix's room there later. So a warm
     replica keeps its prefix's traffic until it is behind by twice what it saves. Ties: the longer match,
     then fewer requests.
  4. So a miss (no replica has any of the prompt) goes to the replica with the least pending prefill and
     then the fewest requests, not to the one with the emptiest cache, which only breaks remaining ties.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.block_hash import BlockHash


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it when it decides."""
    in_flight: int = 0           # requests the gateway has sent there that have not finished (exact, current)
    num_running: int = 0         # from the engine's last step stats (one step old)
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    pending_prefill_tokens: int = 0  # prompt tokens routed there, not cached there, whose first token is still due
    # False while its engine process is down or being replaced, or it has no free slot for this request.
    available: bool = True

    @property
    def queue(self) -> int:
        """Requests there now: the gateway's own count, or the engine's if it reports more."""
        return max(self.in_flight, self.num_running + self.num_waiting)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, digests: Sequence[BlockHash], loads: Sequence[ReplicaLoad]) -> int:
        """The index of the replica to send a prompt with these full-block digests to."""

    def on_routed(self, replica: int, digests: Sequence[BlockHash]) -> None:
        """The request went to `replica` (what cache_aware learns from)."""

    def cached_tokens(self, replica: int, digests: Sequence[BlockHash]) -> int:
        """Prompt tokens `replica` probably has in its prefix cache (0 for policies that do not track it)."""


def _candidates(loads: Sequence[ReplicaLoad]) -> list[int]:
    available = [i for i, ld in enumerate(loads) if ld.available]
    return available or list(range(len(loads)))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, digests: Sequence[BlockHash], loads: Sequence[ReplicaLoad]) -> int:
        candidates = _candidates(loads)
        for _ in range(len(loads)):
            i = self._next % len(loads)
            self._next += 1
            if i in candidates:
                return i
        return candidates[0]

    def on_routed(self, replica: int, digests: Sequence[BlockHash]) -> None:
        pass

    def cached_tokens(self, replica: int, digests: Sequence[BlockHash]) -> int:
        return 0


class LeastLoadedPolicy:
    """Fewest requests in flight; ties in turn (so an idle pool is used evenly, not replica 0 first)."""
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, digests: Sequence[BlockHash], loads: Sequence[ReplicaLoad]) -> int:
        candidates = _candidates(loads)
        best = min(loads[i].queue for i in candidates)
        tied = [i for i in candidates if loads[i].queue == best]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def on_routed(self, replica: int, digests: Sequence[BlockHash]) -> None:
        pass

    def cached_tokens(self, replica: int, digests: Sequence[BlockHash]) -> int:
        return 0


class DigestLRU:
    """A bounded set of block digests, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._d: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, digest: BlockHash) -> bool:
        return digest in self._d

    def add_all(self, digests: Sequence[BlockHash]) -> None:
        # Deepest block first, so the shallow ones (shared by more prompts) are the most recent.
        for digest in reversed(digests):
            self._d[digest] = None
            self._d.move_to_end(digest)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def matched_blocks(self, digests: Sequence[BlockHash]) -> int:
        """Leading blocks of the prompt this replica has seen. A digest stands for its whole prefix, so the
        deepest digest present gives the match (earlier ones may have been evicted on their own)."""
        for i in range(len(digests) - 1, -1, -1):
            if digests[i] in self._d:
                return i + 1
        return 0


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, num_replicas: int, *, block_size: int = 16, max_digests_per_replica: int = 65536,
                 balance_abs: int = 4, balance_rel: float = 1.5, kv_full: float = 0.95,
                 cache_weight: float = 2.0) -> None:
        self.block_size, self.cache_weight = block_size, cache_weight
        self.maps = [DigestLRU(max_digests_per_replica) for _ in range(num_replicas)]
        self.balance_abs, self.balance_rel, self.kv_full = balance_abs, balance_rel, kv_full
        self._turn = 0

    def choose(self, digests: Sequence[BlockHash], loads: Sequence[ReplicaLoad]) -> int:
        candidates = _candidates(loads)
        roomy = [i for i in candidates if loads[i].kv_cache_usage < self.kv_full]
        candidates = roomy or candidates
        queues = {i: loads[i].queue for i in candidates}
        lo, hi = min(queues.values()), max(queues.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            candidates = [i for i in candidates if queues[i] == lo]
        matched = {i: self.maps[i].matched_blocks(digests) for i in candidates}
        # Prefill work before this request's first token there, in tokens, less the weighted cached part (the
        # prompt's own length, the same everywhere, left out).
        cost = {i: loads[i].pending_prefill_tokens - self.cache_weight * matched[i] * self.block_size
                for i in candidates}
        best = min(cost.values())
        tied = [i for i in candidates if cost[i] == best]
        if len(tied) > 1:
            longest = max(matched[i] for i in tied)
            tied = [i for i in tied if matched[i] == longest]
        if len(tied) > 1:
            fewest = min(queues[i] for i in tied)
            tied = [i for i in tied if queues[i] == fewest]
        if len(tied) > 1:
            # Only now the emptier cache: a new prefix there evicts nothing another replica would miss.
            smallest = min(len(self.maps[i]) for i in tied)
            tied = [i for i in tied if len(self.maps[i]) == smallest]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def on_routed(self, replica: int, digests: Sequence[BlockHash]) -> None:
        self.maps[replica].add_all(digests)

    def cached_tokens(self, replica: int, digests: Sequence[BlockHash]) -> int:
        return self.maps[replica].matched_blocks(digests) * self.block_size

    def forget(self, replica: int) -> None:
        """The replica's engine was replaced: its prefix cache is empty."""
        self.maps[replica] = DigestLRU(self.maps[replica].capacity)


def make_policy(name: str, num_replicas: int, block_size: int = 16) -> RoundRobinPolicy | LeastLoadedPolicy | CacheAwarePolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(num_replicas, block_size=block_size)
    raise ValueError(f"unknown routing policy {name!r} (cache_aware | least_loaded | round_robin)")
