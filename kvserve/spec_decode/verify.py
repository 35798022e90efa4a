"""Verification: which drafts the target model accepts, from the tokens it samples at every drafted position.

A verification row is the sequence's last token followed by its k drafts; the model's logits at row j give
the target distribution p_j of the token after draft j (row 0: after the last real token). The sampler
samples every row exactly as non-speculative decoding samples a position (same logits processors, fed the
output tokens as they would be at that position, and, for a seeded request, the same noise from its own
generator), and the drafts are accepted while they equal those samples:

- greedy: the samples are the argmaxes, so the accepted run plus the first mismatch (or the bonus token
  after k accepted drafts) is token for token what non-speculative decoding emits;
- sampling, draft model (method "draft"): the draft samples draft j with the very noise the target uses
  at row j (draft_proposer.py), so "accept iff equal" still emits exactly the target's own samples; the
  draft's probabilities never enter, and a seeded request emits what non-speculative decoding emits;
- sampling: a proposer that is certain of its drafts (n-gram: probability one) is verified exactly by
  rejection sampling, which accepts draft t with probability p(t) and otherwise samples p with t removed,
  renormalised. Sampling x ~ p and accepting iff x == t realises that rule: P(accept) = p(t), and on a
  mismatch x is distributed as p restricted to tokens != t. The emitted tokens are then distributed as
  the target's, and a seeded request emits the same tokens with or without speculation, whatever its
  batch-mates and whichever steps speculated.

Only the noise of the rows actually emitted may be consumed from a seeded request's generator, so that
its next step starts where non-speculative decoding would: `rewind_generator` replays that many draws.
Where a sampled draft drew its positions' noise from a clone of the generator (draft_proposer.py), the
target's sampler takes those rows as they are and the generator is set to the clone's state after the kept
rows (`take_drafted_noise`): a vocabulary's uniforms cost ~0.2-0.4 ms to draw on a CPU.
"""
from __future__ import annotations

import torch

from kvserve.engine.sequence import Sequence
from kvserve.sampling.sampler import Sampler


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's samples. sampled has len(drafts) + 1 entries: the
    tokens emitted are sampled[:num_accepted + 1]."""
    assert len(sampled) == len(drafts) + 1
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


def rewind_generator(generator: torch.Generator, state_before: torch.Tensor, num_rows: int, vocab: int,
                     device: torch.device, dtype: torch.dtype) -> None:
    """Put generator where it would be after drawing noise for num_rows positions from state_before
    (the sampler draws one row of `vocab` uniforms per position: Sampler.draw_uniform)."""
    generator.set_state(state_before)
    for _ in range(num_rows):
        Sampler.draw_uniform(generator, vocab, device, dtype)


def take_drafted_noise(seq: Sequence, num_drafts: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The uniforms seq's sampled draft drew this step for its num_drafts positions, and the generator state
    after each draw, where it drew them all (else None: the target's sampler draws); handed over once."""
    state = seq.spec_state
    if (state is None or num_drafts == 0 or state.noise_num_tokens != seq.num_tokens
            or len(state.draft_noise) != num_drafts):
        return None
    taken = state.draft_noise, state.draft_noise_states
    state.draft_noise, state.draft_noise_states, state.noise_num_tokens = [], [], -1
    return taken
