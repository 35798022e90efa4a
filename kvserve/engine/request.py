"""A request as the engine tracks it: its n sequences, their detokenizers, and the stop checks that end
them. Builds the RequestOutput the engine hands back after each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence
from kvserve.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.stop_checker import check_token_stop


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
    texts: list[str] = field(default_factory=list)           # text emitted so far, per sequence
    logprobs: list[list[PositionLogprobs] | None] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Deltas since the last output, per sequence.
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_texts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.seqs)
        self.texts = [""] * n
        self.logprobs = [[] if self.params.logprobs is not None else None for _ in range(n)]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.new_token_ids = [[] for _ in range(n)]
        self.new_texts = [""] * n

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def append_token(self, seq: Sequence, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Add a sampled token to seq, run the stop checks. True if seq is now finished."""
        i, p = seq.index, self.params
        seq.token_ids.append(token)
        self.new_token_ids[i].append(token)
        if logprobs is not None and self.logprobs[i] is not None:
            self.logprobs[i].append(logprobs)
        detok = self.detokenizers[i]
        token_stop = check_token_stop(p, seq.output_token_ids, self.eos_token_ids)
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
        delta = detok.get_delta(finished)
        self.texts[i] += delta
        self.new_texts[i] += delta
        return finished

    def make_output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=self.texts[s.index],
                token_ids=s.output_token_ids,
                logprobs=self.logprobs[s.index],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in self.seqs
        ]
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
            new_token_ids=self.new_token_ids,
            new_texts=self.new_texts,
        )
        self.new_token_ids = [[] for _ in self.seqs]
        self.new_texts = [""] * len(self.seqs)
        return out
