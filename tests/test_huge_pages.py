"""Huge pages behind the weights (kvserve/utils/huge_pages.py): the ranges advised, that the kernel really
backs them with huge pages where it can (read back from /proc/self/smaps), that contents stay, that
KVSERVE_HUGE_PAGES=0 leaves memory alone, and that the engine finds every weight its kernels read."""
from __future__ import annotations

import sys

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.utils.huge_pages import HUGE_PAGE, back_with_huge_pages, ranges, tensors_in

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def huge_kib_in(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings that overlap [lo, hi), from /proc/self/smaps (a mapping counts whole)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def thp_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class Span:
    """Stands for a tensor's storage at an address (ranges() reads only where storages lie)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size = ptr, size

    def untyped_storage(self) -> Span:
        return self

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.size


def test_ranges_keep_whole_huge_pages_and_merge_neighbours():
    MiB = 1 << 20
    assert HUGE_PAGE == 2 * MiB
    # [1, 3) MiB and [4 MiB - 100, 6 MiB - 100): 1 MiB apart, one range, [1 MiB, 6 MiB - 100), whose whole
    # huge pages are [2, 4) MiB. [20 MiB + 5, 28 MiB + 5), far from them, alone: [22, 28) MiB.
    spans = [Span(MiB, 2 * MiB), Span(4 * MiB - 100, 2 * MiB), Span(20 * MiB + 5, 8 * MiB)]
    assert ranges(spans) == [(2 * MiB, 4 * MiB), (22 * MiB, 28 * MiB)]
    # Each alone holds no whole huge page.
    assert ranges([Span(MiB, 2 * MiB)]) == [] and ranges([Span(4 * MiB - 100, 2 * MiB)]) == []


def test_tensors_in_walks_modules_lists_and_dataclasses():
    import dataclasses

    @dataclasses.dataclass
    class Blocks:
        qs: torch.Tensor
        scales: torch.Tensor

    layer = torch.nn.Linear(4, 4)
    layer.segments = [Blocks(torch.ones(3), torch.ones(2))]
    model = torch.nn.Sequential(layer)
    caches = [(torch.zeros(5), torch.zeros(5))]
    if torch.backends.mkldnn.is_available():
        layer.packed_weight = layer.weight.detach().to_mkldnn()  # opaque, as a packed bfloat16 weight is
    found = {t.data_ptr() for t in tensors_in(model) + tensors_in(caches)}
    want = [layer.weight, layer.bias, layer.segments[0].qs, layer.segments[0].scales, *caches[0]]
    assert found == {t.data_ptr() for t in want}


@linux
def test_advice_puts_a_tensor_in_huge_pages_and_keeps_its_contents(monkeypatch):
    if not thp_possible():
        pytest.skip("transparent huge pages are off on this machine")
    x = torch.arange(8 * HUGE_PAGE // 4, dtype=torch.int32)  # 16 MiB, touched
    lo = x.data_ptr()
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    assert back_with_huge_pages(x) == 0
    monkeypatch.delenv("KVSERVE_HUGE_PAGES")
    merged = back_with_huge_pages(x)
    if merged == 0:
        pytest.skip("this kernel does not collapse on request (MADV_COLLAPSE needs Linux 6.1)")
    assert merged >= 7 * HUGE_PAGE  # the whole pages inside 16 MiB: 8, or 7 where it starts mid-page
    assert huge_kib_in(lo, lo + x.numel() * 4) * 1024 >= merged
    assert torch.equal(x, torch.arange(x.numel(), dtype=torch.int32))


@linux
def test_engine_weights_sit_in_huge_pages():
    llm = LLM(kv_cache_memory=64 << 20)
    runner = llm.engine.runner
    tensors = tensors_in(runner.model)
    found = {t.data_ptr() for t in tensors}
    stack = runner.model.native_stack
    weights = [w for w in (stack.weights if stack is not None else []) if w is not None]
    assert weights, "the default model runs its native decoder stack here"
    assert all(w.data_ptr() in found for w in weights)  # every projection's blocks, as the kernel reads them
    assert any(t.numel() >= 49152 * 576 // 2 for t in tensors)  # the LM head's blocks
    # Whether this kernel collapses on request, asked of a probe, not of the engine's memory.
    probe = torch.ones(4 * HUGE_PAGE // 4)
    if not thp_possible() or back_with_huge_pages(probe) == 0:
        pytest.skip("this kernel does not collapse on request (MADV_COLLAPSE needs Linux 6.1)")
    big = max(weights, key=lambda w: w.untyped_storage().nbytes())
    assert huge_kib_in(big.data_ptr(), big.data_ptr() + big.untyped_storage().nbytes()) > 0
    lm_head = max(tensors, key=lambda t: t.untyped_storage().nbytes())
    assert huge_kib_in(lm_head.data_ptr(), lm_head.data_ptr() + lm_head.untyped_storage().nbytes()) > 0
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].token_ids
