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
// (quant_linear_x16.cpp or quant_linear_x8.cpp), or float ones (a head loaded unquantized): ops.h's any_linear.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// weights, in this order; a q8 layer has no mins (None), a float one neither scales nor mins (any_linear).
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
  auto linear = [&](const at::Tensor& x, HeadWeight i) {  // i: the layer's first entry, its weight
    return any_linear(x, w(i), weights.get(i + 1), weights.get(i + 2));
  };

  // fused_add_rms_norm_(x, r): r += x; x = rms_norm(r). From a zero residual: x = rms_norm(fc), r = fc.
  at::Tensor h = linear(at::cat({feature, embedding}, 1), kFcQs);
  at::Tensor x = at::zeros_like(h);
  fused_add_rms_norm_(h, x, w(kMlpNorm), eps);
  const at::Tensor gate_up = linear(h, kGateUpQs);
  at::Tensor normed = linear(silu_and_mul(gate_up), kDownQs);
  fused_add_rms_norm_(normed, x, w(kNorm), eps);  // x: the next feature; normed: what the LM head reads
  at::Tensor logits = linear(normed, kLmQs);
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

// One row's k likeliest of V logits (ties to the lower index, as argmax_rows), likeliest first, as ids of the
// full vocabulary (vocab_ids[v]) with their probabilities under a softmax over the V logits.
static void top_k_of_row(const float* l, int64_t V, const int64_t* vocab_ids, int64_t k, int64_t* ids, float* probs) {
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
    ids[j] = vocab_ids[where[j]];
    probs[j] = std::exp(best[j] - best[0]) / total;
  }
}

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
  for (int64_t n = 0; n < N; ++n) {
    top_k_of_row(logits.data_ptr<float>() + n * V, V, vocab_ids.data_ptr<int64_t>(), k,
                 ids.data_ptr<int64_t>() + n * k, probs.data_ptr<float>() + n * k);
  }
  return {x, ids, probs};
}

// A greedy request's token tree, every drafting step in this one call (kvserve/spec_decode/eagle_proposer.py's
// draft_trees, which loops over eagle_top_step in Python where this does not apply): per row, the head's k
// likeliest tokens at the first step, then its first choice at each next step while the chain is shorter than
// depths[n] and its gain stays at least min_gain. The gain of a chain (kvserve/spec_decode/confidence.py's
// chain_gains) is the product over its tokens of rates[kind * B + bucket], kind 0 for the first token and 1 for
// the others, bucket min(floor(p * B), B - 1) of the head's probability p for it, B = len(rates) / 2: the same
// double arithmetic as Python's, so the same chains. Rows are computed apart (each row's bits do not depend on
// the others'), so dropping a finished row changes no other row's tokens.
//
// Why: at one stream of chat a tree's drafting took ~0.3 ms of a ~3.6 ms step, of which the head's native
// steps were ~0.18; the rest was the Python loop between them and each step's embedding and conversions. Timed
// in the engine against that loop (AVX-512 Xeon, the calls alternating which went first): a chain of one token
// 234 -> 224 us a call, of two 366 -> 304, of three 492 -> 387.
//
// tokens [N] int64: each row's last token; embed_qs, embed_scales, embed_mins: the target's token embedding
// in any of any_embedding's formats (ops.h). -> (ids [N, k + D - 1] int64, probs [N, k + D - 1] float32,
// lengths [N] int64), D = max(depths): columns 0..k-1 the first step's choices (the chain's first token, then
// its alternatives), columns k..k + lengths[n] - 2 the chain's later tokens; -1 and 0 past a row's chain.
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_draft_chains(
    const at::Tensor& feature, const at::Tensor& tokens, const c10::List<std::optional<at::Tensor>>& weights,
    const at::Tensor& vocab_ids, const at::Tensor& embed_qs, const std::optional<at::Tensor>& embed_scales,
    const std::optional<at::Tensor>& embed_mins, int64_t k, at::IntArrayRef depths, at::ArrayRef<double> rates,
    double min_gain, double eps) {
  const int64_t N = feature.size(0);
  const int64_t B = static_cast<int64_t>(rates.size()) / 2;
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.size(0) == N,
              "eagle_draft_chains: tokens [N] int64");
  TORCH_CHECK(static_cast<int64_t>(depths.size()) == N, "eagle_draft_chains: one depth per row");
  TORCH_CHECK(B >= 1 && static_cast<int64_t>(rates.size()) == 2 * B, "eagle_draft_chains: rates [2 * buckets]");
  int64_t D = 1;
  for (const int64_t d : depths) {
    TORCH_CHECK(d >= 1, "eagle_draft_chains: depths must be at least 1");
    D = std::max(D, d);
  }
  const int64_t V = vocab_ids.numel();
  TORCH_CHECK(k >= 1 && k <= V && k <= kMaxTop, "eagle_draft_chains: k must be in [1, min(", V, ", ", kMaxTop, ")]");
  TORCH_CHECK(vocab_ids.scalar_type() == at::kLong && vocab_ids.is_contiguous(),
              "eagle_draft_chains: vocab_ids [V'] int64");
  const int64_t W = k + D - 1;
  at::Tensor ids = at::full({N, W}, -1, vocab_ids.options());
  at::Tensor probs = at::zeros({N, W}, feature.options().dtype(at::kFloat));
  at::Tensor lengths = at::ones({N}, tokens.options());
  if (N == 0) return {ids, probs, lengths};
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* vp = vocab_ids.data_ptr<int64_t>();
  auto rate = [&](int64_t kind, float p) {  // p in [0, 1]; a NaN (Python's int() would raise) takes bucket 0
    const double at = static_cast<double>(p) * static_cast<double>(B);
    return rates[kind * B + (at >= 0.0 ? std::min(static_cast<int64_t>(at), B - 1) : 0)];
  };
  auto embed = [&](const at::Tensor& t) {
    return any_embedding(t, embed_qs, embed_scales, embed_mins, feature.scalar_type());
  };

  auto [x, logits] = eagle_step(feature.contiguous(), embed(tokens), weights, eps);
  logits = logits.contiguous();
  TORCH_CHECK(logits.size(1) == V, "eagle_draft_chains: vocab_ids [V'], one per logit");
  std::vector<double> gain(N);
  std::vector<int64_t> rows;  // the rows still drafting, in x's order
  for (int64_t n = 0; n < N; ++n) {
    top_k_of_row(logits.data_ptr<float>() + n * V, V, vp, k, ip + n * W, pp + n * W);
    gain[n] = rate(0, pp[n * W]);
    if (depths[n] > 1 && gain[n] >= min_gain) rows.push_back(n);
  }
  std::vector<int64_t> picked(N);  // rows' positions in x
  for (int64_t n = 0; n < N; ++n) picked[n] = n;
  while (!rows.empty()) {
    const int64_t R = static_cast<int64_t>(rows.size());
    at::Tensor where = at::empty({R}, tokens.options());
    at::Tensor next = at::empty({R}, tokens.options());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = rows[r], len = lp[n];
      where.data_ptr<int64_t>()[r] = picked[n];
      next.data_ptr<int64_t>()[r] = ip[n * W + (len == 1 ? 0 : k + len - 2)];
      picked[n] = r;
    }
    std::tie(x, logits) = eagle_step(R == x.size(0) ? x : x.index_select(0, where), embed(next), weights, eps);
    logits = logits.contiguous();
    std::vector<int64_t> going;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = rows[r], at = n * W + k + lp[n] - 1;
      top_k_of_row(logits.data_ptr<float>() + r * V, V, vp, 1, ip + at, pp + at);
      gain[n] *= rate(1, pp[at]);
      lp[n] += 1;
      if (lp[n] < depths[n] && gain[n] >= min_gain) going.push_back(n);
    }
    rows.swap(going);
  }
  return {ids, probs, lengths};
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
