// The index of each row's largest value, as torch.argmax(x, -1) gives it: the first of equal maxima, and
// the first NaN where a row has one (torch counts NaN as the largest value).
//
// Why a kernel: greedy sampling takes the argmax of every row of logits each step, and torch's CPU argmax
// over a 49,152-token vocabulary took ~75 us a row on two AVX2 cores (~1% of a batch-1 decode step, 0.2 ms
// of a 5-row speculative verification). One pass of vector compares does it in a few microseconds (~8 us a
// row on the Xeon, call included; see argmax_row).
// AVX2 intrinsics only: the same code runs in the AVX-512 build.
//
// race_sample_rows: the sampler's draw (kvserve/sampling/sampler.py), the exponential race
// argmax_v p_v / E_v with p = softmax(x / T) and E_v = -ln u_v, in two passes over a row instead of torch's
// six (divide, softmax, log, negate, divide, argmax) and their [N, V] temporaries. The sampler's call,
// uniforms included, on the Intel Xeon (benchmarks/results/sampling_avx512.md): one 49,152-token row
// 115-123 -> 81-85 us, 9 rows 675-716 -> 430-437 us, 32 rows 5.4-5.8 -> 1.5 ms, where a decode step takes
// ~3 ms, a 9-row verification ~10 ms and a step of 32 streams ~40 ms.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

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

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
