"""Which attention backend runs a model: "auto" (Triton on CUDA when triton is installed, else torch),
"torch" (the native CPU kernels where they apply, torch elsewhere) or "triton".

The Triton backend is imported only when chosen, so a CPU install never imports triton.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend
from kvserve.config import ATTENTION_BACKENDS
from kvserve.kernels.cuda import triton_installed
from kvserve.layers.attention import attention_layers
from kvserve.models.kv_cache import KVCacheSpec


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be {'|'.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
    if name == "triton":
        if not triton_installed():
            raise ValueError("attention backend 'triton' needs the triton package (pip install 'kvserve[gpu]')")
        # Off CUDA, Triton runs only in its interpreter (how the tests run it on a CPU): slow, never a default.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
    return name


def make_attention_backend(name: str, model: nn.Module, kv_spec: KVCacheSpec, num_blocks: int,
                           device: torch.device, dtype: torch.dtype, **options) -> AttentionBackend:
    """options go to the backend's constructor (TorchPagedBackend: native_kernels)."""
    layers = attention_layers(model)
    name = resolve_backend_name(name, device)
    if name == "triton":
        from kvserve.attention.triton.backend import TritonBackend
        return TritonBackend(layers, kv_spec, num_blocks, device, dtype, **options)
    from kvserve.attention.torch_backend import TorchPagedBackend
    return TorchPagedBackend(layers, kv_spec, num_blocks, device, dtype, **options)
