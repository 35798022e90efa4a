"""What the engine hands back for a request.

Across the engine boundary each step carries a `RequestDelta`: only what is new since the previous step (the
tokens just sampled, the text they complete, their logprobs, a finish reason), so a stream of L tokens costs
O(L) end to end (DESIGN.md §1). `RequestOutputAccumulator` folds a request's deltas into vLLM's cumulative
`RequestOutput` / `CompletionOutput` shapes, for the offline API and for non-streaming HTTP responses.
"""
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
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


# ---------------------------------------------------------------- per step: deltas

@dataclass
class CompletionDelta:
    index: int                                    # which of the n samples
    token_ids: list[int]                          # tokens sampled since the previous delta
    text: str                                     # text safe to show since the previous delta
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when logprobs were requested
    finish_reason: str | None = None              # set in the sample's last delta: "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    outputs: list[CompletionDelta]                # only the samples that changed in this step
    finished: bool                                # every sample is done: this is the request's last delta
    num_prompt_tokens: int
    num_cached_tokens: int = 0                    # prompt tokens served from the prefix cache
    # The whole prompt's logprobs, in the request's first delta only (they are complete by its first token).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None


# ---------------------------------------------------------------- cumulative: vLLM's shapes

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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # What the latest step added, per sample (for callers that stream from cumulative outputs).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)


class RequestOutputAccumulator:
    """Folds one request's deltas into a RequestOutput. Appends in place: O(1) per token, not O(L)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 with_logprobs: bool) -> None:
        self.output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            outputs=[CompletionOutput(i, "", [], [] if with_logprobs else None) for i in range(n)],
            finished=False)

    def add(self, delta: RequestDelta) -> RequestOutput:
        out = self.output
        out.new_token_ids = [[] for _ in out.outputs]
        out.new_texts = [""] * len(out.outputs)
        for d in delta.outputs:
            c = out.outputs[d.index]
            c.token_ids.extend(d.token_ids)
            c.text += d.text
            if d.logprobs and c.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            out.new_token_ids[d.index] = d.token_ids
            out.new_texts[d.index] = d.text
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        out.num_cached_tokens = delta.num_cached_tokens
        out.metrics = delta.metrics
        out.finished = delta.finished
        return out
