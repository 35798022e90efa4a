"""The routing policies as plain objects (no engines): prefix affinity by the engine's own block digests,
balance against load, and the known failure modes of cache-aware routers: all traffic collapsing onto one
replica, and cache misses sent to the emptiest cache regardless of load."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.engine.block_hash import block_hashes
from kvserve.gateway.routing import (
    CacheAwarePolicy,
    DigestLRU,
    LeastLoadedPolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    make_policy,
)

BS = 16


def prompt(group: int, suffix: int, prefix_blocks: int = 8, suffix_tokens: int = 20) -> list[int]:
    """A shared prefix per group (block-aligned) and a distinct suffix per request."""
    rng = random.Random(group)
    prefix = [rng.randrange(1000) for _ in range(prefix_blocks * BS)]
    return prefix + [1000 + suffix * 7 + i for i in range(suffix_tokens)]


def digests(ids: list[int], salt: str | None = None) -> list[bytes]:
    return block_hashes(ids, BS, salt)


class Pool:
    """Replicas whose load is what the policy sent them minus what finished: the router's own view."""

    def __init__(self, policy, n: int) -> None:
        self.policy, self.in_flight = policy, [0] * n

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(in_flight=q) for q in self.in_flight]

    def send(self, ids: list[int], salt: str | None = None) -> int:
        d = digests(ids, salt)
        r = self.policy.choose(d, self.loads())
        self.policy.on_routed(r, d)
        self.in_flight[r] += 1
        return r

    def finish(self, r: int) -> None:
        self.in_flight[r] -= 1


def test_same_prefix_goes_where_it_went_before():
    pool = Pool(CacheAwarePolicy(4), 4)
    first = {g: pool.send(prompt(g, 0)) for g in range(4)}
    for r in first.values():
        pool.finish(r)
    # Four groups on four idle replicas: spread one per replica, not stacked on replica 0.
    assert sorted(first.values()) == [0, 1, 2, 3]
    for s in range(1, 6):
        for g in range(4):
            r = pool.send(prompt(g, s))
            pool.finish(r)
            assert r == first[g]


def test_cache_salt_separates_affinity():
    pool = Pool(CacheAwarePolicy(2), 2)
    a = pool.send(prompt(0, 0), salt="tenant-a")
    # The same tokens under another salt share no digest with it: a miss, to the less loaded replica.
    b = pool.send(prompt(0, 1), salt="tenant-b")
    assert a != b
    assert digests(prompt(0, 0), "tenant-a")[0] != digests(prompt(0, 0), "tenant-b")[0]
    assert digests(prompt(0, 0), "tenant-a")[0] != digests(prompt(0, 0))[0]


def test_hot_prefix_does_not_collapse_onto_one_replica():
    """One prefix for every request, none finishing: affinity alone would put all 40 on one replica."""
    policy = CacheAwarePolicy(2, balance_abs=4, balance_rel=1.5)
    pool = Pool(policy, 2)
    for s in range(40):
        pool.send(prompt(0, s))
    assert min(pool.in_flight) >= 15, pool.in_flight
    assert max(pool.in_flight) - min(pool.in_flight) <= policy.balance_abs + 1


def test_many_prefixes_under_load_stay_balanced_and_mostly_warm():
    """Zipf-skewed groups, requests finishing at random: most requests land where their prefix already is,
    and whenever the load gap exceeds the tolerance the next request evens it out."""
    rng = random.Random(0)
    policy = CacheAwarePolicy(2, balance_abs=4)
    pool = Pool(policy, 2)
    weights = [1 / (g + 1) for g in range(12)]
    warm = 0
    seen: dict[int, set[int]] = {}
    first: dict[int, int] = {}
    running: list[int] = []
    for s in range(600):
        g = rng.choices(range(12), weights)[0]
        before = list(pool.in_flight)
        r = pool.send(prompt(g, s))
        if abs(before[0] - before[1]) > policy.balance_abs:
            assert before[r] == min(before), (before, r)
        warm += r in seen.get(g, set())
        first.setdefault(g, r)
        seen.setdefault(g, set()).add(r)
        running.append(r)
        while len(running) > 8:                       # about 8 in flight; a random one finishes
            pool.finish(running.pop(rng.randrange(len(running))))
    assert warm / 600 > 0.9
    # Both replicas took a fair part of the groups (no single warm replica hoarding every new prefix).
    firsts = Counter(first.values())
    assert len(first) == 12 and firsts[0] >= 3 and firsts[1] >= 3, firsts


def test_miss_goes_to_the_least_loaded_replica_not_the_emptiest_cache():
    policy = CacheAwarePolicy(2)
    policy.on_routed(1, digests(prompt(7, 0)))        # replica 1 has cached a lot; replica 0 nothing
    for g in range(8, 20):
        policy.on_routed(1, digests(prompt(g, 0)))
    loads = [ReplicaLoad(in_flight=3), ReplicaLoad(in_flight=1)]   # but replica 0 is busier
    assert policy.choose(digests(prompt(99, 0)), loads) == 1
    # Equal load: then the emptier cache takes the new prefix (room for it without evicting).
    assert policy.choose(digests(prompt(99, 0)), [ReplicaLoad(in_flight=2), ReplicaLoad(in_flight=2)]) == 0
    # Prefill still due counts before request counts: the replica with less of it takes the miss.
    loads = [ReplicaLoad(in_flight=1, pending_prefill_tokens=600), ReplicaLoad(in_flight=3)]
    assert policy.choose(digests(prompt(99, 0)), loads) == 1


def test_affinity_is_weighed_against_the_prefill_due_on_the_warm_replica():
    policy = CacheAwarePolicy(2)
    d = digests(prompt(0, 0))                             # 8 full blocks: 128 tokens cached on replica 0
    policy.on_routed(0, d)
    # A cached token weighs twice a pending one: it stays while less than 2 x 128 tokens are due there.
    assert policy.choose(d, [ReplicaLoad(pending_prefill_tokens=200), ReplicaLoad()]) == 0
    assert policy.choose(d, [ReplicaLoad(pending_prefill_tokens=300), ReplicaLoad()]) == 1


def test_affinity_yields_to_a_large_imbalance_and_a_full_kv_cache():
    policy = CacheAwarePolicy(2, balance_abs=4, balance_rel=1.5)
    d = digests(prompt(0, 0))
    policy.on_routed(0, d)
    assert policy.choose(d, [ReplicaLoad(in_flight=4), ReplicaLoad(in_flight=1)]) == 0   # within tolerance
    assert policy.choose(d, [ReplicaLoad(in_flight=9), ReplicaLoad(in_flight=1)]) == 1   # beyond it
    # The engine's own numbers count too (requests it holds that the gateway's count has not seen).
    assert policy.choose(d, [ReplicaLoad(num_running=8, num_waiting=3), ReplicaLoad()]) == 1
    assert policy.choose(d, [ReplicaLoad(kv_cache_usage=0.99), ReplicaLoad()]) == 1
    # Unavailable replicas (dead, or no free slot) are never chosen while another is available.
    assert policy.choose(d, [ReplicaLoad(available=False), ReplicaLoad(in_flight=50)]) == 1


def test_partial_prefix_match_counts_and_short_prompts_fall_back_to_load():
    policy = CacheAwarePolicy(2)
    policy.on_routed(1, digests(prompt(0, 0)))
    longer = prompt(0, 0)[: 8 * BS] + list(range(5000, 5000 + 4 * BS))   # same 8 prefix blocks, new tail
    assert policy.choose(digests(longer), [ReplicaLoad(), ReplicaLoad()]) == 1
    # Under one block: no digest at all; the less loaded replica.
    assert policy.choose(digests([1, 2, 3]), [ReplicaLoad(in_flight=2), ReplicaLoad(in_flight=1)]) == 1


def test_digest_lru_is_bounded_and_keeps_shared_prefixes():
    lru = DigestLRU(capacity=20)
    shared = digests(prompt(0, 0, prefix_blocks=4, suffix_tokens=0))
    for s in range(30):
        lru.add_all(digests(prompt(0, 0, prefix_blocks=4, suffix_tokens=0) + list(range(100 * s, 100 * s + BS))))
        assert len(lru) <= 20
    assert lru.matched_blocks(shared) == 4                 # touched by every request: never evicted
    assert lru.matched_blocks(digests(list(range(0, BS)))) == 0


def test_round_robin_and_least_loaded():
    rr = Pool(RoundRobinPolicy(), 3)
    assert [rr.send(prompt(0, s)) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = LeastLoadedPolicy()
    assert ll.choose([], [ReplicaLoad(in_flight=2), ReplicaLoad(in_flight=0), ReplicaLoad(in_flight=1)]) == 1
    # Ties are taken in turn, so an idle pool is used evenly.
    picks = Counter(ll.choose([], [ReplicaLoad(), ReplicaLoad()]) for _ in range(10))
    assert picks[0] == picks[1] == 5
    assert RoundRobinPolicy().choose([], [ReplicaLoad(available=False), ReplicaLoad()]) == 1


def test_make_policy():
    assert make_policy("cache_aware", 2).name == "cache_aware"
    assert make_policy("least_loaded", 2).name == "least_loaded"
    assert make_policy("round_robin", 2).name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 2)
