"""Runs the eagle head (eagle_head.py): k cheap steps after the schedule, before the target verifies.

The head's input is the target's hidden state at the position that produced a sequence's last token. The
runner hands it over with every sampled token (ModelRunnerOutput.hidden; the one at the last kept row when
drafts were verified) and the engine stores it in the sequence's SpecState (`observe`), with the token
count it belongs to: a sequence drafts only while that is still its count, so the head never reads a
stale state (after a preemption the recomputed prompt's last row gives a fresh one).

Sampling is draft_proposer.py's: draft j is sampled from the head's logits under the request's parameters
with the very noise the target will use at that position, so greedy and seeded requests reproduce and the
target's verification (verify.py) keeps every output exactly what non-speculative decoding gives.
A greedy request's token tree (a chain with alternatives to its first token, the head's next choices there,
or with the draft-length rule a chain of k > 1) is drafted before the schedule instead (`draft_trees`), with
the head's probability for each token, which the rule sizes it by (speculator.py).
"""
from __future__ import annotations

import math

import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.sampling.sampler import Sampler, argmax, reads_token_ids
from kvserve.spec_decode.confidence import Calibration, TreeDraft
from kvserve.spec_decode.draft_proposer import draft_generators, draft_sampling_inputs
from kvserve.spec_decode.eagle_head import EagleHead
from kvserve.spec_decode.state import spec_state


class EagleProposer:
    def __init__(self, head: EagleHead, device: torch.device, eos_token_ids: list[int],
                 generator: torch.Generator | None = None) -> None:
        self.model = head
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(generator)  # generator: the engine's, for unseeded rows

    @property
    def num_choices(self) -> int:
        """The tokens the head can draft: its vocabulary."""
        return len(self.model.vocab_ids)

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """After the engine appended this step's tokens: the target's state that produced the last one."""
        state = spec_state(seq)
        state.feature, state.feature_num_tokens = hidden, seq.num_tokens

    def can_draft(self, seq: Sequence, num: int) -> bool:
        """Whether the head has the target's state for seq's last token (it has no context limit of its own)."""
        state = seq.spec_state
        return state is not None and state.feature is not None and state.feature_num_tokens == seq.num_tokens

    def _inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's input for each sequence: the target's state for its last token, and that token."""
        feature = torch.stack([seq.spec_state.feature for seq in seqs])
        return feature, torch.tensor([seq.token_ids[-1] for seq in seqs], dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def fill(self, sched: SchedulerOutput, to_draft: dict[int, int]) -> None:
        """Draft to_draft[seq_id] tokens for each of those sequences, into sched.spec_token_ids (replacing
        their placeholders)."""
        seqs = {seq.seq_id: seq for seq, _ in sched.scheduled}
        jobs = [(seqs[seq_id], num) for seq_id, num in to_draft.items()]
        if not jobs:
            return
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in jobs}
        generators = draft_generators([seq for seq, _ in jobs])
        feature, tokens = self._inputs([seq for seq, _ in jobs])
        greedy = [seq.params.greedy for seq, _ in jobs]
        rows = list(range(len(jobs)))  # which jobs are still drafting, as rows of feature/tokens
        for j in range(max(k for _, k in jobs)):
            keep = [i for i, r in enumerate(rows) if jobs[r][1] > j]
            if len(keep) < len(rows):
                feature, tokens, rows = feature[keep], tokens[keep], [rows[i] for i in keep]
            if all(greedy[r] for r in rows):
                # Greedy requests take the head's argmax (no sampler: a third of a drafting step's time, and
                # a draft needs none of its guarantees, since verification keeps the output exact).
                feature, tokens = self.model.greedy_step(feature, tokens)
            else:
                feature, logits = self.model.head_logits_step(feature, tokens)
                tokens = self._draft_tokens(logits, [jobs[r][0] for r in rows], [greedy[r] for r in rows],
                                            drafts, generators)
            for r, token in zip(rows, tokens.tolist()):
                drafts[jobs[r][0].seq_id].append(token)
        for seq, _ in jobs:
            sched.spec_token_ids[seq.seq_id] = drafts[seq.seq_id]

    @torch.inference_mode()
    def draft_trees(self, seqs: list[Sequence], depths: list[int], num_alternatives: int,
                    calibration: Calibration | None, min_gain: float) -> list[TreeDraft]:
        """Greedy requests' trees, before the schedule: per sequence, the head's first choices for up to
        depths[i] tokens, drawing each next one only while the chain so far gains at least min_gain by
        calibration (always without one), and its next num_alternatives choices for the first token."""
        feature, tokens = self._inputs(seqs)
        k = 1 + num_alternatives
        rates, floor = (calibration.chain_rates(), min_gain) if calibration is not None else ([1.0, 1.0], -math.inf)
        made = self.model.draft_chains(feature, tokens, k, depths, rates, floor)
        if made is None:
            return self._draft_trees_stepwise(feature, tokens, depths, k, calibration, min_gain)
        return [TreeDraft([row[0], *row[k:k + n - 1]], [p[0], *p[k:k + n - 1]], row[1:k], p[1:k])
                for row, p, n in zip(*made)]

    def _draft_trees_stepwise(self, feature: torch.Tensor, tokens: torch.Tensor, depths: list[int], k: int,
                              calibration: Calibration | None, min_gain: float) -> list[TreeDraft]:
        """draft_trees a drafting step at a time, where the head's native chain does not run (no CPU kernels,
        a GPU, a target embedding in another layout)."""
        def extend(probs: list[float]) -> bool:
            return calibration is None or calibration.chain_gains(probs)[-1] >= min_gain
        feature, choices, probs = self.model.top_step(feature, tokens, k)
        tokens = choices[:, 0].contiguous()
        drafts = [TreeDraft([c[0]], [p[0]], c[1:], p[1:]) for c, p in zip(choices.tolist(), probs.tolist())]
        rows = list(range(len(drafts)))  # the sequences still drafting, as rows of feature / tokens
        while True:
            keep = [i for i, r in enumerate(rows) if len(drafts[r].chain) < depths[r] and extend(drafts[r].chain_probs)]
            if not keep:
                return drafts
            if len(keep) < len(rows):
                feature, tokens, rows = feature[keep], tokens[keep], [rows[i] for i in keep]
            feature, choices, probs = self.model.top_step(feature, tokens, 1)
            tokens = choices[:, 0]
            for r, token, p in zip(rows, tokens.tolist(), probs[:, 0].tolist()):
                drafts[r].chain.append(token)
                drafts[r].chain_probs.append(p)

    def _draft_tokens(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool],
                      drafts: dict[int, list[int]], generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One draft token per row of a step that samples for some, from the head's logits over its own
        vocabulary: greedy requests take the argmax, the others are sampled with the request's parameters
        and the target's noise, drawn over the full vocabulary (the target's sampler reuses the row).

        The sampled rows are drawn over the head's vocabulary alone, with the noise at its tokens: outside
        it the head's logits are -inf, so temperature, min_p, top_k, top_p and the exponential race pick the
        token they pick over the full vocabulary (up to rounding in the softmax's sum), on a twelfth of the
        width for the shipped head (4,096 of 49,152 tokens). Stages that name tokens by id (penalties,
        logit_bias, min_tokens) run over the full vocabulary."""
        vocab_ids = self.model.vocab_ids
        rows = [i for i, x in enumerate(greedy) if not x]  # the sampled ones
        everyone = len(rows) == len(seqs)
        sampled = logits if everyone else logits[rows]  # indexing copies (~20 us a call)
        inputs = draft_sampling_inputs([seqs[i] for i in rows], drafts, generators, self.eos_token_ids,
                                       self.model.config.vocab_size, logits.device)
        if any(map(reads_token_ids, inputs.params)):
            tokens = torch.tensor(self.sampler(self.model.full_vocab_logits(sampled), inputs).token_ids,
                                  dtype=torch.int64, device=logits.device)
        else:
            inputs.noise = [u if u is None else u[vocab_ids] for u in inputs.noise]
            tokens = vocab_ids[self.sampler(sampled, inputs).token_ids]
        if everyone:
            return tokens
        out = vocab_ids[argmax(logits)]  # the greedy rows' drafts
        out[rows] = tokens
        return out
