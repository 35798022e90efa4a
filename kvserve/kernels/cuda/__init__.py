"""Triton kernels for the elementwise work between a layer's matmuls on an NVIDIA GPU: the fused residual
add + RMSNorm, RMSNorm, rotary embedding in place, SiLU-and-mul. Through torch, each of these is 3-12
small kernels (casts to float32 and back, the halves of the rotation, concatenation); on a GPU a decode
step is then bound by the count of kernels rather than by bytes (measured on an H200: ~1000 kernels and
3.4 ms for a Qwen3-0.6B-shaped batch-1 decode graph whose weights take 0.32 ms to read; 1.5 ms with these
kernels). One kernel each here, with the torch paths' rounding (float32 inside, the model's dtype where
torch rounds).

Call sites check applies(t), then call the op from kvserve.kernels.cuda.elementwise, imported only then:
a CPU install never imports triton. On the CPU the tests run the same kernels under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def triton_installed() -> bool:
    """Looked up once: applies() is asked several times a layer."""
    return importlib.util.find_spec("triton") is not None


def applies(t: torch.Tensor) -> bool:
    """Whether the GPU kernels take this tensor: on CUDA, a float dtype, and triton installed."""
    return t.is_cuda and t.dtype in _DTYPES and triton_installed()


@functools.cache
def ops():
    """The kernels' module (kvserve.kernels.cuda.elementwise), imported on first use."""
    from kvserve.kernels.cuda import elementwise
    return elementwise
