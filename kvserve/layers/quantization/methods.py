"""How a linear layer stores its weight and multiplies by it: one method per weight format.

A method turns each loaded checkpoint shard into its stored form (`convert`), joins a layer's shards once
all are in (`finalize`), and computes x @ W^T (`apply`). Linear layers (kvserve/layers/linear.py) own the
shapes and the loading; methods never see checkpoint names.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import QUANTIZATIONS
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.blocks import BlockWeight, cat_rows, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)


class RawTensor(Protocol):
    """A checkpoint tensor not yet in memory as floats (a GGUF tensor in its file's block format)."""
    shape: tuple[int, ...]

    def to_float(self) -> torch.Tensor: ...

    def to_blocks(self) -> BlockWeight: ...

    @property
    def quantized(self) -> bool: ...


Loaded = torch.Tensor | RawTensor


def as_float(t: Loaded) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.to_float()


class LinearMethod(Protocol):
    def convert(self, tensor: Loaded) -> object: ...

    def finalize(self, layer: nn.Module, shards: list) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor: ...


class FloatMethod:
    """Weights in the compute dtype.

    On a CPU with kvserve's kernels, x @ W^T is dense_linear (kvserve/kernels/cpu/dense_linear.cpp), which
    rounds every row alike whatever else the step carries, as the quantized kernels do: speculative decoding
    and batching then give the bits of decoding alone. torch's matmuls choose their blocking by shape, so a
    row's logprobs moved by ~1e-5 in float32 (more in bfloat16) with the rows beside it. Against torch's calls
    (benchmarks/results/dense_linear_avx512.md, dense_linear_forced_avx2.md): faster for decode and
    verification steps in both dtypes and for bfloat16 prompts (several times on AVX2, where torch emulates
    bfloat16), but float32 prompt chunks of hundreds of rows ran ~0.8x. Those stay on the kernel all the same:
    a step's rows depend on what else it carries, so a row taken by torch in one engine and by the kernel in
    another (speculating, or batched otherwise) would round differently (tried: routing float32 steps of 64+
    rows to torch moved the speculation tests' logprobs through the fp8 KV calibration's prefill).
    Elsewhere, bf16 on CPU is re-laid once for oneDNN: torch's dense bf16 F.linear re-packs the weight inside
    every call, and packing at load measured 1.1-2x faster per GEMM on an AVX-512 machine
    (benchmarks/results/linear_packing.md).

    On a CPU with AMX-BF16 (cpu_kernels.amx()), bf16 weights whose shape fits AMX's tiles (out_features % 16,
    in_features % 32) are instead re-laid once for dense_linear_amx.cpp, which computes every row alike too,
    and the unpacked copy is dropped (a tied embedding reads its rows from the packed one)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        use_kernel = device.type == "cpu" and kernel_available(dtype)
        self.kernel = cpu_kernels.ops().dense_linear if use_kernel else None  # None: torch's matmuls
        self.amx = use_kernel and dtype == torch.bfloat16 and cpu_kernels.amx()

    @property
    def use_kernel(self) -> bool:
        return self.kernel is not None

    def convert(self, tensor: Loaded) -> torch.Tensor:
        return as_float(tensor).to(self.dtype)

    def finalize(self, layer: nn.Module, shards: list[torch.Tensor]) -> None:
        weight = torch.cat(shards) if len(shards) > 1 else shards[0]
        layer.weight = nn.Parameter(weight.to(self.device).contiguous(), requires_grad=False)
        layer.packed_weight = None
        layer.register_buffer("amx_weight", None, persistent=False)

    def pack(self, layer: nn.Module) -> None:
        """After tying (an LM head shares the embedding's unpacked weight), pack for AMX or oneDNN where it pays.
        Once: a layer packed already (load_named_weights packs) is left as it is."""
        if layer.amx_weight is not None or layer.packed_weight is not None:
            return
        w = layer.weight
        if self.amx and w.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
            layer.amx_weight = amx_pack(w.detach())
            layer.weight = None  # the packed copy is the only one (embedding() reads its rows there)
        elif not self.use_kernel and can_pack(w):
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            if not hasattr(layer, "embed"):  # an embedding reads its rows from the plain weight; nothing else does
                layer.weight = None  # both kept, a bf16 model had taken twice its weights' memory

    def apply(self, layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if layer.amx_weight is not None:  # bf16 in: a float32 caller's activations are rounded first
            return cpu_kernels.ops().dense_linear_amx(x.to(torch.bfloat16), layer.amx_weight, out_dtype)
        if self.kernel is not None:
            return self.kernel(x, layer.weight, out_dtype)  # float32 sums, rounded once to out_dtype
        if layer.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        else:
            y = F.linear(x, layer.weight)
        return y if out_dtype is None else y.to(out_dtype)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.amx_weight is not None:
            return amx_rows(layer.amx_weight, ids)
        return F.embedding(ids, layer.weight)


def amx_pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> dense_linear_amx.cpp's layout [N/16, K/32, 16, 16, 2]: per 16 rows and 32 columns an AMX B
    tile, whose row i holds each of the 16 rows' values at columns 2i and 2i + 1."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def amx_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of the weight amx_pack packed (an embedding lookup): [*ids.shape, K]."""
    rows = packed[ids // 16, :, :, ids % 16, :]  # the indexed dims first: [*ids.shape, K/32, 16, 2]
    return rows.reshape(*ids.shape, -1)


def weight_formats(model: nn.Module) -> str:
    """The formats model's linear layers hold their weights in, as a benchmark states them: e.g. "gguf q4 +
    gguf q8" for the default model (its projections' Q4_1 blocks, its LM head's Q8_0), "int4 q4 + int8 q8",
    or "float bfloat16"."""
    found = set()
    for m in model.modules():
        method = getattr(m, "method", None)
        if isinstance(method, BlockMethod):
            found.update(f"{method.source} {seg.layout}" for seg in getattr(m, "segments", ()))
        elif isinstance(method, FloatMethod):
            found.add(f"float {str(method.dtype).removeprefix('torch.')}")
    return " + ".join(sorted(found)) or "none"


def rounds_by_step_shape(model: nn.Module) -> bool:
    """Whether some linear layer of model multiplies with torch's matmuls (float or block weights without
    kvserve's kernels: on a GPU, or under KVSERVE_CPU_ISA=none), whose rounding of a row depends on how many
    rows its step has (the BLAS picks its kernel and blocking by shape). kvserve's CPU kernels, quantized and
    dense, compute every row alike, whatever else is in the step."""
    methods = (getattr(m, "method", None) for m in model.modules())
    return any(isinstance(x, (FloatMethod, BlockMethod)) and not x.use_kernel for x in methods)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class BlockMethod:
    """Block-quantized weights (kvserve/layers/quantization/blocks.py) multiplied by the quant_linear kernel.

    source: "gguf" keeps a GGUF file's blocks as they are; "int8" / "int4" quantize float weights at load.
    Fused shards of different layouts (a GGUF Q4_K_M file mixes Q4_K and Q6_K within a layer) stay
    separate segments, one kernel call each."""
    source: str
    dtype: torch.dtype                # activations in and out
    group_size: int = 32              # int4 only
    # Without kvserve's kernel (another CPU, KVSERVE_CPU_ISA=none) each call dequantizes: correct, slow.
    use_kernel: bool = True

    def convert(self, tensor: Loaded) -> BlockWeight:
        if self.source == "gguf" and not isinstance(tensor, torch.Tensor) and tensor.quantized:
            return tensor.to_blocks()
        w = as_float(tensor)
        return quantize_int4(w, self.group_size) if self.source == "int4" else quantize_int8(w)

    def finalize(self, layer: nn.Module, shards: list[BlockWeight]) -> None:
        segments: list[BlockWeight] = []
        for s in shards:  # adjacent shards of one layout are stacked into one segment
            if segments and _stackable(segments[-1], s):
                segments[-1] = cat_rows([segments[-1], s])
            else:
                segments.append(s)
        if self.use_kernel:  # re-laid in a tiled kernel's order where the shape allows
            segments = [_tiled(s) for s in segments]
        layer.segments = segments
        for i, seg in enumerate(segments):  # registered so memory accounting and .to() see them
            layer.register_buffer(f"qweight{i}", seg.qs, persistent=False)
            layer.register_buffer(f"qscales{i}", seg.scales, persistent=False)
            if seg.mins is not None:
                layer.register_buffer(f"qmins{i}", seg.mins, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # kvserve's kernel at every row count: torch's packed kernels (aten._weight_int4pack_mm_for_cpu,
        # _weight_int8pack_mm) ran 11-160x slower on AVX2 and AVX-512, and dequantize + F.linear lost up to
        # 256 rows (benchmarks/results/torch_packed_avx2.md, torch_packed_avx512.md). The kernel's sums are
        # float32: out_dtype float32 (logits) keeps them so.
        if not self.use_kernel:
            y = torch.cat([F.linear(x, s.dequantize(dtype=x.dtype)) for s in layer.segments], dim=-1)
            return y if out_dtype is None else y.to(out_dtype)
        ops = cpu_kernels.ops()
        if len(layer.segments) == 1:
            return _matmul(ops, x, layer.segments[0], out_dtype)
        return torch.cat([_matmul(ops, x, s, out_dtype) for s in layer.segments], dim=-1)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        (seg,) = layer.segments
        if seg.interleaved and self.use_kernel:  # one native call: the Python row gather cost ~0.1 ms a step
            embed = cpu_kernels.ops().quant_embedding_x16 if seg.tile == 16 else cpu_kernels.ops().quant_embedding_x8
            rows = embed(ids.flatten(), seg.qs, seg.scales, seg.mins, self.dtype)
        else:
            rows = seg.dequantize(ids.flatten(), self.dtype)
        return rows.view(*ids.shape, -1)


def _matmul(ops: torch._ops._OpNamespace, x: torch.Tensor, w: BlockWeight,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if w.tile == 16:
        return ops.quant_linear_x16(x, w.qs, w.scales, w.mins, out_dtype)
    if w.tile == 8:
        return ops.quant_linear_x8(x, w.qs, w.scales, w.mins, out_dtype)
    return ops.quant_linear(x, w.qs, w.scales, w.mins, w.group, out_dtype)


def _tiled(w: BlockWeight) -> BlockWeight:
    """w in 16-row tiles where its shape allows, else in 8-row tiles, else as it is. The 16-row kernel
    (quant_linear_x16.cpp) needs no horizontal adds: against the 8-row one, on AVX2, q4 ran 1.01-1.09x as
    fast at one or two activation rows and 1.04-1.27x from three up, q8 0.87-1.05x up to three and
    1.05-1.24x from four (benchmarks/results/tile_layouts_avx2.md, two runs); 1.2-2x with AVX-512 VNNI
    (quantization_avx512.md)."""
    for tile in (16, 8):
        if w.can_interleave(tile):
            return w.interleave(tile)
    return w


def _stackable(a: BlockWeight, b: BlockWeight) -> bool:
    return a.layout == b.layout and a.group == b.group


@dataclass
class QuantConfig:
    """Which method each linear layer gets.

    quantization: "auto" keeps a GGUF file's quantized tensors as they are and float weights as floats;
    "none" dequantizes everything to the compute dtype; "int8" / "int4" quantize every linear layer at
    load (weight-only). Embedding and LM head: kept as the file has them under auto; int8 under int8 and
    int4 (the output layer is the most sensitive to 4 bits, so it keeps 8, as llama.cpp's 4-bit mixes do)."""
    quantization: str = "auto"
    group_size: int = 32
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Checkpoint tensor name -> whether the file stores it quantized (GGUF); empty for float checkpoints.
    quantized_tensors: dict[str, bool] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set, repr=False)  # one log line per model, not per layer

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {'|'.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization in ("int8", "int4") and self.device.type != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU only for now")

    def _warn_once(self, msg: str, *args: object) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning(msg, *args)

    def method(self, tensor_names: list[str], output_layer: bool = False) -> LinearMethod:
        """The method for a layer loaded from these checkpoint tensors (its shards)."""
        q = self.quantization
        if q == "none":
            return FloatMethod(self.dtype, self.device)
        kernel = self.device.type == "cpu" and kernel_available(self.dtype)
        if q == "auto":
            if all(self.quantized_tensors.get(n, False) for n in tensor_names):
                if kernel:
                    return BlockMethod("gguf", self.dtype)
                self._warn_once("GGUF weights are dequantized to %s: kvserve's quantized kernel does not run on this "
                           "CPU/dtype", self.dtype)
            return FloatMethod(self.dtype, self.device)
        if not kernel:
            self._warn_once("--quantization %s without kvserve's quantized kernel on this CPU/dtype: weights stay "
                       "quantized but each matmul dequantizes them (slow)", q)
        return BlockMethod("int8" if output_layer else q, self.dtype, self.group_size, use_kernel=kernel)


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether kvserve's CPU kernels can multiply this dtype's activations: block weights in place
    (kvserve/kernels/cpu/quant_linear.cpp) and float weights as loaded (dense_linear.cpp)."""
    return dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
