"""A step that touches hundreds of streams must not hold the server's event loop for all of them at once:
AsyncLLM wakes them a slice per loop turn, so /health and new connections get a turn in between, and each
stream still receives its deltas in order. No engine: step results are fed to AsyncLLM as the engine's
receiver would, and the streams are consumed by real AsyncLLM.generate iterators."""
from __future__ import annotations

import asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_process import RequestError, StepResult
from kvserve.engine.stats import EngineStats
from kvserve.entrypoints.async_llm import _DELIVERY_SLICE, AsyncLLM, EngineDeadError, EngineRequestError
from kvserve.outputs import CompletionDelta, RequestDelta
from kvserve.sampling_params import SamplingParams

NUM_STREAMS = 200


def _step(ids: list[str], token: int, finished: bool, errors: list[RequestError] = ()) -> StepResult:
    outputs = [RequestDelta(rid, [CompletionDelta(0, [token], f"t{token}", finish_reason="length" if finished
                                                  else None)], finished, num_prompt_tokens=3) for rid in ids]
    return StepResult(outputs, list(errors), EngineStats(), num_added=len(ids), step_time=0.0, stepped=True)


def _engine() -> AsyncLLM:
    llm = AsyncLLM(EngineConfig(), mode="thread")   # never started: the test plays the engine
    llm._send = lambda msg: None
    return llm


async def _consume(llm: AsyncLLM, rid: str, got: dict[str, list], woken: list[str]) -> None:
    try:
        async for delta in llm.generate([1, 2, 3], SamplingParams(max_tokens=2), request_id=rid):
            woken.append(rid)
            got[rid].extend(delta.outputs[0].token_ids)
    except (EngineRequestError, EngineDeadError) as e:
        got[rid].append(type(e).__name__)


def test_a_big_step_is_delivered_a_slice_per_loop_turn_in_order():
    async def main() -> None:
        llm = _engine()
        ids = [f"r{i}" for i in range(NUM_STREAMS)]
        got: dict[str, list] = {rid: [] for rid in ids}
        woken: list[str] = []
        tasks = [asyncio.create_task(_consume(llm, rid, got, woken)) for rid in ids]
        await asyncio.sleep(0)                       # every stream is registered and waiting

        seen_by_other_callbacks: list[int] = []
        def other() -> None:                        # e.g. the socket read of a /health request
            seen_by_other_callbacks.append(len(woken))
        # Two steps arrive back to back, the second before the first is delivered; one stream fails.
        llm._on_step(_step(ids, 10, finished=False))
        asyncio.get_running_loop().call_soon(other)
        llm._on_step(_step(ids[1:], 11, finished=True, errors=[RequestError("r0", "bad", False)]))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

        # The loop ran other work after at most a slice of streams had been woken, not after all of them.
        assert seen_by_other_callbacks and seen_by_other_callbacks[0] <= _DELIVERY_SLICE
        assert got["r0"] == [10, "EngineRequestError"]
        assert all(got[rid] == [10, 11] for rid in ids[1:])
        assert not llm._streams and not llm._outbox

    asyncio.run(main())


def test_an_engine_death_delivers_what_came_before_it_then_the_error():
    async def main() -> None:
        llm = _engine()
        ids = [f"r{i}" for i in range(3 * _DELIVERY_SLICE)]
        got: dict[str, list] = {rid: [] for rid in ids}
        tasks = [asyncio.create_task(_consume(llm, rid, got, [])) for rid in ids]
        await asyncio.sleep(0)
        llm._on_step(_step(ids, 7, finished=False))
        llm._mark_dead("engine process died")        # before the slices went out
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(got[rid] == [7, "EngineDeadError"] for rid in ids)

    asyncio.run(main())
