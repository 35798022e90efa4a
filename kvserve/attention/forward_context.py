"""The step's attention state, visible to every attention layer during one forward pass.

The model's forward opens it around its layers, so layers call self.attn(q, k, v) and never carry the
metadata or the caches down their call chain. The one piece of module-level state the hot path needs; it
lives exactly as long as the `with` block.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvserve.attention.backend import AttentionMetadata, KVCache


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[KVCache]  # indexed by PagedAttention.layer_idx


_current: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, kv_caches: list[KVCache]) -> Iterator[ForwardContext]:
    global _current
    outer, _current = _current, ForwardContext(meta, kv_caches)
    try:
        yield _current
    finally:
        _current = outer


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside a model forward (no forward_context)"
    return _current
