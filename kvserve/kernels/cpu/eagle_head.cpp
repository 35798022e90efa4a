// The eagle head's drafting step in one call, on the other kernels of this build: its logits (sampled
// drafts) or its argmax tokens (greedy drafts).
//
// Why: at one stream on two AVX2 cores a drafting step took ~0.85 ms in the engine, of which the head's
// matmuls were ~0.4 ms; the rest was Python and torch dispatch between a dozen small calls (fc, two norms,
// the MLP's three, the LM head, argmax, the vocabulary lookup). kvserve/spec_decode/eagle_head.py's
// EagleHead.step and greedy_tokens stay the reference and the path for what this does not cover.
//
// With e the next token's embedding: x = fc([feature; e]); h = rms_norm(x); x += down(silu(gate) * up)(h);
// token = vocab_ids[argmax(lm_head(rms_norm(x)))]. Weights in an interleaved quantized layout
// (quant_linear_x16.cpp or quant_linear_x8.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// weights, in this order; a q8 layer has no mins (None).
enum HeadWeight : int64_t {
  kFcQs, kFcScales, kFcMins, kMlpNorm, kGateUpQs, kGateUpScales, kGateUpMins,
  kDownQs, kDownScales, kDownMins, kNorm, kLmQs, kLmScales, kLmMins, kHeadWeights,
};

// feature, embedding [N, hidden] (the activations' dtype) -> (the predicted next features [N, hidden], the
// LM head's float32 logits over the head's vocabulary [N, V']): what a sampled draft is drawn from.
std::tuple<at::Tensor, at::Tensor> eagle_step(const at::Tensor& feature, const at::Tensor& embedding,
                                              const c10::List<std::optional<at::Tensor>>& weights, double eps) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kHeadWeights, "eagle_step: ", kHeadWeights, " weights");
  TORCH_CHECK(feature.dim() == 2 && embedding.sizes() == feature.sizes() &&
              embedding.scalar_type() == feature.scalar_type(),
              "eagle_step: feature and embedding [N, hidden] of one dtype");
  auto w = [&](HeadWeight i) -> at::Tensor {
    std::optional<at::Tensor> t = weights.get(i);
    TORCH_CHECK(t.has_value(), "eagle_step: lacks weight ", static_cast<int64_t>(i));
    return *t;
  };
  auto mins = [&](HeadWeight i) { return weights.get(i); };

  // fused_add_rms_norm_(x, r): r += x; x = rms_norm(r). From a zero residual: x = rms_norm(fc), r = fc.
  at::Tensor h = quant_linear_tiled(at::cat({feature, embedding}, 1), w(kFcQs), w(kFcScales), mins(kFcMins));
  at::Tensor x = at::zeros_like(h);
  fused_add_rms_norm_(h, x, w(kMlpNorm), eps);
  const at::Tensor gate_up = quant_linear_tiled(h, w(kGateUpQs), w(kGateUpScales), mins(kGateUpMins));
  at::Tensor normed = quant_linear_tiled(silu_and_mul(gate_up), w(kDownQs), w(kDownScales), mins(kDownMins));
  fused_add_rms_norm_(normed, x, w(kNorm), eps);  // x: the next feature; normed: what the LM head reads
  at::Tensor logits = quant_linear_tiled(normed, w(kLmQs), w(kLmScales), mins(kLmMins));
  if (logits.scalar_type() != at::kFloat) logits = logits.to(at::kFloat);  // exact from bfloat16
  return {x, logits};
}

// eagle_step, then each row's most likely token; vocab_ids [V'] int64: the LM head's rows as ids of the
// full vocabulary. -> (the predicted next features [N, hidden], the drafted tokens [N] int64).
std::tuple<at::Tensor, at::Tensor> eagle_greedy_step(const at::Tensor& feature, const at::Tensor& embedding,
                                                     const c10::List<std::optional<at::Tensor>>& weights,
                                                     const at::Tensor& vocab_ids, double eps) {
  auto [x, logits] = eagle_step(feature, embedding, weights, eps);
  return {x, vocab_ids.index_select(0, argmax_rows(logits))};
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
