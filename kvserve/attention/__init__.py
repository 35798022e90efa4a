"""Attention backends: the KV cache layout, a per-step metadata builder and the paged attention itself
(backend.py), chosen per model by selector.py. torch_backend.py: the native CPU kernels and the torch
reference path; triton/: Triton kernels for CUDA (tested on the CPU under TRITON_INTERPRET=1)."""
