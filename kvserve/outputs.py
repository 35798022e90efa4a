"""What the engine hands back for a request: vLLM's RequestOutput / CompletionOutput shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: {token_id: (logprob, rank, decoded_token)}; the sampled/actual token first.
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int                 # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int                            # which of the n samples
    text: str                             # the full text so far (cumulative)
    token_ids: list[int]                  # all output tokens so far
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None      # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # Text/token deltas since the previous output for this request (for streaming).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)
