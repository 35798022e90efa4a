"""Who drafts this step, and how many tokens: the engine's side of speculative decoding.

Before each schedule the engine asks the Speculator to fill `seq.spec_token_ids` for the running
sequences that decode; the scheduler budgets 1 + len(drafts) tokens for them, the runner verifies the
drafts, and the engine reports back how many were accepted (`record`). The model-based proposers (method
"draft", "eagle") draft after the schedule, into the rows it sized (`fill_drafts`); the eagle head also
gets the target's hidden state after each step (`observe`). With prompt lookup turned on for them
(SpeculativeConfig.uses_lookup), a sequence whose last tokens occurred before drafts their continuation
instead, and only the others wait for the model. Suffix decoding (method "suffix", or in front of a model
with enable_suffix_decoding, in place of prompt lookup) drafts as prompt lookup does, from other requests'
responses too (suffix.py): those of the other running sequences, and those the engine hands over as they
finish (`finished`). Drafting pays only while the step is memory-bound and the drafts are good: each step
carries only as many draft tokens as this engine's measured step times say pay (draft_length.py), none above
`disable_by_batch_size` sequences, at most the batch-size schedule's k (num_speculative_tokens_per_batch_size),
and none for a request while its acceptance stays low.

With a token tree of alternatives (SpeculativeConfig.speculative_token_tree), a greedy request's model
draft also carries the head's next choices for its first token, after the chain (TREE_CLASS drafts). With the
draft-length rule, such a tree, or a greedy request's eagle chain of k > 1, is drafted by the head before the
schedule; the rule only says whether the head should draft it at all (as a chain), and the step keeps the rows
the head's confidence in each says pay (`_draft_trees`, confidence.py): a second chain token where it is sure
of the first two, alternatives where it doubts its first choice, and no rows at all where it has little idea.
Without the rule a tree is drafted whole, before the schedule too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import time

import numpy as np
import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.spec_decode.confidence import Calibration
from kvserve.spec_decode.config import MODEL_FREE, SpeculativeConfig
from kvserve.spec_decode.draft_length import MODEL_CLASS, TREE_CLASS, DraftLength, StepTokens, tested_tokens
from kvserve.spec_decode.draft_proposer import DraftProposer
from kvserve.spec_decode.eagle_proposer import EagleProposer
from kvserve.spec_decode.ngram import Indents, NgramProposer
from kvserve.spec_decode.state import FIRST_PAUSE_STEPS, spec_state
from kvserve.spec_decode.suffix import Running, SuffixProposer

_MAX_PAUSE_STEPS = 256
PLACEHOLDER = -1  # a draft token the draft model fills in after the schedule
EXTEND_MIN_GAIN = 0.4  # the head drafts a tree's next chain token only while the chain so far is this likely


def _within(limit: int | None, num_running: int) -> bool:
    """A disable_by_batch_size limit's test: drafting stays on at up to limit running sequences."""
    return limit is None or num_running <= limit


@dataclass
class SpecDecodeStats:
    """Cumulative counters, with vLLM's meanings: a draft is one sequence's proposal in one step."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0                                  # accepted drafts (not the bonus tokens)
    accepted_per_pos: list[int] = field(default_factory=list)     # [i]: drafts whose token i was accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, max_num_batched_tokens: int,
                 draft: DraftProposer | EagleProposer | None = None, token_classes: np.ndarray | None = None,
                 step_tokens: StepTokens | None = None, indents: Indents | None = None) -> None:
        """token_classes: for prompt lookup, what each token id is matched as (ngram.whitespace_classes);
        step_tokens: the tokens a step will run, what its time is keyed by (ModelRunner.step_tokens);
        indents: for prompt lookup, how drafts follow a copy's re-indented lines (ngram.Indents).
        A tree's alternatives need an attention backend that takes them (the engine checks)."""
        self.config = config
        self.max_model_len = max_model_len
        # Drafts stop where a sequence would pass this many tokens (speculative_config's max_model_len).
        self.draft_max_len = min(max_model_len, config.max_model_len or max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        assert (config.method not in MODEL_FREE) == (draft is not None)
        self.draft = draft
        # Drafts from the text (propose_with_length): prompt lookup, or suffix decoding's own and earlier texts.
        self.proposer: NgramProposer | SuffixProposer | None = None
        if config.suffix_decoding:
            self.proposer = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                           config.suffix_decoding_max_cached_requests,
                                           config.suffix_decoding_max_spec_factor,
                                           config.suffix_decoding_min_token_prob, token_classes, indents,
                                           config.suffix_decoding_corpus_tokens)
        elif config.uses_lookup:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, token_classes, indents)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.draft_depth)
        # A head whose vocabulary has fewer tokens than a tree's first level offers what it has.
        self.num_alternatives = (min(config.num_alternatives, draft.num_choices - 1)
                                 if isinstance(draft, EagleProposer) else 0)
        self.length = DraftLength(config.draft_depth, step_tokens) if config.adaptive_draft_length else None
        # With the rule, greedy requests' eagle drafts of more than one token (trees; a chain is one without
        # alternatives) are drafted before the schedule and sized by the head's confidence. A single token gains
        # nothing from it that pays for its cost (measured: 1.20x against 1.22x at one stream of chat).
        sized = isinstance(draft, EagleProposer) and (self.num_alternatives > 0 or config.draft_depth > 1)
        self.calibration = Calibration(draft.model.calibration) if self.length is not None and sized else None
        self.extend_min_gain = EXTEND_MIN_GAIN
        self._step = 0
        # A draft model's backlogs (draft_proposer.py) share max_num_batched_tokens a step: sequences that draft
        # run theirs within half of it (rounded up); those further behind draft nothing and catch up on what the
        # drafting leaves, at least the other half, the largest backlog first: it shrinks every step it is scheduled.
        self._behind: list[Sequence] = []
        self._drafting_left = 0

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids of every running sequence: drafts for those that decode and may draft, [] else."""
        self._step += 1
        cfg = self.config

        budget = cfg.draft_tokens_at(len(running))  # num_speculative_tokens, or the batch-size schedule's k
        depth = min(budget, cfg.draft_depth)  # of which a chain
        lookup = self.proposer is not None and budget > 0 and _within(cfg.lookup_disable_by_batch_size, len(running))
        model = self._model_drafts(len(running), budget)
        self._behind, self._drafting_left = [], self.max_num_batched_tokens - self.max_num_batched_tokens // 2
        # Suffix decoding: the responses being generated draft for the others too.
        suffix = (self.proposer if lookup and isinstance(self.proposer, SuffixProposer)
                  and self.proposer.searches_running(len(running)) else None)
        if suffix is not None:
            suffix.set_running([Running(seq.token_ids, seq.num_prompt_tokens, spec_state(seq).lookup,
                                        seq.tenant_salt) for seq in running if seq.num_output_tokens > 0])
        try:
            for seq in running:
                seq.spec_token_ids = self._propose_one(seq, lookup, model, depth) if lookup or model else []
                seq.spec_alternatives = 0
        finally:
            if suffix is not None:
                suffix.set_running([])
        # Trees (greedy requests' eagle drafts): the chain tokens each may draft, before the rule cuts them.
        trees = {seq.seq_id: len(seq.spec_token_ids) for seq in running
                 if seq.spec_token_ids and seq.spec_state.draft_class == TREE_CLASS} if model else None
        if self.length is not None and (lookup or model):
            self._cut_to_paying_length(running)
        if trees:
            self._draft_trees(running, trees, budget)

    def _cut_to_paying_length(self, running: list[Sequence]) -> None:
        """Cut each sequence's drafts to what pays."""
        drafting = [seq for seq in running if seq.spec_token_ids]
        if not drafting:
            return
        window = self.config.acceptance_window
        average = max(self.length.acceptance, 1e-3)
        # A sequence's acceptance against the average, once it has a record (a copy drafts better than chat).
        drafts = [(len(seq.spec_token_ids),
                   seq.spec_state.acceptance / average if seq.spec_state.num_verified >= window else 1.0,
                   seq.spec_state.draft_class)
                  for seq in drafting]
        keep = self.length.choose(self._tokens_without_drafts(running), drafts, len(running))
        for seq, n in zip(drafting, keep):
            del seq.spec_token_ids[n:]

    def _draft_trees(self, running: list[Sequence], depths: dict[int, int], budget: int) -> None:
        """Greedy requests' trees, drafted before the schedule. Without the rule, whole. With it, sized by the
        head's confidence: the head drafts each tree whose first token the rule kept (at the average
        acceptance), and the step keeps, over all of them, the rows whose gains (confidence.py) pay at this
        engine's step times, best first. depths: seq_id -> the chain tokens a sequence may draft; budget: its
        draft tokens, chain and alternatives together (the batch-size schedule's k), the chain's first."""
        cal, length = self.calibration, self.length
        trees = [seq for seq in running if seq.seq_id in depths and seq.spec_token_ids]
        if not trees:
            return
        start = time.perf_counter()
        made = self.draft.draft_trees(trees, [depths[seq.seq_id] for seq in trees], self.num_alternatives, cal,
                                      self.extend_min_gain)
        # Alternatives are stored past the chain, in the K/V slots from seq.num_tokens + len(chain) on: those
        # slots stay below max_model_len too (their positions are the first draft's, always inside it).
        rooms = [max(0, min(self.max_model_len - seq.num_tokens, budget) - len(d.chain)) for seq, d in zip(trees, made)]
        if cal is None:  # without the rule, every tree whole
            for seq, d, room in zip(trees, made, rooms):
                alternatives = d.alternatives[:room]
                seq.spec_token_ids, seq.spec_alternatives = d.chain + alternatives, len(alternatives)
            return
        length.observe_drafting(time.perf_counter() - start, max(len(d.chain) for d in made))
        ranked: list[tuple[float, int, int, int]] = []  # (-gain, chain position, tree, alternative number)
        for r, (d, room) in enumerate(zip(made, rooms)):
            chain = cal.chain_gains(d.chain_probs)
            ranked += [(-g, i, r, 0) for i, g in enumerate(chain)]
            alternatives = cal.alternative_gains(d.alternative_probs[:room], chain[0])
            ranked += [(-g, 0, r, j) for j, g in enumerate(alternatives, 1)]
        ranked.sort()
        others = [seq for seq in running if seq.spec_token_ids and seq.seq_id not in depths]
        model_depth = max((len(seq.spec_token_ids) for seq in others if seq.spec_state.draft_class <= MODEL_CLASS),
                          default=0)
        k = length.best_row_count(
            self._tokens_without_drafts(running), len(running), [-x[0] for x in ranked],
            sum(len(seq.spec_token_ids) for seq in others),
            sum(length.expected_gain(seq.spec_state.draft_class, len(seq.spec_token_ids)) for seq in others),
            model_depth * length.draft_seconds)
        kept = [[0, 0] for _ in trees]  # per tree: chain tokens, alternatives
        for _, _, r, j in ranked[:k]:
            kept[r][j > 0] += 1
        for seq, d, (chain, alternatives) in zip(trees, made, kept):
            seq.spec_token_ids = d.chain[:chain] + d.alternatives[:alternatives]
            seq.spec_alternatives = alternatives
            seq.spec_state.tree, seq.spec_state.tree_pos = d, seq.num_tokens

    def _tokens_without_drafts(self, running: list[Sequence]) -> int:
        """A step's tokens without drafts: each sequence's left to compute (1 when it decodes), up to the budget."""
        return min(self.max_num_batched_tokens, sum(seq.num_tokens - seq.num_computed_tokens for seq in running))

    def _propose_one(self, seq: Sequence, lookup: bool, model: bool, depth: int) -> list[int]:
        if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.prefill_done:
            return []  # still in prefill
        state = seq.spec_state
        if state is not None and self._step < state.paused_until:
            return []
        # Never draft past what the request may still emit: the step emits up to len(drafts) + 1 tokens,
        # and positions must stay inside max_model_len (the drafts' own, where given).
        max_new = min(depth, seq.params.max_tokens - seq.num_output_tokens - 1, self.draft_max_len - seq.num_tokens - 1)
        if max_new <= 0:
            return []
        if lookup:
            state = spec_state(seq)
            # The salt: suffix decoding drafts only from responses that this request's cache_salt may see.
            draft, match_length = self.proposer.propose_with_length(seq.token_ids, max_new, state.lookup,
                                                                    seq.tenant_salt)
            if draft:
                state.draft_class = match_length
                return draft
        if model and self.draft.can_draft(seq, max_new):
            if isinstance(self.draft, DraftProposer):
                # The tokens the draft has not seen run before its first draft, within the drafting sequences'
                # share of the step's budget; a sequence further behind catches up instead (fill_drafts).
                unseen = self.draft.unseen(seq)
                if unseen > self._drafting_left:
                    self._behind.append(seq)
                    return []
                self._drafting_left -= unseen
            # The scheduler sizes the row; fill_drafts() runs the draft model. Trees for greedy requests: for
            # sampled ones, sampling the extra rows cost more than they brought (benchmarks/README.md).
            tree = seq.params.greedy and (self.num_alternatives > 0 or self.calibration is not None)
            spec_state(seq).draft_class = TREE_CLASS if tree else MODEL_CLASS
            return [PLACEHOLDER] * max_new
        return []

    def finished(self, seq: Sequence) -> None:
        """seq ended (a stop, its length limit): suffix decoding keeps its response for later requests (with its
        cache_salt) to draft from."""
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.corpus.add(seq.token_ids, seq.num_prompt_tokens, seq.tenant_salt)

    def wants_hidden(self, num_running: int) -> bool:
        """Whether a step of this many running sequences should hand the target's hidden states to the eagle
        head: only where the head may draft for that many in the next step (above, gathering and storing
        every sequence's state each step pays for drafts that never come)."""
        return (isinstance(self.draft, EagleProposer)
                and self._model_drafts(num_running, self.config.draft_tokens_at(num_running)))

    def _model_drafts(self, num_running: int, budget: int) -> bool:
        """Whether the draft model or head drafts in a step of this many running sequences, given the step's
        draft budget (SpeculativeConfig.draft_tokens_at)."""
        return self.draft is not None and budget > 0 and _within(self.config.disable_by_batch_size, num_running)

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The target's hidden state that produced seq's last token (method "eagle"), after a step that emitted
        tokens for seq: a tree drafted before it is checked against them."""
        state = seq.spec_state
        if state is not None and state.tree is not None and seq.num_tokens > state.tree_pos:
            self.calibration.observe(state.tree, seq.token_ids[state.tree_pos:state.tree_pos + len(state.tree.chain)])
            state.tree = None
        self.draft.observe(seq, hidden)

    @property
    def couples_noise(self) -> bool:
        """Whether sampling requests need a generator of their own (the draft samples with its noise)."""
        return self.draft is not None

    def fill_drafts(self, sched: SchedulerOutput) -> None:
        """After the schedule: the draft model's catch-ups, then its tokens for the placeholder rows the
        scheduler kept."""
        if self.draft is None:
            return
        jobs = {seq_id: len(d) for seq_id, d in sched.spec_token_ids.items() if d and d[0] == PLACEHOLDER}
        if self._behind:
            self._catch_up(sched, jobs)
        if jobs:
            start = time.perf_counter()
            self.draft.fill(sched, jobs)
            if self.length is not None:
                self.length.observe_drafting(time.perf_counter() - start, max(jobs.values()))

    def _catch_up(self, sched: SchedulerOutput, jobs: dict[int, int]) -> None:
        """The backlogs of the sequences behind (propose) that the schedule kept (a preempted one's blocks are
        gone), within what the step's drafts leave of max_num_batched_tokens, the largest first. In a pass of
        its own, which the drafting time (the rule's) leaves out."""
        scheduled = {seq.seq_id: seq for seq, _ in sched.scheduled}
        left = self.max_num_batched_tokens - sum(self.draft.unseen(scheduled[seq_id]) for seq_id in jobs)
        chunks = []
        backlogs = sorted(((self.draft.unseen(seq), seq) for seq in self._behind if seq.seq_id in scheduled),
                          key=lambda backlog: backlog[0], reverse=True)
        for unseen, seq in backlogs:
            if left <= 0:
                break
            chunks.append((seq, min(unseen, left)))
            left -= chunks[-1][1]
        self._behind = []
        self.draft.catch_up(chunks)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The target's forward step over num_tokens tokens (drafts and a graph's padding included) took this
        long."""
        if self.length is not None:
            self.length.times.observe(num_tokens, seconds)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int, num_alternatives: int = 0,
               kept_alternative: int = 0) -> None:
        """The runner verified a chain of num_drafted drafts of seq (and num_alternatives alternatives to its
        first) and accepted num_accepted: the chain's first ones, or alternative kept_alternative (1-based) in
        place of its first. The counters count every draft token verified; the acceptance that pauses a
        request counts against the chain (a kept alternative as its first token)."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted + num_alternatives
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        state = spec_state(seq)
        if self.length is not None:
            self.length.record(num_drafted, num_accepted, state.draft_class, kept_alternative > 0)

        cfg = self.config
        # Each tested draft token moves the average by 1/window of the way to this draft's rate.
        tested = tested_tokens(num_drafted, num_accepted)
        weight = min(1.0, tested / cfg.acceptance_window)
        state.acceptance += weight * (num_accepted / tested - state.acceptance)
        state.num_verified += tested
        if cfg.min_acceptance_rate <= 0 or state.num_verified < cfg.acceptance_window:
            return
        if state.acceptance < cfg.min_acceptance_rate:
            state.paused_until = self._step + state.pause_steps
            state.pause_steps = min(2 * state.pause_steps, _MAX_PAUSE_STEPS)
            # Resume at the threshold: one good draft then keeps it drafting, one more bad one pauses it
            # again, for twice as long.
            state.acceptance = cfg.min_acceptance_rate
        else:
            state.pause_steps = FIRST_PAUSE_STEPS
