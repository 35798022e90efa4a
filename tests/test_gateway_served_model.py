"""A ServedModel over a real (tiny) engine in this process: what its admission queue learns from the requests
that pass through it."""
from __future__ import annotations

import asyncio
import contextlib

from kvserve.config import EngineConfig
from kvserve.gateway.served_model import ServedModel
from kvserve.sampling_params import SamplingParams


def test_only_requests_that_ran_to_their_end_set_retry_after(tiny_model_dirs):
    """Retry-After is the recent time between finishes. Requests whose clients left (or whose engine died) had
    counted as finishes too, so after a burst of them a 429 said "retry in 1 s" while nothing was draining."""
    config = EngineConfig(model=str(tiny_model_dirs["llama"][0]), dtype="float32", max_model_len=256,
                          num_kv_blocks=64, num_threads=1)

    async def main() -> tuple[int, int]:
        model = ServedModel("tiny", config, engine_mode="thread")
        await model.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            for i in range(5):  # clients that leave after the first token
                gen = model.generate([1, 2, 3, i], params, request_id=f"left-{i}")
                async with contextlib.aclosing(gen):
                    await anext(gen)
            after_leaving = model.queue.retry_after_s()
            async for _ in model.generate([4, 5, 6], SamplingParams(max_tokens=2), request_id="done"):
                pass
            return after_leaving, model.queue.retry_after_s()
        finally:
            await model.shutdown()

    after_leaving, after_one_finish = asyncio.run(main())
    assert after_leaving == 5            # nothing finished: the queue's guess, not 2 s from 5 "finishes"
    assert after_one_finish == 10        # one finish in the last 10 s


def test_requests_waiting_while_no_engine_can_run_are_answered(tiny_model_dirs, tmp_path):
    """An engine that dies and cannot be restarted (here its model directory is gone): requests arriving then were
    refused at once (503), but those already waiting in line were held until their clients gave up."""
    import os
    import shutil
    import signal

    from kvserve.entrypoints.async_llm import EngineDeadError
    from kvserve.gateway.admission import NoReplica

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dirs["llama"][0], model_dir)
    config = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, num_threads=1,
                          max_num_seqs=1)

    async def consume(gen) -> str:
        try:
            async for _ in gen:
                pass
        except (EngineDeadError, NoReplica) as e:
            return type(e).__name__
        return "finished"

    async def main() -> tuple[str, str, float]:
        model = ServedModel("tiny", config, engine_mode="process")
        model.all_dead_wait_s = 1.0
        await model.start()
        try:
            running = asyncio.create_task(consume(model.generate(
                [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), request_id="running")))
            while not model.queue.in_flight[0]:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(consume(model.generate([4, 5], SamplingParams(max_tokens=2),
                                                                 request_id="waiting")))
            while not model.queue.num_waiting:
                await asyncio.sleep(0.01)
            shutil.rmtree(model_dir)
            os.kill(model.replicas[0].engine_pid, signal.SIGKILL)
            t0 = asyncio.get_running_loop().time()
            ran, waited = await asyncio.wait_for(asyncio.gather(running, waiting), 60)
            return ran, waited, asyncio.get_running_loop().time() - t0
        finally:
            await model.shutdown()

    ran, waited, seconds = asyncio.run(main())
    assert (ran, waited) == ("EngineDeadError", "NoReplica") and seconds < 10, (ran, waited, seconds)
    # The shutdown cancelled a restart while it stopped the failed engine: its zmq sockets had been left open, and
    # the garbage collector's Context.term() then blocked for good (the next test hung).
    import gc
    import threading
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(20)
    assert not collector.is_alive(), "collecting the shut-down model's objects blocked"
