"""Who runs this step, and with how many tokens.

Every step has a token budget (max_num_batched_tokens). Running sequences are served first, best
priority first: a decode needs one token (1 + k with k draft tokens to verify, k trimmed to what the
budget and the block pool allow), a sequence still in prefill gets the next chunk of its prompt.
What is left of the budget admits waiting sequences (continuous batching), so one step can mix decodes
with prefill chunks, and a long prompt is spread over several steps instead of stalling the decodes.

When the block pool runs dry, the worst running sequence (lowest priority, latest arrival) is preempted:
its blocks are freed and it goes back to the waiting queue, to be recomputed later (its full blocks often
come back from the prefix cache). A sequence never needs more blocks than the pool holds (the engine caps
max_model_len to the pool), so preempting everything else always makes room: no deadlock.

Policies behind the same interface:
- continuous: admit at every step (above);
- static: admit a batch only when nothing runs, and run it to completion;
- dynamic: like static, but wait for a full batch or for the oldest request to have waited a time window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # (sequence, number of new tokens) in batch order; the tokens are
    # seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n], except for a sequence with
    # drafts: its last token followed by spec_token_ids[seq_id] (n = 1 + len(drafts)).
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)   # seq_id -> drafts to verify
    # seq_id -> how many of its drafts (the last ones) are alternatives to its first draft token, each at
    # that token's position (tree drafts: kvserve/spec_decode/verify.py); absent: a plain chain
    spec_alternatives: dict[int, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- bookkeeping ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks (full ones stay cached)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _key(self, seq: Sequence) -> tuple:
        return seq.sort_key(self.by_priority)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids, seq.spec_alternatives = [], 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def _ready(self, seq: Sequence) -> bool:
        # Siblings of an n > 1 request wait until sequence 0 has put the prompt in the cache.
        return seq.parent is None or seq.parent.prefill_done or seq.parent.is_finished

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        policy = self.config.batching
        if policy != "continuous" and not self.running and self._batch_ready(policy):
            self._admit_batch()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # After a preemption the pool is tight: admitting more would only preempt again.
        if policy == "continuous" and not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=self._key)
        queue = list(self.running)
        # Decodes behind a prefill keep one token each of the budget, so a long prompt never stalls them.
        decodes_left = sum(1 for s in queue if s.num_tokens - s.num_computed_tokens == 1)
        # Drafts never preempt anyone: their blocks come only from what the sequences still to be served this
        # step leave free. blocks_left: those sequences' needs without drafts (a prefill's at most the budget).
        needs = ({s.seq_id: self.block_manager.blocks_needed(s, min(s.num_tokens - s.num_computed_tokens, budget))
                  for s in queue} if any(s.spec_token_ids for s in queue) else None)
        blocks_left = sum(needs.values()) if needs else 0
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if needs:
                blocks_left -= needs[seq.seq_id]
            remaining = seq.num_tokens - seq.num_computed_tokens
            is_decode = remaining == 1
            if is_decode:
                decodes_left -= 1
                # Drafts take only what the decodes still to serve do not need.
                n = max(min(1, budget), min(1 + len(seq.spec_token_ids), budget - decodes_left))
                if n > 1:
                    n = self._rows_with_room(seq, n, blocks_left)
            else:
                n = min(remaining, max(0, budget - decodes_left))
            if n == 0:
                kept.append(seq)
                continue
            while not self.block_manager.allocate(seq, n):
                if queue:  # preempt the worst sequence not yet served this step
                    victim = queue.pop()
                    if victim.num_tokens - victim.num_computed_tokens == 1:
                        decodes_left -= 1
                    if needs:
                        blocks_left -= needs[victim.seq_id]
                    self._preempt(victim, out)
                else:
                    self._preempt(seq, out)
                    break
            else:
                kept.append(seq)
                out.scheduled.append((seq, n))
                if is_decode and n > 1:
                    out.spec_token_ids[seq.seq_id] = seq.spec_token_ids[:n - 1]
                    # A budget that cuts the drafts cuts the alternatives (last) first.
                    alternatives = seq.spec_alternatives - (len(seq.spec_token_ids) - (n - 1))
                    if alternatives > 0:
                        out.spec_alternatives[seq.seq_id] = alternatives
                budget -= n
        self.running = kept
        return budget

    def _rows_with_room(self, seq: Sequence, n: int, reserved: int) -> int:
        """The most of a decode's n rows (its token and n - 1 drafts) whose blocks leave `reserved` free for
        the sequences still to be served: the drafts are trimmed, never anyone preempted for them."""
        bm = self.block_manager
        own = bm.blocks_needed(seq, 1)
        room = max(0, bm.num_free_blocks - reserved - own)  # blocks the drafts may take
        while n > 1 and bm.blocks_needed(seq, n) - own > room:
            n -= 1
        return n

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self._key)
        admitted: list[Sequence] = []
        for seq in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._ready(seq):
                continue
            cached = self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free(seq)  # give back the prefix blocks we just took
                break
            self._count_admission(seq, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [s for s in self.waiting if id(s) not in taken]

    def _count_admission(self, seq: Sequence, cached: int) -> None:
        """Its prefix-cache hits, at its first admission only (a resumed sequence is not a new query), and only once
        admitted: an attempt that found no room for the rest had recorded hits that eviction may take before the
        attempt that succeeds (usage's cached_tokens and the hit counter then overstated them)."""
        if not seq.ever_admitted:
            seq.ever_admitted = True
            seq.num_cached_tokens = cached
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += cached

    # ---- static / dynamic batches --------------------------------------------------------------
    def _batch_ready(self, policy: str) -> bool:
        ready = [s for s in self.waiting if self._ready(s)]
        if not ready:
            return False
        if policy == "static" or len(ready) >= self.config.max_num_seqs:
            return True
        oldest = min(s.arrival_time for s in ready)
        return time.monotonic() - oldest >= self.config.dynamic_batch_window_s

    def _admit_batch(self) -> None:
        """Move up to max_num_seqs waiting sequences into the running batch; their prefills are chunked
        over the next steps by _schedule_running, and no one joins until the whole batch has finished."""
        self.waiting.sort(key=self._key)
        batch = [s for s in self.waiting if self._ready(s)][: self.config.max_num_seqs]
        for seq in batch:
            self._count_admission(seq, self.block_manager.match_prefix(seq))
            seq.status = SequenceStatus.RUNNING
        taken = set(map(id, batch))
        self.waiting = [s for s in self.waiting if id(s) not in taken]
        self.running.extend(batch)
