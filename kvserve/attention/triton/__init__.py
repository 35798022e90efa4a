"""Triton kernels for paged attention and the KV-cache write, behind the attention-backend interface
(backend.py). Imported only when the Triton backend is chosen: on CUDA, or on the CPU under
TRITON_INTERPRET=1, which is how the tests check the kernels without a GPU."""
