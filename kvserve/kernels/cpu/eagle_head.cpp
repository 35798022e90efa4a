// The eagle head's drafting step in one call, on the other kernels of this build: its logits (sampled
// drafts), its argmax tokens (greedy drafts) or its likeliest tokens with their probabilities (greedy trees).
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
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "ops.h"
#include "vec.h"

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

constexpr int64_t kMaxTop = 16;

// eagle_step, then each row's k likeliest tokens, likeliest first (ties to the lower index, as argmax_rows),
// with their probabilities under a softmax over the head's vocabulary: what a greedy request's tree is
// drafted from and sized by (kvserve/spec_decode/confidence.py), in this call rather than three more torch
// ops from Python. -> (the predicted next features [N, hidden], the tokens [N, k] as ids of the full
// vocabulary, their probabilities [N, k] float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_top_step(const at::Tensor& feature, const at::Tensor& embedding,
                                                              const c10::List<std::optional<at::Tensor>>& weights,
                                                              const at::Tensor& vocab_ids, int64_t k, double eps) {
  auto [x, logits] = eagle_step(feature, embedding, weights, eps);
  logits = logits.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V && k <= kMaxTop, "eagle_top_step: k must be in [1, min(", V, ", ", kMaxTop, ")]");
  TORCH_CHECK(vocab_ids.scalar_type() == at::kLong && vocab_ids.is_contiguous() && vocab_ids.numel() == V,
              "eagle_top_step: vocab_ids [V'] int64, one per logit");
  at::Tensor ids = at::empty({N, k}, vocab_ids.options());
  at::Tensor probs = at::empty({N, k}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t* vp = vocab_ids.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* l = lp + n * V;
    float best[kMaxTop];
    int64_t where[kMaxTop];
    std::fill(best, best + k, -std::numeric_limits<float>::infinity());
    std::fill(where, where + k, int64_t{0});
    for (int64_t v = 0; v < V; ++v) {
      const float z = l[v];
      if (!(z > best[k - 1])) continue;
      int64_t j = k - 1;
      for (; j > 0 && z > best[j - 1]; --j) {
        best[j] = best[j - 1];
        where[j] = where[j - 1];
      }
      best[j] = z;
      where[j] = v;
    }
    const Vec16 top = broadcast(best[0]);
    Vec16 sum = zero();
    for (int64_t v = 0; v < V; v += 16) sum = sum + keep_first(exp_ps(load(l + v, V - v) - top), V - v);
    const float total = reduce_add(sum);
    for (int64_t j = 0; j < k; ++j) {
      ip[n * k + j] = vp[where[j]];
      pp[n * k + j] = std::exp(best[j] - best[0]) / total;
    }
  }
  return {x, ids, probs};
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
