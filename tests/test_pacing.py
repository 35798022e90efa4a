"""LoopPacer (kvserve/entrypoints/openai/pacing.py): a burst of new requests is let through at most
per_turn per event-loop turn, first come first served, so other work (a /health request) runs between."""
from __future__ import annotations

import asyncio

from kvserve.entrypoints.openai.pacing import LoopPacer

PER_TURN = 4


def test_a_burst_passes_per_turn_in_order_and_other_work_runs_between():
    async def main() -> None:
        pacer = LoopPacer(PER_TURN)
        passed: list[int] = []
        turns: list[int] = []   # how many had passed each time a plain callback ran (one per loop turn)

        async def request(i: int) -> None:
            await pacer.turn()
            passed.append(i)

        loop = asyncio.get_running_loop()

        def tick() -> None:
            turns.append(len(passed))
            if len(passed) < 40:
                loop.call_soon(tick)

        tasks = [asyncio.create_task(request(i)) for i in range(40)]
        loop.call_soon(tick)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

        assert passed == list(range(40))                      # first come, first served
        steps = [b - a for a, b in zip([0, *turns], turns)]
        assert max(steps) <= PER_TURN                          # never more than per_turn in one turn
        assert len(turns) >= 40 // PER_TURN                    # the loop turned between the slices

        # Once the burst is over, a lone request passes at once (no turn wasted).
        before = len(passed)
        await asyncio.sleep(0)
        await pacer.turn()
        assert len(passed) == before

    asyncio.run(main())


def test_a_cancelled_waiter_gives_up_its_place():
    async def main() -> None:
        pacer = LoopPacer(1)
        order: list[str] = []

        async def request(name: str) -> None:
            await pacer.turn()
            order.append(name)

        a, b, c = (asyncio.create_task(request(n)) for n in "abc")
        await asyncio.sleep(0)          # a passes; b and c wait
        b.cancel()
        await asyncio.wait_for(asyncio.gather(a, c, b, return_exceptions=True), 10)
        assert order == ["a", "c"]
        assert not pacer._waiters

    asyncio.run(main())
