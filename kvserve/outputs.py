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


@dataclass
class SpecDecodeMetrics:
    """One request's speculative decoding, as vLLM reports it per request (--per-request-spec-decode-metrics):
    per verification step, how many draft tokens it carried (a tree's alternatives included) and how many the
    target accepted. Summed over requests, the counts equal the engine's spec_decode counters. Collected only
    for requests of one sequence (n = 1), and only when asked for."""
    num_spec_tokens: int                          # the configured num_speculative_tokens: the most a step carries
    # {drafted: [steps that accepted 0, 1, .., drafted of them]}, only the lengths that occurred; the totals
    # below are read off it.
    histogram_by_draft_length: dict[int, list[int]] = field(default_factory=dict)
    per_step_drafted: list[int] | None = None     # "detailed" only: every step, in order
    per_step_accepted: list[int] | None = None

    @property
    def num_spec_steps(self) -> int:
        """Verification steps that carried drafts."""
        return sum(sum(row) for row in self.histogram_by_draft_length.values())

    @property
    def num_draft_tokens(self) -> int:
        return sum(drafted * sum(row) for drafted, row in self.histogram_by_draft_length.items())

    @property
    def num_accepted_draft_tokens(self) -> int:
        """The bonus (or corrected) token of each step not counted."""
        return sum(accepted * steps for row in self.histogram_by_draft_length.values()
                   for accepted, steps in enumerate(row))

    def add(self, drafted: int, accepted: int) -> None:
        row = self.histogram_by_draft_length.get(drafted)
        if row is None:
            row = self.histogram_by_draft_length[drafted] = [0] * (drafted + 1)
        row[accepted] += 1
        if self.per_step_drafted is not None:
            self.per_step_drafted.append(drafted)
            self.per_step_accepted.append(accepted)

    def to_json(self) -> dict:
        """vLLM's `metrics.speculative_decoding` object. The two ratios are null before any step drafted."""
        histogram = [0] * (max(self.num_spec_tokens, *self.histogram_by_draft_length, 0) + 1)
        for row in self.histogram_by_draft_length.values():
            for accepted, steps in enumerate(row):
                histogram[accepted] += steps
        steps, drafted, accepted = self.num_spec_steps, self.num_draft_tokens, self.num_accepted_draft_tokens
        out = {
            "mean_acceptance_length": 1 + accepted / steps if steps else None,
            "draft_acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_histogram": histogram,
            "acceptance_histogram_by_draft_length": {str(k): list(v)
                                                     for k, v in sorted(self.histogram_by_draft_length.items())},
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": self.num_spec_tokens,
        }
        if self.per_step_drafted is not None:
            out["per_step_accepted"] = list(self.per_step_accepted)
            out["per_step_drafted"] = list(self.per_step_drafted)
        return out


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
    spec_decode: SpecDecodeMetrics | None = None  # in the request's last delta, where collected


# ---------------------------------------------------------------- cumulative: vLLM's shapes

@dataclass
class CompletionOutput:
    index: int                            # which of the n samples
    text: str                             # the full text so far (cumulative)
    token_ids: list[int]                  # all output tokens so far
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None      # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any
    # The sum of the returned tokens' logprobs where logprobs were asked for (vLLM's field), else None.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:  # a method, as vLLM's
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
    # Per-request speculative decoding figures, once finished (engine option per_request_spec_decode_metrics).
    spec_decode_metrics: SpecDecodeMetrics | None = None
    # What the latest step added, per sample (for callers that stream from cumulative outputs).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)


class RequestOutputAccumulator:
    """Folds one request's deltas into a RequestOutput. Appends in place: O(1) per token, not O(L)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 with_logprobs: bool) -> None:
        self.output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
            outputs=[CompletionOutput(i, "", [], [] if with_logprobs else None,
                                      cumulative_logprob=0.0 if with_logprobs else None) for i in range(n)],
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
                c.cumulative_logprob += sum(lp[t].logprob for t, lp in zip(d.token_ids, d.logprobs))
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            out.new_token_ids[d.index] = d.token_ids
            out.new_texts[d.index] = d.text
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        out.num_cached_tokens = delta.num_cached_tokens
        out.metrics = delta.metrics
        if delta.spec_decode is not None:
            out.spec_decode_metrics = delta.spec_decode
        out.finished = delta.finished
        return out
