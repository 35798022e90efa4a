"""Hand-built paged-attention batches for model tests: a sequential block allocator, slot mapping and
block tables, independent of the engine's own block manager."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, KVCache, StepBatch
from kvserve.attention.selector import make_attention_backend
from kvserve.config import ModelConfig
from kvserve.models.kv_cache import kv_cache_spec


@dataclass
class PagedSeqs:
    """Tracks, for several sequences, how many tokens are cached and which blocks hold them; the backend
    turns each step into its metadata."""
    backend: AttentionBackend
    next_free: int = 1  # block 0 stays unused so a wrong "unused entry = 0" read shows up as garbage
    blocks: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.backend.kv_spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.backend.num_blocks

    def _grow(self, seq: int, new_len: int) -> None:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) * self.block_size < new_len:
            assert self.next_free < self.num_blocks, "test ran out of KV blocks"
            blocks.append(self.next_free)
            self.next_free += 1

    def batch(self, chunks: dict[int, list[int]]) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata
    ]:
        """Append `chunks[seq]` (new token ids) to each sequence; returns input_ids, positions, metadata."""
        device = self.backend.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq, toks in chunks.items():
            old = self.lens.get(seq, 0)
            new = old + len(toks)
            self._grow(seq, new)
            for p in range(old, new):
                positions.append(p)
                slots.append(self.blocks[seq][p // self.block_size] * self.block_size + p % self.block_size)
            ids.extend(toks)
            starts.append(starts[-1] + len(toks))
            seq_lens.append(new)
            self.lens[seq] = new
        width = max(len(self.blocks[s]) for s in chunks)
        tables = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in chunks]
        meta = self.backend.build_metadata(StepBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            query_start_loc_list=starts,
            seq_lens_list=seq_lens,
            block_size=self.block_size,
        ))
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
        )


def make_backend(model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int, *,
                 kind: str = "torch", native_kernels: bool = True, dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None, device: torch.device = torch.device("cpu")
                 ) -> AttentionBackend:
    """The attention backend a runner would build for this model (kind "torch" or "triton")."""
    spec = kv_cache_spec(cfg, block_size, kv_dtype or dtype)
    options = {"native_kernels": native_kernels} if kind == "torch" else {}
    return make_attention_backend(kind, model, spec, num_blocks, device, dtype, **options)


def make_kv_caches(backend: AttentionBackend) -> list[KVCache]:
    """Caches in the backend's layout, filled with random values, not zeros: a read of a slot that was never
    written then shifts the logits visibly. (Not NaN: padded decode rows read unwritten slots under a zero
    attention weight, and 0 * NaN is NaN.)"""
    g = torch.Generator().manual_seed(1234)
    dtype, dev = backend.kv_spec.dtype, backend.device
    shape = backend.kv_cache_shape(backend.num_blocks)
    return [
        ((torch.randn(shape, generator=g) * 3).to(dev, dtype), (torch.randn(shape, generator=g) * 3).to(dev, dtype))
        for _ in range(backend.kv_spec.num_layers)
    ]


def require_native_kernel() -> None:
    """Skip where no kernel variant can run (no AVX-512 or AVX2, no C++ compiler, turned off by the
    environment); otherwise a failed build fails."""
    import pytest

    from kvserve.kernels import cpu as cpu_kernels

    if not any(cpu_kernels.cpu_supports(isa) for isa in cpu_kernels.ISAS):
        pytest.skip("the native kernels need AVX-512 or AVX2 + FMA + F16C")
    if not cpu_kernels.have_compiler():
        pytest.skip("the native kernels need a C++ compiler (c++ on PATH)")
    if cpu_kernels.requested_isa() == "none":
        pytest.skip("the native kernels are turned off (KVSERVE_CPU_ISA=none or KVSERVE_CPU_KERNELS=0)")
    assert cpu_kernels.available(), "the native kernels did not build (see the log)"


def native_ops(isa: str):
    """torch.ops namespace of one ISA variant of the kernels, built (or loaded) for the test; skips where
    this machine cannot run that variant."""
    import pytest

    from kvserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.cpu_supports(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    if not cpu_kernels.have_compiler():
        pytest.skip("the native kernels need a C++ compiler (c++ on PATH)")
    ops = cpu_kernels.build(isa)
    assert ops is not None, f"the {isa} kernels did not build (see the log)"
    return ops
