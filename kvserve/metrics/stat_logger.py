"""A log line every few seconds while the engine is busy, in the spirit of vLLM's:
throughput, running/waiting, KV usage, prefix-cache hit rate, and with speculative decoding the draft
acceptance rate over the interval."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvserve.engine.stats import EngineStats

logger = logging.getLogger("kvserve.stats")


def format_stats_line(now: EngineStats, before: EngineStats, interval_s: float) -> str:
    prompt_tps = (now.num_prompt_tokens - before.num_prompt_tokens) / interval_s
    gen_tps = (now.num_generation_tokens - before.num_generation_tokens) / interval_s
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    hits = now.prefix_cache_hits - before.prefix_cache_hits
    hit_rate = 100.0 * hits / queries if queries else 0.0
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, "
            f"KV cache usage: {100.0 * now.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%, "
            f"Preemptions: {now.num_preemptions - before.num_preemptions}" + _spec_decode_part(now, before))


def _spec_decode_part(now: EngineStats, before: EngineStats) -> str:
    summary = spec_decode_summary(now, before)
    return f", {summary}" if summary else ""


def spec_decode_summary(now: EngineStats, before: EngineStats) -> str | None:
    """The acceptance of the drafts verified between two readings of the stats; None without any."""
    drafts = now.spec_num_drafts - before.spec_num_drafts
    if not now.spec_decode_enabled or drafts <= 0:
        return None
    drafted = now.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = now.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    # Mean acceptance length counts the token every verification adds besides the accepted drafts; a position's
    # rate is the share of drafts accepted up to it (vLLM's per-position acceptance rate).
    per_pos = [now_i - before_i for now_i, before_i in
               zip(now.spec_accepted_per_pos, before.spec_accepted_per_pos or [0] * len(now.spec_accepted_per_pos))]
    return (f"Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}% "
            f"({accepted}/{drafted} tokens), Mean acceptance length: {1 + accepted / drafts:.2f}"
            + (f", Per-position acceptance rate: {', '.join(f'{a / drafts:.3f}' for a in per_pos)}" if per_pos else ""))


def _busy(now: EngineStats, before: EngineStats) -> bool:
    return (now.num_running > 0 or now.num_waiting > 0
            or now.num_generation_tokens != before.num_generation_tokens
            or now.num_prompt_tokens != before.num_prompt_tokens)


def _baseline(now: EngineStats, before: EngineStats) -> EngineStats:
    """before, or zeros where the counters went back: the engine was replaced since (a new engine process counts
    from zero), and differences from the old one's totals would log negative throughput."""
    restarted = (now.num_prompt_tokens < before.num_prompt_tokens
                 or now.num_generation_tokens < before.num_generation_tokens)
    return EngineStats() if restarted else before


async def log_stats_periodically(get_stats: Callable[[], EngineStats], interval_s: float = 5.0,
                                 label: str = "") -> None:
    """Runs until cancelled; stays quiet while idle. `label` starts each line (which engine, when several)."""
    before, t_before = get_stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now, t_now = get_stats(), time.monotonic()
        before = _baseline(now, before)
        if _busy(now, before):
            logger.info("%s%s", label, format_stats_line(now, before, max(t_now - t_before, 1e-9)))
        before, t_before = now, t_now
