"""Runs the draft model: k cheap forward passes after the schedule, before the target verifies.

KV cache. The draft has its own paged pool with the target's block ids: a block id in a sequence's block
table addresses the target's K/V in the target pool and the draft's K/V (its own layer count and shapes)
in the draft pool. So the block manager, prefix caching and preemption need no change, and the draft pool
costs the draft's bytes per block (the engine sizes both pools together). What the draft pool holds is
tracked per sequence (SpecState.draft_computed): its K/V is valid for positions below that count.
- Each drafting step first runs the tokens the draft has not seen (the last step's accepted drafts and
  correction, or, the first time, the whole prompt) and then one position per draft; afterwards the
  count is min(draft's count, target's num_computed_tokens), which drops the rejected drafts' K/V.
- After a preemption (new blocks) or a prefix-cache hit (blocks another sequence filled, perhaps in steps
  where nobody drafted) the count restarts at 0 and the draft recomputes the prompt: cheap next to the
  target, and never wrong.
- Those catch-ups share one budget a step, the engine's max_num_batched_tokens (the speculator splits it):
  a sequence further behind than the drafting sequences' half allows does not draft, and runs a chunk of its
  backlog instead, in a pass of its own (`catch_up`). In one pass, a 4,000-token prompt's catch-up had
  stalled every sequence's step for ~0.44 s (default model, the shipped draft, two cores), and a long
  prompt's would have been unbounded in time and memory.
Nothing here can change an output: the target verifies every draft (verify.py), so stale draft K/V could
only lower the acceptance rate.

Sampling. Draft j of a sequence is sampled with the draft's logits under the request's sampling
parameters and the very noise the target's sampler will use at that position (the request's generator,
cloned: the engine gives every sampling request one while a draft runs). The target then emits exactly
the tokens non-speculative decoding emits with that noise (a draft is accepted only where it equals the
target's own sample), and the draft matches whenever the two distributions pick the same token under the
same noise: the exponential-race (Gumbel-max) coupling, whose match rate is close to the sum of
min(p, q) that rejection sampling against the draft's probabilities would accept, without giving up
seeded reproducibility. Greedy requests are the special case of argmax against argmax.
"""
from __future__ import annotations

import dataclasses

import torch

from kvserve.attention.backend import StepBatch
from kvserve.attention.selector import make_attention_backend
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.models.kv_cache import KVCacheSpec
from kvserve.sampling.sampler import Sampler, SamplingInputs, penalises
from kvserve.spec_decode.state import SpecState, spec_state
from kvserve.utils.huge_pages import back_with_huge_pages


class DraftProposer:
    def __init__(self, model: torch.nn.Module, kv_spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 eos_token_ids: list[int], dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.block_size = kv_spec.block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        # Its own backend instance: the draft's geometry (layers, heads) is not the target's.
        self.attn_backend = make_attention_backend(attention_backend, model, kv_spec, num_blocks, device, dtype)
        self.kv_caches = self.attn_backend.allocate_kv_caches()
        if device.type == "cpu":
            back_with_huge_pages(self.model)
        self.sampler = Sampler(generator)  # generator: the engine's, for unseeded rows
        # A Hugging Face or GGUF draft may have a shorter context than the target's: past it the target
        # decodes alone.
        self.max_positions = model.config.max_position_embeddings

    def can_draft(self, seq: Sequence, num: int) -> bool:
        """Whether num drafts fit the draft's context. It catches up on whatever it has not seen, then
        runs its own tokens but the last, so its positions reach seq.num_tokens + num - 2."""
        return seq.num_tokens + num - 1 <= self.max_positions

    def unseen(self, seq: Sequence) -> int:
        """The tokens of seq whose K/V the draft's pool lacks, its last token included: what a drafting step
        would run for it before its first draft."""
        return seq.num_tokens - self._synced(seq).draft_computed

    @staticmethod
    def _synced(seq: Sequence) -> SpecState:
        """seq's state, its draft count cut to what the draft's pool still holds."""
        state = spec_state(seq)
        if state.draft_preemptions != seq.num_preemptions:  # new blocks: nothing of the draft's is there
            state.draft_computed, state.draft_preemptions = 0, seq.num_preemptions
        state.draft_computed = min(state.draft_computed, seq.num_computed_tokens)
        return state

    @torch.inference_mode()
    def catch_up(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Run the next n tokens the draft has not seen of each (sequence, n), in one pass: sequences that draft
        nothing this step. Short of a sequence's last token, which the step that drafts for it runs."""
        rows, ends = [], []
        for seq, n in chunks:
            state = self._synced(seq)
            end = min(state.draft_computed + n, seq.num_tokens - 1)
            if end > state.draft_computed:
                rows.append((seq, state.draft_computed, seq.token_ids[state.draft_computed:end]))
                ends.append((state, end))
        if rows:
            self._forward(rows, logits=False)  # only the K/V it writes is wanted
            for state, end in ends:
                state.draft_computed = end

    @torch.inference_mode()
    def fill(self, sched: SchedulerOutput, to_draft: dict[int, int]) -> None:
        """Draft to_draft[seq_id] tokens for each of those sequences, into sched.spec_token_ids (replacing
        their placeholders)."""
        seqs = {seq.seq_id: seq for seq, _ in sched.scheduled}
        jobs = [(seqs[seq_id], self._synced(seqs[seq_id]), num) for seq_id, num in to_draft.items()]
        if not jobs:
            return
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in jobs}
        generators = draft_generators([seq for seq, _, _ in jobs])
        for j in range(max(k for _, _, k in jobs)):
            active = [(seq, state) for seq, state, k in jobs if k > j]
            rows = []
            for seq, state in active:
                if j == 0:  # catch up on every token not yet in the draft's cache, the last one included
                    start = state.draft_computed
                    rows.append((seq, start, seq.token_ids[start:]))
                else:
                    rows.append((seq, seq.num_tokens + j - 1, [drafts[seq.seq_id][-1]]))
            logits = self._forward(rows)
            inputs = draft_sampling_inputs([seq for seq, _ in active], drafts, generators, self.eos_token_ids,
                                           logits.shape[1], logits.device)
            for (seq, _), token in zip(active, self.sampler(logits, inputs).token_ids):
                drafts[seq.seq_id].append(token)
        for seq, state, k in jobs:
            sched.spec_token_ids[seq.seq_id] = drafts[seq.seq_id]
            state.draft_computed = seq.num_tokens + k - 1  # the last draft is never fed back

    def _forward(self, rows: list[tuple[Sequence, int, list[int]]], logits: bool = True) -> torch.Tensor | None:
        """One pass over rows of (sequence, first position, tokens); the logits of each row's last token (None
        without logits: a pass for its K/V alone)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for seq, start, tokens in rows:
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + len(tokens))
            seq_lens.append(end)
        dev = self.device
        meta = self.attn_backend.build_metadata(StepBatch.from_host(
            [seq.block_table for seq, _, _ in rows], slot_mapping, query_start_loc, seq_lens, bs, dev))
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), meta, self.kv_caches)
        if not logits:
            return None
        last = torch.tensor(query_start_loc[1:], device=dev) - 1
        return self.model.compute_logits(hidden[last])


def draft_sampling_inputs(seqs: list[Sequence], drafts: dict[int, list[int]],
                          generators: dict[int, torch.Generator], eos_token_ids: list[int],
                          vocab_size: int, device: torch.device) -> SamplingInputs:
    """Sampling one more draft token for each of seqs (rows of the draft's logits): the request's parameters
    without logprobs, with its drafts so far counted as output (penalties), and the next noise of its cloned
    generator (the uniforms the target will use there, over its vocab_size tokens), kept in its SpecState for
    the target's sampler."""
    params, noise = [], []
    for seq in seqs:
        state = spec_state(seq)
        if state.draft_params is None:
            state.draft_params = dataclasses.replace(seq.params, logprobs=None, prompt_logprobs=None)
        params.append(state.draft_params)
        g = generators.get(seq.seq_id)
        if g is None:
            noise.append(None)
            continue
        if not drafts[seq.seq_id]:  # the first draft position of this step
            state.draft_noise, state.draft_noise_states, state.noise_num_tokens = [], [], seq.num_tokens
        u = Sampler.draw_uniform(g, vocab_size, device, torch.float32)
        state.draft_noise.append(u)
        state.draft_noise_states.append(g.get_state())
        noise.append(u)
    return SamplingInputs(
        params=params,
        generators=[generators.get(seq.seq_id) for seq in seqs],
        # The token lists only where a penalty reads them (see SamplingInputs).
        prompt_token_ids=[seq.prompt_token_ids if penalises(seq.params) else [] for seq in seqs],
        output_token_ids=[seq.output_token_ids + drafts[seq.seq_id] if penalises(seq.params) else []
                          for seq in seqs],
        eos_token_ids=eos_token_ids,
        noise=noise,
        num_output_tokens=[seq.num_output_tokens + len(drafts[seq.seq_id]) for seq in seqs],
    )


def draft_generators(seqs: list[Sequence]) -> dict[int, torch.Generator]:
    """Copies of the seeded sampled requests' generators, keyed by seq_id: a draft draws the noise the target
    will draw at each position without advancing the request's own generator."""
    return {seq.seq_id: clone_generator(seq.generator) for seq in seqs
            if seq.generator is not None and not seq.params.greedy}


def clone_generator(g: torch.Generator) -> torch.Generator:
    c = torch.Generator(device=g.device)
    c.set_state(g.get_state())
    return c
