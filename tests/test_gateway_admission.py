"""The admission queue on its own (no engines): places per replica, the bounded line with 429's Retry-After,
priority order, the places kept for interactive requests, leaving the line, and dead replicas."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.gateway.admission import AdmissionQueue, EngineView, NoReplica, Placement, QueueFull
from kvserve.gateway.routing import LeastLoadedPolicy, RoundRobinPolicy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(replicas: int = 1, slots: int = 4, max_waiting: int | None = 3, reserved: int | None = 1,
         alive: list[bool] | None = None, clock: Clock | None = None) -> AdmissionQueue:
    alive = alive or [True] * replicas
    return AdmissionQueue(replicas, slots, LeastLoadedPolicy(), lambda i: EngineView(alive=alive[i]),
                          max_waiting=max_waiting, reserved=reserved, clock=clock or Clock())


def run(coro):
    return asyncio.run(coro)


def test_places_then_line_then_429_with_retry_after():
    async def main() -> None:
        clock = Clock()
        q = make(slots=2, max_waiting=2, clock=clock)
        assert [(await q.acquire([])).replica for _ in range(2)] == [0, 0]          # both places taken at once
        waiting = [asyncio.create_task(q.acquire([])) for _ in range(2)]
        await asyncio.sleep(0)
        assert q.num_waiting == 2 and not any(t.done() for t in waiting)
        with pytest.raises(QueueFull) as e:
            await q.acquire([])
        assert e.value.retry_after_s == 5                                  # nothing finished yet: a guess
        q.release(Placement(0))                                                       # a place frees: the first in line
        await asyncio.sleep(0)
        assert waiting[0].done() and not waiting[1].done() and q.num_waiting == 1
        q.release(Placement(0))
        await asyncio.sleep(0)
        assert waiting[1].done() and q.num_waiting == 0
        for _ in range(8):                                                 # then one finish a second
            clock.t += 1.0
            q.release(Placement(0))
            await q.acquire([])
        line = [asyncio.create_task(q.acquire([])) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as e:
            await q.acquire([])
        assert e.value.retry_after_s == 1                                  # 10 finishes in the last 10 s
        for t in line:
            t.cancel()
        await asyncio.gather(*line, return_exceptions=True)
    run(main())


def test_priority_order_and_first_come_first_served_within_a_priority():
    async def main() -> None:
        q = make(slots=1, max_waiting=None)
        await q.acquire([])
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            await q.acquire([], priority)
            order.append(name)

        tasks = [asyncio.create_task(wait(n, p)) for n, p in
                 [("bg1", 1), ("a", 0), ("bg2", 1), ("b", 0), ("urgent", -5)]]
        await asyncio.sleep(0)
        for _ in range(5):
            q.release(Placement(0))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["urgent", "a", "b", "bg1", "bg2"]
    run(main())


def test_background_work_leaves_the_reserved_places_to_interactive_requests():
    async def main() -> None:
        q = make(replicas=2, slots=4, max_waiting=None, reserved=1)
        # A burst of background (priority 1) work takes 3 of 4 places on each replica, and then waits.
        placed = [(await q.acquire([], priority=1)).replica for _ in range(6)]
        assert sorted(placed) == [0, 0, 0, 1, 1, 1]
        more = asyncio.create_task(q.acquire([], priority=1))
        await asyncio.sleep(0)
        assert not more.done()
        # An interactive request (priority 0) still starts at once, on a reserved place.
        assert (await asyncio.wait_for(q.acquire([], priority=0), 1)).replica in (0, 1)
        more.cancel()
    run(main())


def test_requests_that_could_never_all_be_admitted_are_named():
    """A background request wider than its places took the reserved ones too (interactive requests then waited
    for it to end); a batch of more prompts than places and line together got 429s that no retry could pass."""
    q = make(replicas=2, slots=4, max_waiting=3, reserved=1)
    assert q.refusal(priority=1, weight=3, count=1) is None
    assert q.refusal(priority=0, weight=4, count=1) is None
    assert "n=4 is more than the 3 of a replica's 4 places" in q.refusal(priority=1, weight=4, count=1)
    assert q.refusal(priority=0, weight=1, count=11) is None                  # 2 x 4 places + 3 waiting
    assert "12 prompts are more than this model admits at once (11" in q.refusal(priority=0, weight=1, count=12)
    assert "(7: " in q.refusal(priority=0, weight=2, count=8)                 # 2 x 2 places of two sequences + 3
    assert "(9: " in q.refusal(priority=1, weight=1, count=10)                # 2 x 3 background places + 3
    assert make(max_waiting=None).refusal(priority=0, weight=1, count=10_000) is None


def test_a_full_line_refuses_the_least_urgent_request():
    async def main() -> None:
        q = make(slots=1, max_waiting=2, reserved=0)
        await q.acquire([])
        background = [asyncio.create_task(q.acquire([], priority=1)) for _ in range(2)]
        await asyncio.sleep(0)
        assert q.num_waiting == 2 and not q.admits(priority=1) and q.admits(priority=0)
        with pytest.raises(QueueFull):                                       # as urgent as the line: refused
            await q.acquire([], priority=1)
        interactive = asyncio.create_task(q.acquire([], priority=0))       # more urgent: the last waiter gives way
        for _ in range(3):
            await asyncio.sleep(0)
        assert background[1].done() and isinstance(background[1].exception(), QueueFull)
        assert q.num_waiting == 2 and not background[0].done()
        q.release(Placement(0))
        assert (await asyncio.wait_for(interactive, 1)).replica == 0                 # and is served first
        assert not background[0].done()
        background[0].cancel()
        await asyncio.gather(*background, return_exceptions=True)
    run(main())


def test_leaving_the_line_frees_its_turn():
    async def main() -> None:
        q = make(slots=1, max_waiting=1)
        await q.acquire([])
        gone = asyncio.create_task(q.acquire([]))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert q.num_waiting == 0
        stays = asyncio.create_task(q.acquire([]))                          # the line has room again
        await asyncio.sleep(0)
        q.release(Placement(0))
        assert (await asyncio.wait_for(stays, 1)).replica == 0
        assert q.in_flight == [1]
    run(main())


def test_closing_sends_every_waiter_away_and_refuses_later_requests():
    """Shutdown: the places stopped requests give back must not admit the line behind them."""
    async def main() -> None:
        q = make(slots=1, max_waiting=3)
        running = await q.acquire([])
        line = [asyncio.create_task(q.acquire([], priority=p)) for p in (0, 1)]
        await asyncio.sleep(0)
        q.close(lambda: RuntimeError("shutting down"))
        results = await asyncio.gather(*line, return_exceptions=True)
        assert [str(r) for r in results] == ["shutting down"] * 2 and q.num_waiting == 0
        q.release(running)                                                  # nobody is placed on the freed place
        assert q.in_flight == [0]
        with pytest.raises(RuntimeError, match="shutting down"):
            await q.acquire([])
    run(main())


def test_weights_count_sequences():
    async def main() -> None:
        q = make(slots=4, max_waiting=None, reserved=0)
        await q.acquire([], weight=3)                                       # n = 3
        waiting = asyncio.create_task(q.acquire([], weight=2))
        await asyncio.sleep(0)
        assert not waiting.done()
        q.release(Placement(0, weight=3))
        assert (await asyncio.wait_for(waiting, 1)).replica == 0 and q.in_flight == [2]
    run(main())


def test_pending_prefill_counts_uncached_prompt_tokens_until_the_first_token():
    async def main() -> None:
        from kvserve.engine.block_hash import block_hashes
        from kvserve.gateway.routing import CacheAwarePolicy

        q = AdmissionQueue(2, 8, CacheAwarePolicy(2), lambda i: EngineView(), max_waiting=None)
        prompt = list(range(100))                       # 6 full blocks of 16, and 4 tokens more
        first = await q.acquire(block_hashes(prompt, 16), num_tokens=100)
        assert first.prefill_tokens == 100 and q.pending_prefill[first.replica] == 100
        # The same prompt again goes where the first went (its blocks will be there), though it is the busier.
        same = await q.acquire(block_hashes(prompt, 16), num_tokens=100)
        assert same.replica == first.replica and same.prefill_tokens == 4
        # A new prompt goes where less prefill is due.
        other = await q.acquire(block_hashes(list(range(500, 600)), 16), num_tokens=100)
        assert other.replica != first.replica
        q.first_token(first)
        assert q.pending_prefill[first.replica] == 4 and q.pending_prefill[other.replica] == 100
        # Far enough behind (here 2 x 96 cached tokens), the warm replica gives the prompt up.
        q.pending_prefill[first.replica] += 300
        elsewhere = await q.acquire(block_hashes(prompt, 16), num_tokens=100)
        assert elsewhere.replica == other.replica
        q.pending_prefill[first.replica] -= 300
        for p in (first, same, other, elsewhere):
            q.release(p)
        assert q.pending_prefill == [0, 0] and q.in_flight == [0, 0]
    run(main())


def test_dead_replicas_are_skipped_and_all_dead_is_refused():
    async def main() -> None:
        alive = [False, True]
        q = AdmissionQueue(2, 4, RoundRobinPolicy(), lambda i: EngineView(alive=alive[i]), max_waiting=4)
        assert {(await q.acquire([])).replica for _ in range(3)} == {1}
        alive[1] = False
        with pytest.raises(NoReplica):
            await q.acquire([])
    run(main())
