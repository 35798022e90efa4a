"""Small helpers for tests that drive LLMEngine step by step."""
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until every request is done; the final output of each, by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block is free or held only by the evictable prefix cache."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
