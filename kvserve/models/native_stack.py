"""A Llama-family model's decoder layers in one native call (kvserve/kernels/cpu/decoder_stack.cpp).

Why: on two AVX2 cores a batch-1 SmolLM2 step spent about as long in Python and torch dispatch between
its ~300 kernel calls as in the kernels themselves (benchmarks/results/step_profile.txt). The op runs
the same kernels back to back from C++, so the layers' Python code (kvserve/models/llama.py) is the
reference and the path for everything the op does not cover:
- decided once, at load: CPU kernels built; no q/k norms, biases or per-layer windows that differ; every
  projection on the kernels: quantized in their interleaved layout (a GGUF file kept quantized, or
  --quantization int8/int4), or float weights (an HF model, or --quantization none) on dense_linear or
  AMX tiles, as FloatMethod multiplies them; SiLU MLPs;
- decided per step: every attention row of the step on the paged kernel (long prefills go to SDPA
  through the layers instead), activations float32 or bfloat16.
Float models gain as much: the default model unquantized decoded 1.4-1.6x as fast at one stream in the stack
(benchmarks/results/float_stack_*.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import FP8, AttentionMetadata, KVCache
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.linear import LinearBase
from kvserve.layers.quantization.methods import BlockMethod, FloatMethod

if TYPE_CHECKING:
    from kvserve.models.llama import LlamaForCausalLM


def native_weight(layer: LinearBase) -> list[torch.Tensor | None] | None:
    """A linear layer as the native ops that run a model's layers take it (kernels/cpu/ops.h's any_linear:
    decoder_stack_ here, the eagle head's steps), else None: (qs, scales, mins) of one interleaved block
    weight, or a float weight that FloatMethod multiplies on the CPU kernels (its AMX tiles, or the [N, K]
    matrix) and two Nones."""
    method = layer.method
    if not isinstance(method, (BlockMethod, FloatMethod)) or not method.use_kernel or layer.bias is not None:
        return None
    if isinstance(method, FloatMethod):
        return [layer.amx_weight if layer.amx_weight is not None else layer.weight, None, None]
    segments = getattr(layer, "segments", None)
    if segments is None or len(segments) != 1 or not segments[0].interleaved:
        return None
    (w,) = segments
    return [w.qs, w.scales, w.mins]


class NativeDecoderStack:
    def __init__(self, model: LlamaForCausalLM, weights: list[torch.Tensor | None]) -> None:
        first = model.layers[0].self_attn
        self.rotary = model.rotary  # its cos/sin table may be rebuilt (reset_table): read it per call
        self.weights = weights
        self.num_heads, self.scale = first.num_heads, first.attn.scale
        self.eps = model.layers[0].input_layernorm.eps
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        self.attn_layers = [layer.self_attn.attn for layer in model.layers]
        self.op = cpu_kernels.ops().decoder_stack_

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> NativeDecoderStack | None:
        """The stack for a loaded model, or None where the op does not cover it (see the module doc)."""
        cfg = model.config
        if cfg.qk_norm or cfg.attention_bias or not cpu_kernels.available():
            return None
        if not hasattr(cpu_kernels.ops(), "decoder_stack_") or model.rotary.cos_sin.device.type != "cpu":
            return None
        weights: list[torch.Tensor | None] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [native_weight(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in parts) or type(mlp.act) is not SiluAndMul:
                return None
            qkv, o, gate_up, down = parts
            weights += [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight, *gate_up, *down]
        return cls(model, weights)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[KVCache], out_rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual stream) as the layers return them, or None: run the layers.
        out_rows (ascending): those rows' only; the last layer then runs its attention, o projection and MLP
        for them alone (a prompt chunk samples one row, or none)."""
        plan = meta.backend.kernel_only_plan(meta)
        if plan is None or not cpu_kernels.applies(x) or x.dtype != self.weights[0].dtype:
            return None
        rows, batch = plan.kernel_rows, meta.batch
        x = x.contiguous()
        residual = torch.empty_like(x)
        fp8 = kv_caches[0][0].dtype == FP8  # scales belong to a float8 cache only
        k_scales = [a.k_scale if fp8 else 1.0 for a in self.attn_layers]
        v_scales = [a.v_scale if fp8 else 1.0 for a in self.attn_layers]
        self.op(x, residual, positions, self.weights, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
                self.rotary.cos_sin, batch.slot_mapping, rows.token, rows.seq, rows.len, batch.block_tables,
                self.num_heads, self.eps, self.scale, self.windows, k_scales, v_scales, rows.last, out_rows)
        if out_rows is not None:
            return x[:len(out_rows)], residual[:len(out_rows)]
        return x, residual
