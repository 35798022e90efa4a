"""Verification: which drafts the target model accepts, from the tokens it samples at every drafted position.

A verification row is the sequence's last token followed by its k drafts; the model's logits at row j give
the target distribution p_j of the token after draft j (row 0: after the last real token). The sampler
samples every row exactly as non-speculative decoding samples a position (same logits processors, fed the
output tokens as they would be at that position, and, for a seeded request, the same noise from its own
generator), and the drafts are accepted while they equal those samples:

- greedy: the samples are the argmaxes, so the accepted run plus the first mismatch (or the bonus token
  after k accepted drafts) is token for token what non-speculative decoding emits;
- sampling, a model's drafts (methods "draft" and "eagle"): the model samples draft j with the very noise the
  target uses at row j (draft_proposer.py, eagle_proposer.py), so "accept iff equal" still emits exactly the
  target's own samples; the draft's probabilities never enter, and a seeded request emits what
  non-speculative decoding emits;
- sampling: a proposer that is certain of its drafts (n-gram: probability one) is verified exactly by
  rejection sampling, which accepts draft t with probability p(t) and otherwise samples p with t removed,
  renormalised. Sampling x ~ p and accepting iff x == t realises that rule: P(accept) = p(t), and on a
  mismatch x is distributed as p restricted to tokens != t. The emitted tokens are then distributed as
  the target's, and a seeded request emits the same tokens with or without speculation, whatever its
  batch-mates and whichever steps speculated.

Only the noise of the rows actually emitted may be consumed from a seeded request's generator, so that
its next step starts where non-speculative decoding would (`verification_noise`): where a sampled draft
drew its positions' noise from a clone of the generator (draft_proposer.py), the target's sampler takes
those rows as they are and the generator is set to the clone's state after the kept rows; otherwise the
generator replays that many draws from its state before the step. A vocabulary's uniforms cost ~0.2-0.4 ms
to draw on a CPU, so drawing once matters.

Tree drafts (greedy requests, method "eagle" with speculative_token_tree): after the chain come
alternatives to its first token, each in a row of its own at that token's position that sees the context but
not its siblings (kvserve/attention/backend.py). Where the chain's first token is rejected and the target's
choice there is an alternative, that alternative is kept, and its row's choice follows it: still exactly the
tokens non-speculative decoding emits, the sampler having treated each row as that position in that context.
"""
from __future__ import annotations

from collections.abc import Callable

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


def kept_rows(sampled: list[int], drafts: list[int], num_alternatives: int = 0) -> list[int]:
    """The rows whose samples are emitted, in order, for a row of drafts whose last num_alternatives are
    alternatives to its first (sampled: one entry per row, the last token's then each draft's): the chain's
    accepted run plus one, or the first row and the matching alternative's."""
    depth = len(drafts) - num_alternatives
    alternative = kept_alternative(sampled, drafts, num_alternatives)
    if alternative:
        return [0, depth + alternative]
    return list(range(num_accepted(sampled[:depth + 1], drafts[:depth]) + 1))


def kept_alternative(emitted: list[int], drafts: list[int], num_alternatives: int) -> int:
    """Which alternative (1-based) a verification kept, from its first emitted (or sampled) token: the one
    that token equals where the chain's first draft does not; 0: none."""
    depth = len(drafts) - num_alternatives
    if num_alternatives and emitted[0] != drafts[0] and emitted[0] in drafts[depth:]:
        return drafts[depth:].index(emitted[0]) + 1
    return 0


def rewind_generator(generator: torch.Generator, state_before: torch.Tensor, num_rows: int, vocab: int,
                     device: torch.device, dtype: torch.dtype) -> None:
    """Put generator where it would be after drawing noise for num_rows positions from state_before
    (the sampler draws one row of `vocab` uniforms per position: Sampler.draw_uniform)."""
    generator.set_state(state_before)
    for _ in range(num_rows):
        Sampler.draw_uniform(generator, vocab, device, dtype)


def verification_noise(seq: Sequence, num_drafts: int, vocab: int, device: torch.device
                       ) -> tuple[list[torch.Tensor | None], Callable[[int], None] | None]:
    """Before the target samples seq's 1 + num_drafts rows: per row, the uniforms seq's draft drew there
    (None: the sampler draws), and how to put seq's generator where the first `keep` rows leave it when
    fewer are kept (None: nothing to put back: greedy, unseeded, or no drafts). A draft's noise is handed
    over once."""
    rows: list[torch.Tensor | None] = [None] * (num_drafts + 1)
    g = seq.generator
    if g is None or seq.params.greedy or num_drafts == 0:
        return rows, None
    state = seq.spec_state
    if state is None or state.noise_num_tokens != seq.num_tokens or len(state.draft_noise) != num_drafts:
        before = g.get_state()
        return rows, lambda keep: rewind_generator(g, before, keep, vocab, device, torch.float32)
    rows[:num_drafts], states = state.draft_noise, state.draft_noise_states
    state.draft_noise, state.draft_noise_states, state.noise_num_tokens = [], [], -1
    g.set_state(states[-1])  # after the drafted rows' draws: the row after them draws next
    return rows, lambda keep: g.set_state(states[keep - 1])
