"""Counters the engine keeps for metrics and logs. Cumulative counters only grow; gauges are a snapshot."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    # Gauges, as of the end of the last step.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0          # fraction of KV blocks held by live requests, 0..1
    # Cumulative counters.
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0        # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0           # of those, tokens found
    num_prompt_tokens: int = 0           # prompt tokens of requests admitted (computed or cached)
    num_generation_tokens: int = 0       # tokens sampled
    # Speculative decoding (vLLM's spec_decode_* counters): one draft is one sequence's proposal in a step.
    spec_decode_enabled: bool = False
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts whose token i was accepted
    # The last step.
    last_step_num_tokens: int = 0        # tokens the model processed in the last step (prefill + decode)
