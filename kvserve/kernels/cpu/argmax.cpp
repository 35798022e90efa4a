// The index of each row's largest value, as torch.argmax(x, -1) gives it: the first of equal maxima, and
// the first NaN where a row has one (torch counts NaN as the largest value).
//
// Why a kernel: greedy sampling takes the argmax of every row of logits each step, and torch's CPU argmax
// over a 49,152-token vocabulary took ~75 us a row on two AVX2 cores (~1% of a batch-1 decode step, 0.2 ms
// of a 5-row speculative verification). One pass of vector compares does it in a few microseconds (~8 us a
// row on the Xeon, call included; see argmax_row).
// AVX2 intrinsics only: the same code runs in the AVX-512 build.
//
// The sampler's other kernels (kvserve/sampling/sampler.py, logits_processors.py), each a few passes over a
// row (or over its own tokens) where torch made several ops with [N, V] temporaries, or a topk or sort of the
// whole vocabulary:
//   race_sample_rows  the draw: argmax_v p_v / E_v with p = softmax(x / T), E_v = -ln u_v (two passes);
//   top_p_mask_       top-p's cut, from the few likeliest values, bit for bit the sort's (top_p_threshold);
//   top_k_mask_       top-k's cut, from the values near the row's maximum (top_k_threshold);
//   min_p_mask_       min-p's cut, in two passes over the probabilities;
//   apply_penalties_  repetition, presence and frequency penalties, on each row's own prompt and output tokens.
// The sampler's call on the default model's logits, uniforms included, Intel Xeon AVX-512
// (benchmarks/results/sampling_avx512.md), torch's ops -> these, one row and 32: temperature alone 131 -> 89 us
// and 2.4 -> 1.5 ms; with top_p 0.9, 541 -> 164 us and 8.0 -> 2.8 ms; with top_k 50, 340 -> 154 us and
// 5.5 -> 4.1 ms; with min_p 0.05, 228 -> 152 us and 4.2 -> 2.7 ms; with a repetition penalty, 342 -> 193 us and
// 8.6 -> 2.9 ms. A decode step takes ~3 ms there, a step of 32 streams ~40 ms; whole engines decoded
// 1.05-1.07x faster at temperature 0.7, 1.17x with top_p 0.9 and 1.13-1.25x with a repetition penalty of 1.1,
// at 1 and 32 streams.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

int64_t argmax_row(const float* x, int64_t n) {
  // Eight lanes per chain, each keeping its largest value and where it first saw it (a strict > keeps the
  // first). Four chains take turns at eight values each: one chain's compare waits on its last blend, so a
  // single chain ran at that latency (~20 us a 49,152-value row on the Xeon, ~7 with four chains).
  constexpr int kChains = 4;
  __m256 best[kChains];
  __m256i where[kChains], at[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    where[c] = _mm256_setzero_si256();
    at[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
  }
  __m256 nan = _mm256_setzero_ps();
  auto take = [&](int c, int64_t i, __m256i step) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
    best[c] = _mm256_blendv_ps(best[c], v, gt);
    where[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where[c]), _mm256_castsi256_ps(at[c]), gt));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    at[c] = _mm256_add_epi32(at[c], step);
  };
  int64_t i = 0;
  const __m256i step_all = _mm256_set1_epi32(8 * kChains), step_one = _mm256_set1_epi32(8);
  for (; i + 8 * kChains <= n; i += 8 * kChains)
    for (int c = 0; c < kChains; ++c) take(c, i + 8 * c, step_all);
  // Chain 0 takes the remaining whole vectors (its lanes' indices are i + 0 .. i + 7 by now).
  for (; i + 8 <= n; i += 8) take(0, i, step_one);
  if (_mm256_movemask_ps(nan) != 0) {
    for (int64_t j = 0; j < i; ++j)
      if (std::isnan(x[j])) return j;
  }
  alignas(32) float lane_best[8 * kChains];
  alignas(32) int32_t lane_where[8 * kChains];
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(lane_best + 8 * c, best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_where + 8 * c), where[c]);
  }
  // Lanes that never beat -inf hold index 0, which is right where the whole row is -inf. Equal maxima in
  // different lanes: the smaller index wins, as torch's first.
  float m = lane_best[0];
  int64_t arg = lane_where[0];
  for (int l = 1; l < 8 * kChains; ++l)
    if (lane_best[l] > m || (lane_best[l] == m && lane_where[l] < arg)) { m = lane_best[l]; arg = lane_where[l]; }
  for (; i < n; ++i) {  // the tail: later indices, so only a larger value (or a NaN) wins
    if (std::isnan(x[i])) return i;
    if (x[i] > m) { m = x[i]; arg = i; }
  }
  return arg;
}

// One row's race: the first v with the largest exp(x_v s - m) / -ln(u_v), where m = max x s (p's
// normalisation is left out: it scales every score alike). Tokens at -inf (masked by a stage before) score 0,
// as does a u of 0 (infinite noise: that token just loses). A row with a NaN, or all -inf, gives 0, what
// argmax over softmax's NaNs gave.
int64_t race_row(const float* x, const float* u, int64_t n, float s) {
  using namespace kvserve_cpu;
  const int64_t top = argmax_row(x, n);
  if (std::isnan(x[top]) || x[top] == -std::numeric_limits<float>::infinity()) return 0;
  const Vec16 m = broadcast(x[top] * s), scale = broadcast(s), floor = broadcast(-87.f), inf = broadcast(INFINITY);
  const Vec16 tiny = broadcast(std::numeric_limits<float>::min()), none = zero();
  constexpr int64_t kChunk = 2048;  // scores of a chunk (8 KB), then its argmax
  alignas(64) float score[kChunk];
  float best = -1.f;
  int64_t arg = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    for (int64_t i = 0; i < len; i += 16) {
      const int64_t k = std::min<int64_t>(16, len - i);
      const Vec16 d = fmadd(load(x + c0 + i, k), scale, broadcast(0.f) - m);
      const Vec16 e = select_less(d, floor, none, exp_ps(d));
      const Vec16 uv = load(u + c0 + i, k);
      const Vec16 noise = select_less(uv, tiny, inf, none - log_ps(vmax(uv, tiny)));
      store(score + i, e / noise, k);
    }
    const int64_t j = argmax_row(score, len);
    if (score[j] > best) { best = score[j]; arg = c0 + j; }
  }
  return arg;
}

// Top-p's threshold for one row of probabilities, as apply_top_p (kvserve/sampling/logits_processors.py)
// computes it over the whole row sorted: with the values in descending order, the mass before token i is
// torch's cumsum (a running sum in double, each value rounded to float) minus its own value, in float; the
// kept tokens are those whose mass before is < top_p, and the threshold is the smallest kept value.
// Only the values that can matter are sorted: those of at least a cut (1/64, then 1/4096, 1/262144, then
// all), found by a pass that skips every 64 values whose largest is below it, once their mass passes top_p by
// more than the cut. Every value below them then has a mass before it of top_p or more (the 1e-6 covers float
// rounding), so counting among them counts what the whole row would. A model's rows close at the first cut.
// A row with a NaN gives NaN: nothing compares below it.
float top_p_threshold(const float* p, int64_t n, float top_p, std::vector<float>& vals) {
  using namespace kvserve_cpu;
  constexpr int64_t kBlock = 64;
  for (const float cut : {1.f / 64, 1.f / 4096, 1.f / 262144, 0.f}) {
    vals.clear();
    double mass = 0.0;
    Vec16 total = zero();
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = std::min(kBlock, n - b);
      Vec16 top = zero();
      for (int64_t i = 0; i < len; i += 16) {
        const Vec16 v = load(p + b + i, std::min<int64_t>(16, len - i));
        top = vmax(top, v);
        total = total + v;
      }
      if (cut > 0.f && reduce_max(top) < cut) continue;
      for (int64_t i = b; i < b + len; ++i)
        if (p[i] >= cut) { vals.push_back(p[i]); mass += p[i]; }
    }
    if (std::isnan(reduce_add(total))) return std::numeric_limits<float>::quiet_NaN();
    if (cut == 0.f || mass >= static_cast<double>(top_p) + cut + 1e-6) break;
  }
  std::sort(vals.begin(), vals.end(), std::greater<float>());
  double running = 0.0;
  int64_t keep = 0;
  for (const float v : vals) {
    running += v;
    if (static_cast<float>(running) - v < top_p) ++keep;
  }
  return vals[std::max<int64_t>(keep, 1) - 1];
}

// Top-k's threshold for one row of logits: its k-th largest value, counting equal values, as
// topk(k).values[k - 1] gives it. Only the values within a distance of the row's maximum are looked at (4, 16,
// 64, then all), in the blocks of 64 values whose largest is that close (each block's largest taken once, in
// one vector pass); where there are k or more, their k-th largest is the row's. A row with a NaN gives NaN:
// nothing compares below it.
float top_k_threshold(const float* x, int64_t n, int64_t k, std::vector<float>& vals, std::vector<float>& tops) {
  using namespace kvserve_cpu;
  constexpr int64_t kBlock = 64;
  const float top = x[argmax_row(x, n)];
  if (std::isnan(top)) return top;
  if (top == -std::numeric_limits<float>::infinity()) return top;  // every value is -inf: all of them stay
  tops.resize(static_cast<size_t>((n + kBlock - 1) / kBlock));
  for (int64_t b = 0; b < n; b += kBlock) {
    Vec16 m = broadcast(-std::numeric_limits<float>::infinity());
    for (int64_t i = b; i < std::min(n, b + kBlock); i += 16) m = max_first(m, load(x + i, n - i), n - i);
    tops[b / kBlock] = reduce_max(m);
  }
  for (const float width : {4.f, 16.f, 64.f, INFINITY}) {
    const float cut = top - width;  // the last, -inf, takes every value
    vals.clear();
    for (int64_t b = 0; b < n; b += kBlock) {
      if (tops[b / kBlock] < cut) continue;
      for (int64_t i = b; i < std::min(n, b + kBlock); ++i)
        if (x[i] >= cut) vals.push_back(x[i]);
    }
    if (static_cast<int64_t>(vals.size()) >= k) break;
  }
  std::nth_element(vals.begin(), vals.begin() + (k - 1), vals.end(), std::greater<float>());
  return vals[k - 1];
}

// The logits every stage kernel edits in place: float32 [N, V] on the CPU, contiguous.
void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
              logits.is_contiguous(), op, ": float32 [N, V] contiguous logits");
}

// The checks shared by the cuts taken from probabilities: the logits, probs float32 of their shape, contiguous;
// the parameter float32 [N].
void check_cut_inputs(const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& param, const char* op,
                      const char* name) {
  check_logits(logits, op);
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.sizes() == logits.sizes() && probs.is_contiguous(),
              op, ": probs must be float32, contiguous, of the logits' shape");
  TORCH_CHECK(param.scalar_type() == at::kFloat && param.dim() == 1 && param.size(0) == logits.size(0) &&
              param.is_contiguous(), op, ": ", name, " float32 [N]");
}

// x[i] = -inf wherever p[i] < threshold (a NaN threshold masks nothing).
void mask_below(float* x, const float* p, int64_t n, float threshold) {
  using namespace kvserve_cpu;
  const Vec16 thr = broadcast(threshold), masked = broadcast(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, n - i);
    store(x + i, select_less(load(p + i, lanes), thr, masked, load(x + i, lanes)), lanes);
  }
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// x [N, V] float32 (rows contiguous) -> [N] int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "argmax_rows: float32 [N, V] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int32_t>::max(), "argmax_rows: V in [1, 2^31)");
  const int64_t N = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // A row is ~200 KB: threads take whole rows, and one row stays on one thread.
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * stride, V);
  });
  return out;
}

// x [N, V] float32 logits (rows contiguous), inv_temp [N] float32 (1 / temperature, > 0), uniform [N, V]
// float32 in [0, 1) -> [N] int64: each row's draw from softmax(x * inv_temp) by the exponential race.
at::Tensor race_sample_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& uniform) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "race_sample_rows: float32 [N, V] logits with contiguous rows");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.sizes() == x.sizes() && uniform.is_contiguous(),
              "race_sample_rows: uniform must be float32, contiguous, of the logits' shape");
  TORCH_CHECK(inv_temp.scalar_type() == at::kFloat && inv_temp.dim() == 1 && inv_temp.size(0) == x.size(0) &&
              inv_temp.is_contiguous(), "race_sample_rows: inv_temp float32 [N]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int32_t>::max(), "race_sample_rows: V in [1, 2^31)");
  const int64_t N = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  const float* s = inv_temp.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(s[r] > 0.f && std::isfinite(s[r]), "race_sample_rows: inv_temp must be positive and finite");
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = race_row(p + r * stride, u + r * V, V, s[r]);
  });
  return out;
}

// logits [N, V] float32 (in place), probs [N, V] float32 = softmax(logits), top_p [N] float32 in (0, 1];
// rows: those to cut (the others are left alone). Each row's tokens less likely than its top-p threshold
// (top_p_threshold) are set to -inf, as apply_top_p does with a sort of the vocabulary.
void top_p_mask_(const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& top_p, at::IntArrayRef rows) {
  check_cut_inputs(logits, probs, top_p, "top_p_mask_", "top_p");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "top_p_mask_: an empty vocabulary");
  const float* tp = top_p.data_ptr<float>();
  for (const int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < N, "top_p_mask_: row ", r, " out of range");
    TORCH_CHECK(tp[r] > 0.f && tp[r] <= 1.f, "top_p_mask_: top_p must be in (0, 1]");
  }
  float* x = logits.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  const int64_t R = static_cast<int64_t>(rows.size());
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vals;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = rows[k];
      mask_below(x + r * V, p + r * V, V, top_p_threshold(p + r * V, V, tp[r], vals));
    }
  });
}

// logits [N, V] float32 (in place), top_k [N] int64 (0: the row is left alone; above V: V). Each row's values
// below its k-th largest are set to -inf, ties with it kept, as apply_top_k does with torch's topk.
void top_k_mask_(const at::Tensor& logits, const at::Tensor& top_k) {
  check_logits(logits, "top_k_mask_");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.dim() == 1 && top_k.size(0) == logits.size(0) &&
              top_k.is_contiguous(), "top_k_mask_: top_k int64 [N]");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "top_k_mask_: an empty vocabulary");
  const int64_t* kp = top_k.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(kp[r] >= 0, "top_k_mask_: top_k must be >= 0");
  float* x = logits.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vals, tops;
    for (int64_t r = begin; r < end; ++r) {
      if (kp[r] == 0) continue;
      float* xr = x + r * V;
      mask_below(xr, xr, V, top_k_threshold(xr, V, std::min(kp[r], V), vals, tops));  // the logits themselves
    }
  });
}

// logits [N, V] float32 (in place), probs [N, V] float32 = softmax(logits), min_p [N] float32: each row's
// tokens less likely than min_p times its likeliest are set to -inf, as apply_min_p does (the same float
// product, the same compare), in two passes over the row instead of an amax, a compare and a masked fill.
void min_p_mask_(const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& min_p) {
  check_cut_inputs(logits, probs, min_p, "min_p_mask_", "min_p");
  const int64_t N = logits.size(0), V = logits.size(1);
  float* x = logits.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* pr = p + r * V;
      // The row's largest probability; amax propagates a NaN, and so does this (then nothing compares below).
      Vec16 top = broadcast(-std::numeric_limits<float>::infinity()), total = zero();
      for (int64_t i = 0; i < V; i += 16) {
        const int64_t lanes = std::min<int64_t>(16, V - i);
        const Vec16 v = load(pr + i, lanes);
        top = max_first(top, v, lanes);
        total = total + v;  // probabilities: a NaN anywhere makes it NaN
      }
      if (!std::isnan(reduce_add(total))) mask_below(x + r * V, pr, V, mp[r] * reduce_max(top));
    }
  });
}

// logits [N, V] float32 (in place); prompt_ids / output_ids: every row's token ids one after another, row r's
// at [offsets[r], offsets[r + 1]) (int64, offsets [N + 1]); repetition, presence, frequency [N] float32.
// What apply_penalties does over [N, V] count tensors, on each row's own tokens only: with use_repetition,
// every token in the prompt or the output once, x > 0 ? x / rep : x * rep; then with use_counts, every token
// in the output, x - (presence + frequency * count). Ids outside the vocabulary are ignored, as there.
void apply_penalties_(const at::Tensor& logits, const at::Tensor& prompt_ids, const at::Tensor& prompt_offsets,
                      const at::Tensor& output_ids, const at::Tensor& output_offsets, const at::Tensor& repetition,
                      const at::Tensor& presence, const at::Tensor& frequency, bool use_repetition, bool use_counts) {
  check_logits(logits, "apply_penalties_");
  const int64_t N = logits.size(0), V = logits.size(1);
  for (const at::Tensor* t : {&prompt_ids, &prompt_offsets, &output_ids, &output_offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "apply_penalties_: ids and offsets int64, 1-d, contiguous");
  for (const at::Tensor* t : {&repetition, &presence, &frequency})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == N && t->is_contiguous(),
                "apply_penalties_: repetition, presence, frequency float32 [N]");
  TORCH_CHECK(prompt_offsets.size(0) == N + 1 && output_offsets.size(0) == N + 1, "apply_penalties_: offsets [N + 1]");
  const int64_t* po = prompt_offsets.data_ptr<int64_t>();
  const int64_t* oo = output_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(po[r] >= 0 && po[r] <= po[r + 1] && po[N] <= prompt_ids.size(0) && oo[r] >= 0 &&
                oo[r] <= oo[r + 1] && oo[N] <= output_ids.size(0), "apply_penalties_: offsets out of order or range");
  const int64_t* pi = prompt_ids.data_ptr<int64_t>();
  const int64_t* oi = output_ids.data_ptr<int64_t>();
  const float* rep = repetition.data_ptr<float>();
  const float* pres = presence.data_ptr<float>();
  const float* freq = frequency.data_ptr<float>();
  float* x = logits.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    // Per thread, a count and a seen flag per token, cleared token by token after each row.
    std::vector<int32_t> count(static_cast<size_t>(V), 0);
    std::vector<uint8_t> seen(static_cast<size_t>(V), 0);
    std::vector<int64_t> outputs, seen_list;
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * V;
      outputs.clear();
      seen_list.clear();
      for (int64_t j = oo[r]; j < oo[r + 1]; ++j) {
        const int64_t t = oi[j];
        if (t >= 0 && t < V && count[t]++ == 0) outputs.push_back(t);
      }
      if (use_repetition) {
        auto see = [&](int64_t t) {
          if (t >= 0 && t < V && !seen[t]) { seen[t] = 1; seen_list.push_back(t); }
        };
        for (int64_t j = po[r]; j < po[r + 1]; ++j) see(pi[j]);
        for (const int64_t t : outputs) see(t);
        for (const int64_t t : seen_list) xr[t] = xr[t] > 0.f ? xr[t] / rep[r] : xr[t] * rep[r];
      }
      if (use_counts) {
        for (const int64_t t : outputs) {
          // torch's order and roundings: presence * 1, plus frequency * count, then subtracted; volatile keeps
          // the product from being fused into a multiply-add, which rounds once instead of twice.
          volatile float by_count = freq[r] * static_cast<float>(count[t]);
          xr[t] = xr[t] - (pres[r] + by_count);
        }
      }
      for (const int64_t t : outputs) count[t] = 0;
      for (const int64_t t : seen_list) seen[t] = 0;
    }
  });
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
