"""A request as the engine tracks it: its n sequences, their detokenizers, and the stop checks that end
them. After each step it hands back a RequestDelta: what is new since the previous one, nothing more."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence
from kvserve.outputs import CompletionDelta, PositionLogprobs, RequestDelta, RequestMetrics, SpecDecodeMetrics
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.stop_checker import token_stop_after


@dataclass
class _Pending:
    """One sequence's additions since the last delta."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams               # a private copy; max_tokens is always set
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    eos_token_ids: frozenset[int]
    max_model_len: int
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    spec_decode: SpecDecodeMetrics | None = None   # collected where asked for (EngineConfig), sent when finished
    # The engine keeps no copy of the output text or logprobs: once in a delta, they are the receiver's.
    _pending: dict[int, _Pending] = field(default_factory=dict)   # by sequence index, changed since last delta
    _sent_any: bool = False

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def append_token(self, seq: Sequence, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Add a sampled token to seq, run the stop checks. True if seq is now finished."""
        i, p = seq.index, self.params
        pending = self._pending.setdefault(i, _Pending())
        seq.token_ids.append(token)
        pending.token_ids.append(token)
        if logprobs is not None and p.logprobs is not None:
            pending.logprobs.append(logprobs)
        detok = self.detokenizers[i]
        token_stop = token_stop_after(p, seq.num_output_tokens, token, self.eos_token_ids)
        if token_stop is not None and token_stop[0] == "stop":  # EOS or a stop_token_id
            seq.finish_reason, seq.stop_reason = token_stop
            detok.update([token], stop_terminated=True)
        else:
            # Stop strings, like stop tokens, cannot end a sequence within its first min_tokens tokens.
            stop_str = detok.update([token], check_stop=seq.num_output_tokens > p.min_tokens)
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
            elif token_stop is not None or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        pending.text += detok.get_delta(finished)
        return finished

    def take_delta(self) -> RequestDelta:
        """What changed since the previous call, and forget it."""
        outputs = []
        for i in sorted(self._pending):
            pending, seq = self._pending[i], self.seqs[i]
            outputs.append(CompletionDelta(
                index=i, token_ids=pending.token_ids, text=pending.text,
                logprobs=pending.logprobs if self.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        self._pending = {}
        first = not self._sent_any
        self._sent_any = True
        return RequestDelta(
            request_id=self.request_id,
            outputs=outputs,
            finished=self.finished,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs if first else None,
            metrics=self.metrics,
            spec_decode=self.spec_decode if self.finished else None,
        )
