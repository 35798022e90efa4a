"""A sequence's speculative-decoding state: its recent acceptance, and what the draft model has cached."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.engine.sequence import Sequence
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.confidence import TreeDraft
from kvserve.spec_decode.ngram import LookupIndex

FIRST_PAUSE_STEPS = 8


@dataclass
class SpecState:
    acceptance: float = 1.0      # moving average of accepted / tested (draft_length.tested_tokens)
    num_verified: int = 0        # draft tokens tested so far
    paused_until: int = 0        # no drafts before this step
    pause_steps: int = FIRST_PAUSE_STEPS
    draft_class: int = 0         # the last draft's class (draft_length.py): n-gram drafts, their match length
    lookup: LookupIndex = field(default_factory=LookupIndex)  # prompt lookup's index of the sequence (ngram.py)
    # Draft model (method "draft"): its K/V is valid below this position, in the blocks the sequence held
    # after its draft_preemptions-th preemption.
    draft_computed: int = 0
    draft_preemptions: int = 0
    draft_params: SamplingParams | None = None   # the request's parameters without logprobs
    # Eagle head (method "eagle"): the target's hidden state that produced the sequence's last token, while
    # the sequence has feature_num_tokens tokens.
    feature: torch.Tensor | None = None
    feature_num_tokens: int = 0
    # A sampled request's drafts (methods "draft", "eagle"), drawn while the sequence had noise_num_tokens
    # tokens: the uniforms each draft position drew from a clone of the request's generator, which are the
    # target's at the same positions, and the clone's state after each draw (verify.py reuses both).
    draft_noise: list[torch.Tensor] = field(default_factory=list)
    draft_noise_states: list[torch.Tensor] = field(default_factory=list)
    noise_num_tokens: int = -1
    # A tree the eagle head drafted before the schedule (speculator.py), at position tree_pos: how sure the head
    # was of each token, checked against the target's tokens once they are known (confidence.py).
    tree: TreeDraft | None = None
    tree_pos: int = -1


def spec_state(seq: Sequence) -> SpecState:
    if seq.spec_state is None:
        seq.spec_state = SpecState()
    return seq.spec_state
