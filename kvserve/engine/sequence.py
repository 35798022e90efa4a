"""A sequence's state as it moves through the engine: its tokens, how many are in the KV cache, its blocks.

A request with n > 1 fans out into n sequences. Sequence 0 computes the prompt; its siblings wait until
that prefill is done and then find the prompt's full blocks in the prefix cache, so they share them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.spec_decode.state import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int                            # which of the request's n samples
    token_ids: list[int]                  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    parent: Sequence | None = None        # sibling 0, for n > 1; we wait for its prefill
    cache_salt: str | None = None         # keeps this request's blocks out of other requests' reach
    # The request's cache_salt as given, whether or not the prefix cache uses it: suffix decoding drafts a
    # response only for requests with the same one (spec_decode/suffix.py), prefix caching on or off.
    tenant_salt: str | None = None
    # Sequence 0 of a request with prompt_logprobs, until the request has them all. Positions served from
    # the prefix cache are never run through the model, so they would have no logits: like vLLM, such a
    # sequence does not read the cache (it still fills it). Its n > 1 siblings read it as usual.
    needs_prompt_logprobs: bool = False

    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_cached_tokens: int = 0            # of the prompt, how many came from the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)   # block_table[i] holds tokens [i*B, (i+1)*B)
    # Content digests of the full blocks of token_ids computed so far (kvserve/engine/block_hash.py). They
    # depend on the tokens and salt only, so they outlive a preemption. Speculative decoding never rolls
    # tokens back: rejected drafts are never appended to token_ids, so no hash covers them.
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0         # of block_table, how many are registered in the prefix cache
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    ever_admitted: bool = False
    # Speculative decoding: tokens proposed for the next step (not part of token_ids until accepted), and
    # this sequence's recent acceptance.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_alternatives: int = 0  # the last this many of spec_token_ids: alternatives to its first (a tree draft)
    spec_state: SpecState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def skip_prefix_cache(self) -> bool:
        return self.needs_prompt_logprobs

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def sort_key(self, by_priority: bool) -> tuple:
        """Smaller runs first; the largest is the first to be preempted."""
        if by_priority:
            return (self.priority, self.arrival_time, self.seq_id)
        return (self.arrival_time, self.seq_id)
