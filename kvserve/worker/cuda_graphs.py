"""CUDA graphs for pure-decode steps (one new token per sequence, every sequence sampled): the model's
forward and its logits, captured once per padded batch size and replayed, so a decode step costs a few
copies and one graph launch instead of hundreds of kernel launches from Python. --enforce-eager turns
them off; other steps (prefill, chunks, speculative rows, prompt logprobs) always run eagerly.

A step of n sequences runs in the graph of the smallest captured size >= n. Its inputs go into persistent
buffers that the graph reads; the padding rows are one-token sequences at position 0 with block 0 as their
table and slot -1, so they write nothing to the cache (the KV write kernel skips slot -1) and their
logits, which read block 0's first key, are sliced away. Only the Triton backend is captured: its
metadata is the step's own tensors plus a tile schedule that, for decode, is the same for every step of
one size. The split-KV count is fixed per graph from max_model_len.

The padding and bucketing are pure functions, tested on the CPU; DecodeGraphs itself needs CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend, KVCache, StepBatch


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
class DecodeInputs:
    """One decode step's per-sequence inputs, as host lists."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    def padded(self, size: int) -> DecodeInputs:
        """The same step as `size` rows: padding rows are 1-token sequences at position 0 in block 0 that
        write nothing (slot -1)."""
        pad = size - len(self.input_ids)
        assert pad >= 0
        return DecodeInputs(self.input_ids + [0] * pad, self.positions + [0] * pad, self.slots + [-1] * pad,
                            self.seq_lens + [1] * pad, self.block_tables + [[0]] * pad)

    def tables_tensor(self) -> torch.Tensor:
        """[rows, widest table] int64, zero-filled."""
        width = max(len(t) for t in self.block_tables)
        out = torch.zeros((len(self.block_tables), width), dtype=torch.int64)
        for i, t in enumerate(self.block_tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        return out


def is_pure_decode(query_lens: list[int], num_sampled: int, has_prompt_logprobs: bool) -> bool:
    """What a captured graph can run: one token per sequence, each one sampled, no prompt logprobs."""
    return (bool(query_lens) and all(n == 1 for n in query_lens) and num_sampled == len(query_lens)
            and not has_prompt_logprobs)


class DecodeGraphs:
    """Captured decode graphs for one model, Triton attention backend and KV pool. Capture and replay need
    CUDA; load and forward, what a replay repeats, run anywhere the backend does (the tests: the CPU,
    under Triton's interpreter)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[KVCache],
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        assert backend.name == "triton", "decode graphs need metadata that is the step's own tensors"
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        n, dev = self.sizes[-1], backend.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.query_start_loc = torch.arange(n + 1, **i64)   # one token per row, for every step
        self.block_tables = torch.zeros((n, -(-max_model_len // block_size)), **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._metas: dict[int, object] = {}                  # kept alive: the graphs read their tensors

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def load(self, inputs: DecodeInputs) -> int:
        """The step's inputs, padded, into the persistent buffers; returns the padded size. Table columns
        past this step's widest stay stale: no row reads past its own length."""
        size = padded_size(len(inputs.input_ids), self.sizes)
        assert size is not None
        p = inputs.padded(size)
        host = torch.tensor([p.input_ids, p.positions, p.slots, p.seq_lens], dtype=torch.int64)
        for buf, row in zip((self.input_ids, self.positions, self.slots, self.seq_lens), host):
            buf[:size].copy_(row, non_blocking=True)
        tables = p.tables_tensor()
        self.block_tables[:size, :tables.shape[1]].copy_(tables, non_blocking=True)
        return size

    def forward(self, size: int) -> torch.Tensor:
        """What a graph of this size records: the model over the buffers' first `size` rows, then logits."""
        meta = self._metas.get(size)
        if meta is None:
            batch = StepBatch(self.slots[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                              self.block_tables[:size], list(range(size + 1)), [1] * size, self.block_size)
            # Built once per size, outside any capture: the tile schedule is a host-to-device copy that is the
            # same for every decode step of this size; the split count serves any length up to max_model_len.
            meta = self._metas[size] = self.backend.build_metadata(batch, max_seq_len=self.max_model_len)
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all sizes sharing one memory pool (a smaller graph's buffers fit in a larger's)."""
        dev = self.backend.device
        assert dev.type == "cuda"
        pool = None
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up outside the graph: metadata, Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """The step's float32 logits [n, vocab] (a view into the graph's output: use before the next run)."""
        size = self.load(inputs)
        self.graphs[size].replay()
        return self.logits[size][:len(inputs.input_ids)]
