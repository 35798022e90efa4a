"""Tensors in, tokens out: turns a SchedulerOutput into one forward pass and one sampling pass.

A sequence with draft tokens (speculative decoding) is one row of 1 + k query tokens, its last token then
its drafts, like a chunk of prefill; every one of those positions is sampled, and the drafts are accepted
while they equal the samples (kvserve/spec_decode/verify.py). Alternatives to the first draft token (tree
drafts) follow the chain, each at the first draft's position; one that is kept has its K/V moved there."""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.attention.backend import StepBatch
from kvserve.attention.selector import make_attention_backend
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import rounds_by_step_shape
from kvserve.outputs import PositionLogprobs
from kvserve.models.kv_cache import KVCacheSpec
from kvserve.sampling.logprobs import compute_prompt_logprobs
from kvserve.sampling.sampler import Sampler, SamplingInputs, penalises
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.verify import kept_rows, verification_noise
from kvserve.utils.huge_pages import back_with_huge_pages
from kvserve.worker.cuda_graphs import StepInputs, samples_every_token
from kvserve.worker.memory_profile import worst_case_batch

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # For each scheduled sequence that reached the end of its tokens: the tokens to append and their
    # logprobs (None unless asked for). One token; with k drafts, the accepted ones plus one more.
    sampled: dict[int, tuple[list[int], list[PositionLogprobs | None]]]
    # For sequences that asked for prompt logprobs: this step's chunk of them, in prompt order.
    prompt_logprobs: dict[int, list[PositionLogprobs]]
    # With keep_hidden (method "eagle"), for each sequence in `sampled`: the model's final hidden state at the
    # row that produced its last kept token.
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 eos_token_ids: list[int], dtype: torch.dtype = torch.float32, attention_backend: str = "auto",
                 batch_invariant: bool = False, generator: torch.Generator | None = None) -> None:
        self.model = model
        self.block_size = kv_spec.block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.attn_backend = make_attention_backend(attention_backend, model, kv_spec, num_blocks, device, dtype,
                                                   **({"batch_invariant": True} if batch_invariant else {}))
        self.kv_caches = self.attn_backend.allocate_kv_caches()
        self.sampler = Sampler(generator)  # generator: the engine's, for unseeded rows
        self.graphs = None  # StepGraphs once capture_graphs ran (CUDA, Triton backend)
        self.keep_hidden = False  # return the sampled rows' hidden states (the eagle head reads them)
        # The model's last layer for the sampled rows alone (out_rows); False: for every row, the sampled ones kept
        # after (the same bits, more work: what benchmarks/prefill_last_layer.py and the tests compare against).
        self.sampled_rows_only = True
        self.last_step_tokens = 0  # the tokens the last step ran: a captured graph's padded shape, else its own
        if device.type == "cpu":
            cpu_kernels.available()  # build (or load) the native kernel now, not in a first request's step
            back_with_huge_pages(self.model)  # every step streams the weights

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_width: int | None = None,
                       verify_max_seqs: int = 0) -> None:
        """CUDA graphs for decode steps and, with verify_width (1 + num_speculative_tokens), for verification
        steps of up to verify_max_seqs sequences (kvserve/worker/cuda_graphs.py); after the KV pool is final."""
        from kvserve.worker.cuda_graphs import StepGraphs
        self.graphs = StepGraphs(self.model, self.attn_backend, self.kv_caches, max_num_seqs, max_model_len,
                                 self.block_size, verify_width, verify_max_seqs)
        start = time.perf_counter()
        self.graphs.capture()
        libraries = ", ".join(f"{name} {n}" for name, n in Counter(self.graphs.blas.values()).most_common())
        logger.info("CUDA graphs: %d step shapes captured in %.1f s (BLAS library kept, by shapes: %s)",
                    len(self.graphs.graphs), time.perf_counter() - start, libraries)
        if logger.isEnabledFor(logging.DEBUG):
            for shape, ms in self.graphs.blas_ms.items():  # empty where one library was usable
                times = ", ".join(f"{name} {t:.3f}" for name, t in ms.items()) or "one candidate"
                logger.debug("CUDA graph %s x %s: %s kept (replay ms: %s)", *shape, self.graphs.blas[shape], times)

    def rows_alike(self) -> bool:
        """Whether every row of a step computes as it would alone: every linear layer and every attention layer on
        kvserve's CPU kernels, so that speculation and batching leave a row's bits as they are."""
        return not rounds_by_step_shape(self.model) and self.attn_backend.rows_alike()

    def step_tokens(self, num_seqs: int, num_tokens: int, num_drafts: int) -> int:
        """The tokens a step of num_seqs sequences, num_tokens without drafts and num_drafts draft tokens, will
        run (what its time is keyed by, draft_length.StepTimes): a captured graph's padded shape (on a GPU
        any draft makes a 4-sequence step a 4 x 5 one), else the step's own tokens."""
        padded = self.graphs.step_tokens(num_seqs, num_tokens, num_drafts) if self.graphs is not None else None
        return num_tokens + num_drafts if padded is None else padded

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, num_draft_rows: int = 0) -> torch.Tensor:
        """One worst-case step with made-up tokens (worst_case_batch: it needs that many KV blocks), every
        sequence sampled with default parameters: what the KV sizing measures the activation peak on. With
        speculative decoding a step also takes logits for its draft tokens (num_draft_rows, up to the step's
        tokens): [sequences + drafts, vocabulary] float32, which at a large vocabulary outweighs the rest.
        Returns the sampled token ids, one per row."""
        dummy = worst_case_batch(num_tokens, num_seqs, self.block_size)
        dev, bs = self.device, self.block_size
        starts = [0]
        for n in dummy.query_lens:
            starts.append(starts[-1] + n)
        meta = self.attn_backend.build_metadata(StepBatch.from_host(
            dummy.block_tables, dummy.slots, starts, list(dummy.query_lens), bs, dev))
        positions = [p for n in dummy.query_lens for p in range(n)]
        hidden = self.model(torch.zeros(len(positions), dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), meta, self.kv_caches)
        last = [e - 1 for e in starts[1:]]
        # Which other positions stand in for the drafts does not matter here: their rows' memory does.
        is_last = set(last)
        others = [i for i in range(len(positions)) if i not in is_last][:max(0, num_draft_rows)]
        logits = self.model.compute_logits(hidden[sorted(last + others)])
        n = logits.shape[0]
        inputs = SamplingInputs([SamplingParams()] * n, [None] * n, [[0]] * n, [[]] * n, self.eos_token_ids)
        return torch.tensor(self.sampler(logits, inputs).token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []          # rows of the flat batch whose logits we sample from
        sample_seqs: list[Sequence] = []     # per sampled row (a sequence with k drafts has k + 1 rows)
        sample_outputs: list[list[int]] = []  # per sampled row: the output tokens before that position
        sample_num_outputs: list[int] = []    # and how many there are
        prompt_lp: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, first position, count)
        first_rows: dict[int, int] = {}      # seq_id -> its first row in the flat batch
        tree = False                         # any alternatives: some positions differ from their indices

        for seq, n in sched.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            drafts = sched.spec_token_ids.get(seq.seq_id, ())
            alternatives = sched.spec_alternatives.get(seq.seq_id, 0)
            row0 = first_rows[seq.seq_id] = len(input_ids)
            input_ids.extend(seq.token_ids[start:end - len(drafts)])
            input_ids.extend(drafts)
            if alternatives:  # each at the first draft's position, stored past the chain and each other
                tree = True
                positions.extend(range(start, end - alternatives))
                positions.extend([end - len(drafts)] * alternatives)
            else:
                positions.extend(range(start, end))
            table = seq.block_table
            if n == 1:
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            if end - len(drafts) == seq.num_tokens:
                # The token lists only where a penalty reads them: copying them for every row of every step
                # cost ~12 us per row at 8k outputs (a verification step has up to k + 1 rows a sequence).
                penalised = penalises(seq.params)
                outputs = seq.output_token_ids if penalised else []
                num_outputs = seq.num_output_tokens
                depth = len(drafts) - alternatives
                for j in range(len(drafts) + 1):  # row j predicts the token after drafts[:j] (an alternative: after it)
                    sample_rows.append(len(input_ids) - 1 - len(drafts) + j)
                    sample_seqs.append(seq)
                    before = j if j <= depth else 1
                    sample_num_outputs.append(num_outputs + before)
                    if not penalised:
                        sample_outputs.append(outputs)
                    else:
                        sample_outputs.append(outputs + list(drafts[:j]) if 0 < j <= depth
                                              else outputs + [drafts[j - 1]] if j else outputs)
            if seq.needs_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                # Row p predicts token p + 1; only positions whose next token is in the prompt.
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_lp.append((seq, row0, start, count))

        result = ModelRunnerOutput(sampled={}, prompt_logprobs={})
        graphs = self.graphs
        query_lens = [n for _, n in sched.scheduled]
        shape = (graphs.shape_for(query_lens, seq_lens)
                 if graphs is not None and not tree
                 and samples_every_token(query_lens, len(sample_rows), bool(prompt_lp)) else None)
        self.last_step_tokens = len(input_ids) if shape is None else shape[0] * shape[1]
        if shape is not None:  # every token is sampled, so the sampled rows are all rows, in order
            sampled_hidden, logits = graphs.run(StepInputs(input_ids, positions, slot_mapping, query_lens, seq_lens,
                                                           [seq.block_table for seq, _ in sched.scheduled]),
                                                shape, want_hidden=self.keep_hidden)
        else:
            logits, sampled_hidden = self._forward_eager(sched, input_ids, positions, slot_mapping,
                                                         query_start_loc, seq_lens, sample_rows, prompt_lp, result,
                                                         tree)

        if sample_seqs:
            # Per sampled row, the uniforms a draft drew for it; per sequence (its first row, its drafts), how
            # to put its generator where the kept rows leave it.
            noise: list[torch.Tensor | None] = []
            groups: list[tuple[int, Sequence, list[int], Callable[[int], None] | None]] = []
            row = 0
            while row < len(sample_seqs):
                seq = sample_seqs[row]
                drafts = sched.spec_token_ids.get(seq.seq_id, [])
                rows, rewind = verification_noise(seq, len(drafts), logits.shape[1], logits.device)
                noise += rows
                groups.append((row, seq, drafts, rewind))
                row += len(drafts) + 1
            prompts = {s.seq_id: s.prompt_token_ids if penalises(s.params) else [] for s in sample_seqs}
            inputs = SamplingInputs(
                params=[s.params for s in sample_seqs],
                generators=[s.generator for s in sample_seqs],
                prompt_token_ids=[prompts[s.seq_id] for s in sample_seqs],
                output_token_ids=sample_outputs,
                eos_token_ids=self.eos_token_ids,
                noise=noise,
                num_output_tokens=sample_num_outputs,
            )
            sampled = self.sampler(logits, inputs)
            moved_from: list[int] = []  # K/V of kept alternatives, to their position
            moved_to: list[int] = []
            for row, seq, drafts, rewind in groups:
                tokens = sampled.token_ids[row:row + len(drafts) + 1]
                kept = kept_rows(tokens, drafts, sched.spec_alternatives.get(seq.seq_id, 0)) if drafts else [0]
                result.sampled[seq.seq_id] = ([tokens[r] for r in kept], [sampled.logprobs[row + r] for r in kept])
                if self.keep_hidden:
                    result.hidden[seq.seq_id] = sampled_hidden[row + kept[-1]]
                if kept[-1] != len(kept) - 1:  # an alternative, stored past the chain
                    first = first_rows[seq.seq_id]
                    moved_from.append(slot_mapping[first + kept[-1]])
                    moved_to.append(slot_mapping[first + 1])
                if rewind is not None and len(kept) < len(tokens):
                    rewind(len(kept))
            if moved_from:
                self.attn_backend.copy_slots(self.kv_caches, moved_from, moved_to)
        return result

    def _forward_eager(self, sched: SchedulerOutput, input_ids: list[int], positions: list[int],
                       slot_mapping: list[int], query_start_loc: list[int], seq_lens: list[int],
                       sample_rows: list[int], prompt_lp: list[tuple[Sequence, int, int, int]],
                       result: ModelRunnerOutput, tree: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The model's forward for any step; prompt logprobs into result; the sampled rows' logits and
        hidden states. tree: some positions differ from their tokens' indices (alternatives)."""
        dev = self.device
        # The backend's per-step work (index tensors, plans) happens here, once, not in the first layer.
        drafts = sched.spec_token_ids
        meta = self.attn_backend.build_metadata(StepBatch.from_host(
            [seq.block_table for seq, _ in sched.scheduled], slot_mapping, query_start_loc, seq_lens,
            self.block_size, dev, positions if tree else None,
            [len(drafts.get(seq.seq_id, ())) for seq, _ in sched.scheduled] if drafts else None))
        # Only the sampled rows' hidden states, unless prompt logprobs need them all: a prompt chunk samples one
        # row or none, and the model may then skip its last layer's attention and MLP for the others.
        out_rows = (None if prompt_lp or len(sample_rows) == len(input_ids) or not self.sampled_rows_only
                    else torch.tensor(sample_rows, dtype=torch.int64, device=dev))
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            self.kv_caches,
            out_rows,
        )
        for seq, row0, start, count in prompt_lp:
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            targets = seq.token_ids[start + 1:start + 1 + count]
            result.prompt_logprobs[seq.seq_id] = compute_prompt_logprobs(
                logits, targets, seq.params.prompt_logprobs)
        if not sample_rows:
            return None, None
        if out_rows is None:
            hidden = hidden[sample_rows]
        return self.model.compute_logits(hidden), hidden
