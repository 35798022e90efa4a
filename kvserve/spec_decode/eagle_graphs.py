"""CUDA graphs of the eagle head's step (eagle_head.py), one per padded batch size, as the target's decode and
verification steps have (kvserve/worker/cuda_graphs.py).

On an H200 the head's step ran eagerly: a dozen small kernels launched from Python, ~0.3-0.5 ms a draft
position next to a 1.2-1.4 ms graph replay of the whole target, so the draft-length rule let it draft
almost never (benchmarks/results/speculative_gpu_eagle_k1.md). One graph replays the step, the LM head
over the head's vocabulary and the greedy token together; greedy drafts read the token, sampled ones the
logits. The head keeps no state between steps (its input is the previous feature and token), so a step's
graph is the same whatever the sequences: padding rows are whatever the buffers hold, their outputs dropped.
Rows never mix in the head, so the real rows' results do not depend on the padding's.

Each size's graph records its matmuls with the faster of two BLAS libraries, as the step graphs do
(kvserve/worker/blas_choice.py). Load and forward, what a replay repeats, run anywhere (the tests check
them on the CPU); capture and replay need CUDA.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.sampling.sampler import argmax
from kvserve.worker.blas_choice import capture_all
from kvserve.worker.cuda_graphs import capture_sizes, padded_size

if TYPE_CHECKING:
    from kvserve.spec_decode.eagle_head import EagleHead

HeadOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # next features, float32 logits, greedy tokens


class HeadGraphs:
    """The head's step, LM head and greedy token captured per padded batch size, with the buffers they read."""

    def __init__(self, head: EagleHead, max_rows: int) -> None:
        """max_rows: the most sequences the head drafts for in one step; larger batches run eagerly."""
        self.head = head
        self.sizes = capture_sizes(max_rows)
        n, dev = self.sizes[-1], head.vocab_ids.device
        self.feature = torch.zeros((n, head.config.hidden_size), dtype=head.norm.weight.dtype, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, HeadOutputs] = {}

    def load(self, feature: torch.Tensor, token_ids: torch.Tensor) -> int | None:
        """The rows into the buffers; the captured size that holds them, None: too many (run eagerly)."""
        size = padded_size(len(token_ids), self.sizes)
        if size is not None:
            n = len(token_ids)
            self.feature[:n].copy_(feature, non_blocking=True)
            self.tokens[:n].copy_(token_ids, non_blocking=True)
        return size

    def forward(self, size: int) -> HeadOutputs:
        """What the graph of this size records: the head over the buffers' first `size` rows."""
        head = self.head
        feature, normed = head.step(self.feature[:size], self.tokens[:size])
        logits = head.lm_head(normed).float()
        return feature, logits, head.vocab_ids[argmax(logits)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first, into one memory pool (as StepGraphs)."""
        assert self.feature.device.type == "cuda"
        self.graphs, self.outputs, _, _ = capture_all(self.sizes[::-1], self.forward, self.feature.device)

    def run(self, feature: torch.Tensor, token_ids: torch.Tensor) -> HeadOutputs | None:
        """The head's step over these rows by replay (views into the graph's outputs: read them before the
        next run); None where no captured size holds them."""
        size = self.load(feature, token_ids)
        if size is None:
            return None
        self.graphs[size].replay()
        n = len(token_ids)
        feature, logits, tokens = self.outputs[size]
        return feature[:n], logits[:n], tokens[:n]
