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
// multiple of 8 but not 16) or float ones (dense_linear.cpp, or dense_linear_amx.cpp's tiles), and every
// attention row on the paged kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// The attention rows (row_token, row_seq, row_len, row_last as paged_attention_ takes them) whose token is wanted
// (wanted[token]), in their order.
static std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> wanted_rows(
    const std::vector<bool>& wanted, const at::Tensor& row_token, const at::Tensor& row_seq,
    const at::Tensor& row_len, const std::optional<at::Tensor>& row_last) {
  const int64_t R = row_token.size(0);
  const int64_t* tok = row_token.data_ptr<int64_t>();
  std::vector<int64_t> keep;
  for (int64_t r = 0; r < R; ++r)
    if (wanted[static_cast<size_t>(tok[r])]) keep.push_back(r);
  at::Tensor idx = at::empty({static_cast<int64_t>(keep.size())}, row_token.options());
  std::copy(keep.begin(), keep.end(), idx.data_ptr<int64_t>());
  std::optional<at::Tensor> last;
  if (row_last.has_value()) last = row_last->index_select(0, idx);
  return {row_token.index_select(0, idx), row_seq.index_select(0, idx), row_len.index_select(0, idx), last};
}

// weights: kWeightsPerLayer entries per layer, in the order below; a q8 layer has no mins (None), and a float
// layer neither scales nor mins: its Qs entry is the weight, as FloatMethod.apply multiplies it (any_linear).
constexpr int64_t kWeightsPerLayer = 14;
enum Weight : int64_t {
  kInputNorm, kQkvQs, kQkvScales, kQkvMins, kOQs, kOScales, kOMins,
  kPostNorm, kGateUpQs, kGateUpScales, kGateUpMins, kDownQs, kDownScales, kDownMins,
};

// x [T, hidden] (in place: the last layer's output), residual [T, hidden] (out: the residual stream before
// the last layer's MLP output is added), positions [T]; k_caches / v_caches: one per layer, head-major
// ([Hkv, NB, bs, D]); the rest as paged_attention_ and cache_kv_ take them, per layer where a list.
// out_rows [K] (ascending token indices): only those rows' outputs are wanted; they are x's and residual's
// first K rows then, and the rest of both is left undefined.
void decoder_stack_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& positions,
                    const c10::List<std::optional<at::Tensor>>& weights, at::TensorList k_caches,
                    at::TensorList v_caches, const at::Tensor& cos_sin, const at::Tensor& slots,
                    const at::Tensor& row_token, const at::Tensor& row_seq, const at::Tensor& row_len,
                    const at::Tensor& block_tables, int64_t num_heads, double eps, double scale,
                    at::IntArrayRef windows, at::ArrayRef<double> k_scales, at::ArrayRef<double> v_scales,
                    const std::optional<at::Tensor>& row_last, const std::optional<at::Tensor>& out_rows) {
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
  // The projection whose first entry is i (its Qs): quantized or float, see any_linear.
  auto linear = [&](const at::Tensor& in, int64_t layer, Weight i) {
    return any_linear(in, w(layer, i), weights.get(layer * kWeightsPerLayer + i + 1),
                   weights.get(layer * kWeightsPerLayer + i + 2));
  };

  // out_rows: only these rows' outputs are wanted (the rows a step samples). Every layer's K and V are still
  // needed for every row, but the last layer's attention, o projection and MLP only for the wanted rows.
  const int64_t K = out_rows.has_value() ? out_rows->size(0) : T;
  std::vector<bool> wanted;  // per token: in out_rows
  if (out_rows.has_value()) {
    TORCH_CHECK(out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong && out_rows->is_contiguous(),
                "decoder_stack_: out_rows [K] int64");
    wanted.assign(static_cast<size_t>(T), false);
    const int64_t* o = out_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < K; ++i) {
      TORCH_CHECK(o[i] >= 0 && o[i] < T && (i == 0 || o[i] > o[i - 1]),
                  "decoder_stack_: out_rows must be ascending token indices in [0, ", T, ")");
      wanted[static_cast<size_t>(o[i])] = true;
    }
  }

  at::Tensor h = x;  // the running layer output; x's storage is written back at the end
  residual.zero_();
  at::Tensor res = residual;  // the residual stream of the rows still computed (all but in a trimmed last layer)
  for (int64_t l = 0; l < L; ++l) {
    fused_add_rms_norm_(h, residual, w(l, kInputNorm), eps);
    const at::Tensor qkv = linear(h, l, kQkvQs);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_stack_: layer ", l, " qkv width ", qkv.size(1),
                " does not match ", num_heads, " + 2 x ", Hkv, " heads of ", D);
    // q's and k's heads sit side by side in the fused projection: one rotation pass over both.
    rotary_(qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + Hkv, D}), positions, cos_sin);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
    cache_kv_(k, v, k_caches[l], v_caches[l], slots, k_scales[l], v_scales[l]);
    at::Tensor attn = at::empty({T, num_heads, D}, h.options());
    if (l < L - 1 || !out_rows.has_value()) {
      paged_attention_(q, attn, k_caches[l], v_caches[l], row_token, row_seq, row_len, block_tables, scale,
                       windows[l], k_scales[l], v_scales[l], row_last);
    } else {
      if (K == 0) break;  // a prompt chunk that samples nothing: its K/V were all it had to leave
      const auto [tok, seq, len, last] = wanted_rows(wanted, row_token, row_seq, row_len, row_last);
      paged_attention_(q, attn, k_caches[l], v_caches[l], tok, seq, len, block_tables, scale, windows[l],
                       k_scales[l], v_scales[l], last);
      attn = attn.index_select(0, *out_rows);  // each row computed as it would be among all of them
      res = residual.index_select(0, *out_rows);
    }
    h = linear(attn.view({attn.size(0), q_size}), l, kOQs);
    fused_add_rms_norm_(h, res, w(l, kPostNorm), eps);
    const at::Tensor gate_up = linear(h, l, kGateUpQs);
    h = linear(silu_and_mul(gate_up), l, kDownQs);
  }
  if (K == 0) return;
  x.narrow(0, 0, h.size(0)).copy_(h);
  if (!res.is_same(residual)) residual.narrow(0, 0, K).copy_(res);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
