"""Back the engine's weights with 2 MiB pages (Linux transparent huge pages).

Why: a CPU decode step streams every weight once (~94 MB for the default model), and with 4 KiB pages
that is ~23,000 TLB misses a step, each a page walk. torch's allocator leaves huge pages to the kernel's
default, which on most distributions is "madvise": never, unless asked. Asked after load, for the ranges
the weights occupy, decode of the default model ran 1.045x at one stream and 1.041x at 32 (7 and 6 of 8
process pairs faster; Zen 5, AVX-512; benchmarks/huge_pages.py), with no clear change under forced AVX2,
where the matmuls are compute-bound. The KV cache is left as it is: merged into huge pages as well it
showed no gain beside the weights' in a first comparison, and it cost up to a second of start-up per GiB
(the pages must be copied, or faulted in huge before the first write). oneDNN's packed copies of float
bfloat16 weights (quantization "none") are opaque and stay as oneDNN allocated them.

How: MADV_HUGEPAGE marks the ranges (later faults there take huge pages, and khugepaged may merge the
pages already there, slowly); MADV_COLLAPSE (Linux 6.1+) merges them now (~0.05 s for the default model).
Both are advice: where the kernel refuses (older kernels, THP "never", another OS), nothing changes and
nothing fails. The contents and the addresses stay as they are, so kernels and tensors holding these
buffers are not disturbed. KVSERVE_HUGE_PAGES=0 turns the advice off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
# Tensors this close together are advised as one range (a heap packs small weights side by side).
_MERGE_GAP = HUGE_PAGE


def _madvise():
    # KVSERVE_HUGE_PAGES=0: leave pages to the kernel's default (to compare: benchmarks/huge_pages.py).
    if not sys.platform.startswith("linux") or os.environ.get("KVSERVE_HUGE_PAGES", "1") == "0":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def tensors_in(obj: object, depth: int = 4) -> list[torch.Tensor]:
    """The CPU tensors an object holds: a module's parameters, buffers and plain tensor attributes (a
    quantized layer's blocks), and those in lists, tuples, dicts and dataclasses under it."""
    found: dict[int, torch.Tensor] = {}

    def walk(x: object, d: int) -> None:
        if isinstance(x, torch.Tensor):
            # Strided CPU tensors only: oneDNN's packed weights (bfloat16 Linear) are opaque, no storage.
            if x.device.type == "cpu" and x.layout == torch.strided and x.numel():
                found.setdefault(x.data_ptr(), x)
        elif d <= 0:
            return
        elif isinstance(x, torch.nn.Module):
            for m in x.modules():
                for k, v in vars(m).items():
                    if k != "_modules":  # modules() visits them
                        walk(v, d - 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name), d - 1)

    walk(obj, depth)
    return list(found.values())


def ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The whole huge pages inside the memory the tensors' storages span, nearby spans merged."""
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                   for t in tensors)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + _MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = []
    for lo, hi in merged:
        first, last = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if last > first:
            out.append((first, last))
    return out


def back_with_huge_pages(*holders: object) -> int:
    """Advise huge pages for the tensors the holders hold and merge the pages already there (see the
    module doc); returns the bytes merged (0 where the kernel only took the advice, or refused it)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    tensors = [t for h in holders for t in tensors_in(h)]
    merged = 0
    for lo, hi in ranges(tensors):
        madvise(lo, hi - lo, _MADV_HUGEPAGE)
        if madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            merged += hi - lo
    logger.debug("huge pages: %d MiB merged", merged >> 20)
    return merged
