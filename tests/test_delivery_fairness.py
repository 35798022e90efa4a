"""A step that touches hundreds of streams must not hold the server's event loop for all of them at once:
AsyncLLM wakes them a slice per loop turn, so /health and new connections get a turn in between, and each
stream still receives its deltas in order. And each delta reaches the stream of the submission it belongs to,
also when a client reuses a request_id right after leaving its first stream. No engine: step results are fed
to AsyncLLM as the engine's receiver would, and the streams are consumed by real AsyncLLM.generate
iterators."""
from __future__ import annotations

import asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_process import AbortRequest, AddRequest, RequestError, StepResult
from kvserve.engine.stats import EngineStats
from kvserve.entrypoints.async_llm import _DELIVERY_SLICE, AsyncLLM, EngineDeadError, EngineRequestError
from kvserve.outputs import CompletionDelta, RequestDelta
from kvserve.sampling_params import SamplingParams

NUM_STREAMS = 200


def _step(ids: list[str], token: int, finished: bool, errors: list[RequestError] = ()) -> StepResult:
    outputs = [RequestDelta(rid, [CompletionDelta(0, [token], f"t{token}", finish_reason="length" if finished
                                                  else None)], finished, num_prompt_tokens=3) for rid in ids]
    return StepResult(outputs, list(errors), EngineStats(), num_added=len(ids), step_time=0.0, stepped=True)


def _engine() -> tuple[AsyncLLM, list]:
    """An AsyncLLM that is never started (the test plays the engine) and the messages it sends the engine."""
    llm = AsyncLLM(EngineConfig(), mode="thread")
    sent: list = []
    llm._send = sent.append
    return llm, sent


def _engine_ids(sent: list, ids: list[str]) -> dict[str, str]:
    """The engine's id of each stream, from the AddRequests sent (in the order the streams started)."""
    added = [m.request_id for m in sent if isinstance(m, AddRequest)]
    assert len(added) == len(ids)
    return dict(zip(ids, added))


async def _consume(llm: AsyncLLM, rid: str, got: dict[str, list], woken: list[str]) -> None:
    try:
        async for delta in llm.generate([1, 2, 3], SamplingParams(max_tokens=2), request_id=rid):
            woken.append(rid)
            got[rid].extend(delta.outputs[0].token_ids)
    except (EngineRequestError, EngineDeadError) as e:
        got[rid].append(type(e).__name__)


def test_a_big_step_is_delivered_a_slice_per_loop_turn_in_order():
    async def main() -> None:
        llm, sent = _engine()
        ids = [f"r{i}" for i in range(NUM_STREAMS)]
        got: dict[str, list] = {rid: [] for rid in ids}
        woken: list[str] = []
        tasks = [asyncio.create_task(_consume(llm, rid, got, woken)) for rid in ids]
        await asyncio.sleep(0)                       # every stream is registered and waiting
        eid = _engine_ids(sent, ids)

        seen_by_other_callbacks: list[int] = []
        def other() -> None:                        # e.g. the socket read of a /health request
            seen_by_other_callbacks.append(len(woken))
        # Two steps arrive back to back, the second before the first is delivered; one stream fails.
        llm._on_step(_step([eid[r] for r in ids], 10, finished=False))
        asyncio.get_running_loop().call_soon(other)
        llm._on_step(_step([eid[r] for r in ids[1:]], 11, finished=True,
                           errors=[RequestError(eid["r0"], "bad", False)]))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

        # The loop ran other work after at most a slice of streams had been woken, not after all of them.
        assert seen_by_other_callbacks and seen_by_other_callbacks[0] <= _DELIVERY_SLICE
        assert got["r0"] == [10, "EngineRequestError"]
        assert all(got[rid] == [10, 11] for rid in ids[1:])
        assert not llm._streams and not llm._outbox

    asyncio.run(main())


def test_an_engine_death_delivers_what_came_before_it_then_the_error():
    async def main() -> None:
        llm, sent = _engine()
        ids = [f"r{i}" for i in range(3 * _DELIVERY_SLICE)]
        got: dict[str, list] = {rid: [] for rid in ids}
        tasks = [asyncio.create_task(_consume(llm, rid, got, [])) for rid in ids]
        await asyncio.sleep(0)
        eid = _engine_ids(sent, ids)
        llm._on_step(_step([eid[r] for r in ids], 7, finished=False))
        llm._mark_dead("engine process died")        # before the slices went out
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(got[rid] == [7, "EngineDeadError"] for rid in ids)

    asyncio.run(main())


def test_a_reused_request_id_gets_none_of_the_aborted_requests_steps():
    """A client leaves a stream, then at once sends another request with the same request_id (a retry after a
    timeout). Steps the engine made for the first before it saw the abort arrive afterwards: they must reach
    neither the new stream nor end it, and the first is aborted by its own id, not the new one's."""
    async def main() -> None:
        llm, sent = _engine()
        got: dict[str, list] = {"r": []}
        first = asyncio.create_task(_consume(llm, "r", got, []))
        await asyncio.sleep(0)
        old = _engine_ids(sent, ["r"])["r"]
        llm._on_step(_step([old], 1, finished=False))
        await asyncio.sleep(0)
        first.cancel()                               # the client went away
        await asyncio.gather(first, return_exceptions=True)
        assert got["r"] == [1] and [m.request_ids for m in sent if isinstance(m, AbortRequest)] == [[old]]

        got = {"r": []}
        second = asyncio.create_task(_consume(llm, "r", got, []))
        await asyncio.sleep(0)
        new = [m.request_id for m in sent if isinstance(m, AddRequest)][-1]
        assert new != old
        llm._on_step(_step([old], 2, finished=True))  # made before the engine handled the abort
        llm._on_step(_step([new], 5, finished=False))
        llm._on_step(_step([new], 6, finished=True))
        await asyncio.wait_for(second, 10)
        assert got["r"] == [5, 6]
        assert len([m for m in sent if isinstance(m, AbortRequest)]) == 1  # the second finished: no abort
        assert not llm._streams and not llm._client_ids

    asyncio.run(main())


def test_a_request_id_is_refused_while_its_stream_is_live():
    async def main() -> None:
        llm, _ = _engine()
        got: dict[str, list] = {"r": []}
        task = asyncio.create_task(_consume(llm, "r", got, []))
        await asyncio.sleep(0)
        dup: dict[str, list] = {"r": []}
        await _consume(llm, "r", dup, [])
        assert dup["r"] == ["EngineRequestError"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
