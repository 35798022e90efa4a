// A whole stack of Llama-family decoder layers in one call, on the other kernels of this build.
//
// Why: at batch 1 the kernels of a SmolLM2 step (quantized matmuls, attention) took ~6 ms of a ~14 ms
// step on two AVX2 cores; the rest was Python and torch dispatch between ~300 kernel calls a step (module
// calls, views, splits, empties; benchmarks/results/step_profile.txt). Called from C++, the same kernels
// run back to back: the layer's Python code stays the reference and the path for everything this does
// not cover (kvserve/models/native_stack.py decides, per step).
//
// Per layer, with x the previous layer's output not yet added to the residual stream (layer 0: the
// embedding, with a zero residual):
//   x, residual = add_rms_norm(x, residual); qkv = x W_qkv; rotary(q, k); cache k, v; a = attention(q)
//   x = a W_o; x, residual = add_rms_norm(x, residual); x = down(silu(gate) * up)
// which is what kvserve/models/llama.py's DecoderLayer does for a model without q/k norms or biases,
// weights in an interleaved quantized layout (quant_linear_x16.cpp, or quant_linear_x8.cpp where N is a
// multiple of 8 but not 16), and every attention row on the paged kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// weights: kWeightsPerLayer entries per layer, in the order below; a q8 layer has no mins (None).
constexpr int64_t kWeightsPerLayer = 14;
enum Weight : int64_t {
  kInputNorm, kQkvQs, kQkvScales, kQkvMins, kOQs, kOScales, kOMins,
  kPostNorm, kGateUpQs, kGateUpScales, kGateUpMins, kDownQs, kDownScales, kDownMins,
};

// x [T, hidden] (in place: the last layer's output), residual [T, hidden] (out: the residual stream before
// the last layer's MLP output is added), positions [T]; k_caches / v_caches: one per layer, head-major
// ([Hkv, NB, bs, D]); the rest as paged_attention_ and cache_kv_ take them, per layer where a list.
void decoder_stack_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& positions,
                    const c10::List<std::optional<at::Tensor>>& weights, at::TensorList k_caches,
                    at::TensorList v_caches, const at::Tensor& cos_sin, const at::Tensor& slots,
                    const at::Tensor& row_token, const at::Tensor& row_seq, const at::Tensor& row_len,
                    const at::Tensor& block_tables, int64_t num_heads, double eps, double scale,
                    at::IntArrayRef windows, at::ArrayRef<double> k_scales, at::ArrayRef<double> v_scales,
                    const std::optional<at::Tensor>& row_last) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * kWeightsPerLayer &&
              static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(windows.size()) == L &&
              static_cast<int64_t>(k_scales.size()) == L && static_cast<int64_t>(v_scales.size()) == L,
              "decoder_stack_: ", kWeightsPerLayer, " weights, two caches, a window and two scales per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() && residual.is_contiguous(),
              "decoder_stack_: x and residual [T, hidden], contiguous");
  const int64_t T = x.size(0), Hkv = k_caches[0].size(0), D = k_caches[0].size(3);
  const int64_t q_size = num_heads * D, kv_size = Hkv * D;
  auto w = [&](int64_t layer, Weight i) -> at::Tensor {
    std::optional<at::Tensor> t = weights.get(layer * kWeightsPerLayer + i);
    TORCH_CHECK(t.has_value(), "decoder_stack_: layer ", layer, " lacks weight ", static_cast<int64_t>(i));
    return *t;
  };
  auto mins = [&](int64_t layer, Weight i) { return weights.get(layer * kWeightsPerLayer + i); };

  at::Tensor h = x;  // the running layer output; x's storage is written back at the end
  residual.zero_();
  for (int64_t l = 0; l < L; ++l) {
    fused_add_rms_norm_(h, residual, w(l, kInputNorm), eps);
    const at::Tensor qkv = quant_linear_tiled(h, w(l, kQkvQs), w(l, kQkvScales), mins(l, kQkvMins));
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_stack_: layer ", l, " qkv width ", qkv.size(1),
                " does not match ", num_heads, " + 2 x ", Hkv, " heads of ", D);
    // q's and k's heads sit side by side in the fused projection: one rotation pass over both.
    rotary_(qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + Hkv, D}), positions, cos_sin);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
    cache_kv_(k, v, k_caches[l], v_caches[l], slots, k_scales[l], v_scales[l]);
    const at::Tensor attn = at::empty({T, num_heads, D}, h.options());
    paged_attention_(q, attn, k_caches[l], v_caches[l], row_token, row_seq, row_len, block_tables, scale,
                     windows[l], k_scales[l], v_scales[l], row_last);
    h = quant_linear_tiled(attn.view({T, q_size}), w(l, kOQs), w(l, kOScales), mins(l, kOMins));
    fused_add_rms_norm_(h, residual, w(l, kPostNorm), eps);
    const at::Tensor gate_up = quant_linear_tiled(h, w(l, kGateUpQs), w(l, kGateUpScales), mins(l, kGateUpMins));
    h = quant_linear_tiled(silu_and_mul(gate_up), w(l, kDownQs), w(l, kDownScales), mins(l, kDownMins));
  }
  x.copy_(h);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
