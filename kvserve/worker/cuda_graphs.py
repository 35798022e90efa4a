"""CUDA graphs for decode and verification steps (every token of every row sampled: one new token per
sequence, or its last token and its drafts): the model's forward, hidden states and logits, captured once
per padded shape and replayed, so such a step costs a few copies and one graph launch instead of hundreds
of kernel launches from Python. --enforce-eager turns them off; other steps (prefill, chunks, prompt
logprobs) always run eagerly.

A shape is (rows, width): `rows` sequences of `width` tokens each. Width 1 is a decode step, captured at
every size up to max_num_seqs; with speculative decoding, width 1 + k (k: num_speculative_tokens) is a
verification step, captured up to the most sequences that may draft in one step. A step runs in the
smallest captured shape that holds it: each row is padded at its end to the width, then padding rows are
added. Padding tokens write nothing to the cache (slot -1: the KV write kernel skips it) and their outputs
are dropped; a padded row's length grows by its padding, so its real tokens keep their positions in the
attention kernel (a token's position is its row's length minus the tokens after it) and see only keys up to
their own. A padding row is `width` tokens at position 0 with block 0 as its table. One width per step
kind keeps the graphs to two sets; the price is that a step verifying one draft token costs a full-width
one (on an H200, 4 sequences: 2.19 ms at width 5 against 1.57 at width 1, benchmarks/gpu_verify_step.py).

Only the Triton backend is captured: its metadata is the step's own tensors plus a tile schedule that is
the same for every step of one shape. The split-KV count is fixed per graph from max_model_len.

Each shape's graph records its matmuls with the faster of two BLAS libraries (blas_choice.py).

The padding and bucketing are pure functions, tested on the CPU; StepGraphs itself needs CUDA to capture.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend, KVCache, StepBatch
from kvserve.worker.blas_choice import capture_all


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 (nano-vllm's choice: at most 15 padding rows above 16), up to
    max_num_seqs, which is always included."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs (sizes ascending); None: too many, run eagerly."""
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


@dataclass
class StepInputs:
    """One step's rows as host lists, tokens flat in row order; row i has query_lens[i] tokens."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    def padded(self, size: int, width: int) -> StepInputs:
        """The same step as `size` rows of `width` tokens. A row's padding tokens follow its own (token 0 at
        its last position, slot -1) and lengthen it; padding rows are `width` tokens at position 0 in block 0
        that write nothing."""
        extra = size - len(self.query_lens)
        assert extra >= 0 and max(self.query_lens) <= width
        if width == 1:  # decode: no row needs padding (the hot case, kept to list concatenation)
            ids, pos, slots, seq_lens = self.input_ids, self.positions, self.slots, self.seq_lens
        else:
            ids, pos, slots, seq_lens = [], [], [], []
            i = 0
            for n, length in zip(self.query_lens, self.seq_lens):
                pad = width - n
                ids += self.input_ids[i:i + n] + [0] * pad
                pos += self.positions[i:i + n] + [self.positions[i + n - 1]] * pad
                slots += self.slots[i:i + n] + [-1] * pad
                seq_lens.append(length + pad)
                i += n
        fill = extra * width
        return StepInputs(ids + [0] * fill, pos + [0] * fill, slots + [-1] * fill, [width] * size,
                          seq_lens + [width] * extra, self.block_tables + [[0]] * extra)

    def tables_tensor(self) -> torch.Tensor:
        """[rows, widest table] int64, zero-filled."""
        width = max(len(t) for t in self.block_tables)
        out = torch.zeros((len(self.block_tables), width), dtype=torch.int64)
        for i, t in enumerate(self.block_tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        return out

    def padded_rows(self, width: int) -> list[int]:
        """Where each real token lands in the padded step, in order."""
        return [i * width + j for i, n in enumerate(self.query_lens) for j in range(n)]


def samples_every_token(query_lens: list[int], num_sampled: int, has_prompt_logprobs: bool) -> bool:
    """What a captured graph can run: rows whose every token is sampled (a decode token, or a last token and
    its drafts), no prompt logprobs. A prefill chunk samples at most its last token."""
    return bool(query_lens) and num_sampled == sum(query_lens) and not has_prompt_logprobs


class StepGraphs:
    """Captured step graphs for one model, Triton attention backend and KV pool. Capture and replay need
    CUDA; load and forward, what a replay repeats, run anywhere the backend does (the tests: the CPU,
    under Triton's interpreter)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[KVCache],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 verify_width: int | None = None, verify_max_seqs: int = 0) -> None:
        """verify_width: 1 + num_speculative_tokens, captured for steps of up to verify_max_seqs sequences;
        None: decode graphs only."""
        assert backend.name == "triton", "step graphs need metadata that is the step's own tensors"
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = {1: capture_sizes(max_num_seqs)}
        if verify_width is not None and verify_width > 1 and verify_max_seqs > 0:
            self.sizes[verify_width] = capture_sizes(min(verify_max_seqs, max_num_seqs))
        self.widths = sorted(self.sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_cols = -(-max_model_len // block_size)
        n, dev = max(s[-1] * w for w, s in self.sizes.items()), backend.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.full((n,), -1, **i64)
        rows = self.sizes[1][-1]
        self.seq_lens = torch.ones(rows, **i64)
        self.block_tables = torch.zeros((rows, self.max_cols), **i64)
        self.query_start_loc = {w: torch.arange(0, rows * w + 1, w, **i64) for w in self.widths}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (hidden, logits)
        self._metas: dict[tuple[int, int], object] = {}  # kept alive: the graphs read their tensors
        self.blas: dict[tuple[int, int], str] = {}  # the BLAS library each shape's graph was captured with
        self.blas_ms: dict[tuple[int, int], dict[str, float]] = {}  # each candidate library's replay ms there
        self.replays: Counter[tuple[int, int]] = Counter()  # steps run by shape (which choices a run leaned on)

    def _captured(self, num_rows: int, longest: int) -> tuple[int, int] | None:
        """The smallest captured (rows, width) with num_rows rows of up to `longest` tokens; None: none."""
        for width in self.widths:
            if width >= longest:
                size = padded_size(num_rows, self.sizes[width])
                return None if size is None else (size, width)
        return None

    def shape_for(self, query_lens: list[int], seq_lens: list[int]) -> tuple[int, int] | None:
        """The captured (rows, width) that holds this step; None: none does, run eagerly."""
        shape = self._captured(len(query_lens), max(query_lens))
        if shape is None:
            return None
        # A padded row's keys must stay inside its table: rows near max_model_len run eagerly.
        width = shape[1]
        if width > 1 and max(s + width - q for s, q in zip(seq_lens, query_lens)) > self.max_cols * self.block_size:
            return None
        return shape

    def step_tokens(self, num_seqs: int, num_tokens: int, num_drafts: int) -> int | None:
        """The tokens a captured graph runs for a step of num_seqs decoding sequences (num_tokens of them)
        carrying num_drafts draft tokens in all: any draft makes it a full-width verification step. None: such
        a step runs eagerly (rows still in prefill, more sequences than captured)."""
        if num_tokens != num_seqs:
            return None
        shape = self._captured(num_seqs, 2 if num_drafts else 1)  # a draft: some row of at least 2 tokens
        return None if shape is None else shape[0] * shape[1]

    def load(self, inputs: StepInputs, shape: tuple[int, int]) -> None:
        """The step's inputs, padded to `shape`, into the persistent buffers. Table columns past this step's
        widest stay stale: no row reads past its own length."""
        size, width = shape
        p = inputs.padded(size, width)
        n = size * width
        tokens = torch.tensor([p.input_ids, p.positions, p.slots], dtype=torch.int64)
        for buf, row in zip((self.input_ids, self.positions, self.slots), tokens):
            buf[:n].copy_(row, non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(p.seq_lens, dtype=torch.int64), non_blocking=True)
        tables = p.tables_tensor()
        self.block_tables[:size, :tables.shape[1]].copy_(tables, non_blocking=True)

    def forward(self, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph of this shape records: the model over the buffers' first rows, then logits."""
        size, width = shape
        n = size * width
        meta = self._metas.get(shape)
        if meta is None:
            batch = StepBatch(self.slots[:n], self.query_start_loc[width][:size + 1], self.seq_lens[:size],
                              self.block_tables[:size], list(range(0, n + 1, width)), [width] * size,
                              self.block_size)
            # Built once per shape, outside any capture: the tile schedule is a host-to-device copy that is the
            # same for every step of this shape; the split count serves any length up to max_model_len.
            meta = self._metas[shape] = self.backend.build_metadata(batch, max_seq_len=self.max_model_len)
        hidden = self.model(self.input_ids[:n], self.positions[:n], meta, self.kv_caches)
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every shape, largest first, into one memory pool, each with the faster BLAS library
        (blas_choice.capture_all)."""
        dev = self.backend.device
        assert dev.type == "cuda"
        shapes = sorted(((s, w) for w, sizes in self.sizes.items() for s in sizes),
                        key=lambda sw: sw[0] * sw[1], reverse=True)
        self.graphs, self.outputs, self.blas, self.blas_ms = capture_all(shapes, self.forward, dev)

    def replay(self, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph of this shape over the loaded buffers: its (hidden, logits) outputs."""
        self.graphs[shape].replay()
        self.replays[shape] += 1
        return self.outputs[shape]

    @torch.inference_mode()
    def run(self, inputs: StepInputs, shape: tuple[int, int], want_hidden: bool = False
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's float32 logits, one row per real token in order (a view into the graph's output for
        decode: use it before the next run), and with want_hidden its hidden states (a copy: the eagle head
        may read a sequence's after later replays)."""
        self.load(inputs, shape)
        hidden, logits = self.replay(shape)
        size, width = shape
        if width == 1:
            n = len(inputs.query_lens)
            return (hidden[:n].clone() if want_hidden else None), logits[:n]
        rows = torch.tensor(inputs.padded_rows(width), dtype=torch.int64).to(logits.device, non_blocking=True)
        return (hidden[rows] if want_hidden else None), logits[rows]
