// Shared by the quantized linear kernels (quant_linear.cpp: weights row by row; quant_linear_x8.cpp and
// quant_linear_x16.cpp: eight or sixteen rows interleaved): activations quantized to int8 per block of 32,
// and small helpers.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "vec.h"  // also checks KVSERVE_NS

namespace kvserve_quant {
// Each build's own copies (see vec.h): the other build's would run its instruction set's code.
inline namespace KVSERVE_NS {

constexpr int64_t QK = 32;       // values per block (and per activation scale)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

using kvserve_cpu::load8;  // float32 or bfloat16 -> 8 float32 lanes (vec.h)

// Eight weight scales (or mins) of a tiled layout, stored as float32 or float16.
inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float to_float(const float* p, int64_t i) { return p[i]; }
inline float to_float(const at::Half* p, int64_t i) {
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[i]);
}

// One row of x [K] -> int8 q [K], per-block scale d [K/32], d * sum(q) [K/32] (for q4's min term) and
// sum(q) [K/32] itself (q8's +128 offset taken out in integers).
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* dsum, int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * QK + i * 8);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float mx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const float scale = mx / 127.f;
    const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    __m256i iv[4];
    __m256i isum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // rounds to nearest even; |q| <= 127
      isum = _mm256_add_epi32(isum, iv[i]);
    }
    // int32 -> int8 packs interleave 128-bit lanes; the permute restores element order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    const int total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    d[b] = scale;
    dsum[b] = scale * static_cast<float>(total);
    qsum[b] = total;
  }
}

struct QuantAct {
  const int8_t* q;
  const float* d;
  const float* dsum;
  const int32_t* qsum;
  int64_t K, nb;
};


// Quantizes x [M, K] (contiguous) into int8 blocks held in buffers of the calling thread, valid until its
// next call. Reused rather than allocated: a decode step makes ~120 of these calls, and two tensor
// allocations each cost more than quantizing a row.
inline QuantAct quantize_activations(const at::Tensor& x, int64_t M, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantized linear: activations must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t nb = K / QK;
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf;  // block scales, then scale * sum per block
  thread_local std::vector<int32_t> sum_buf;
  q_buf.resize(static_cast<size_t>(M * K));
  d_buf.resize(static_cast<size_t>(2 * M * nb));
  sum_buf.resize(static_cast<size_t>(M * nb));
  int8_t* aqp = q_buf.data();
  float* dp = d_buf.data();
  float* dsp = dp + M * nb;
  int32_t* qsp = sum_buf.data();
  auto run = [&](auto act_tag) {
    using T = decltype(act_tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) quantize_row(xp + m * K, K, aqp + m * K, dp + m * nb, dsp + m * nb, qsp + m * nb);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return QuantAct{aqp, dp, dsp, qsp, K, nb};
}

template <typename F>
void dispatch_act(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, "quantized linear: activations must be float32 or bfloat16, got ", t);
}

template <typename F>
void dispatch_scale(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kHalf) f(at::Half{});
  else TORCH_CHECK(false, "quantized linear: scales must be float16 or float32, got ", t);
}

// Weights stream from DRAM once per step; the hardware prefetcher alone left the two cores waiting about half
// the time (layers at ~11 GB/s of a ~22 GB/s machine). The tiled kernels ask, at block b of a tile (w: its
// weights, kBlockBytes a block, kScales scales a block), for the block kPrefetchBytes ahead (past the tile's
// end into the next tile) with its scales and mins, which brings a step's matmuls to the read bandwidth.
constexpr int64_t kPrefetchBytes = 4096;
template <int64_t kBlockBytes, int64_t kScales, bool kMins, typename S>
inline void prefetch_ahead(const uint8_t* w, const S* st, const S* mt, int64_t b) {
  constexpr int64_t kAhead = kPrefetchBytes / kBlockBytes;  // blocks ahead
  for (int64_t l = 0; l < kBlockBytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead * kBlockBytes + l), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(st + (b + kAhead) * kScales), _MM_HINT_T0);
  if constexpr (kMins) _mm_prefetch(reinterpret_cast<const char*>(mt + (b + kAhead) * kScales), _MM_HINT_T0);
}

// What every quantized linear op shares once its weights are checked: y [.., N] of out_dtype (default x's:
// float32 for an LM head's logits, which the kernels sum in float32 anyway), x quantized once, then
// gemm(act, M, y, scale_tag) with y a float* or c10::BFloat16* and scale_tag a float or at::Half.
template <typename Gemm>
at::Tensor quantized_linear(const at::Tensor& x, int64_t N, at::ScalarType scale_type, Gemm&& gemm,
                            std::optional<at::ScalarType> out_dtype = std::nullopt) {
  const int64_t K = x.size(-1);
  const at::Tensor xc = x.contiguous();
  const int64_t M = K ? xc.numel() / K : 0;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  const at::ScalarType yt = out_dtype.value_or(x.scalar_type());
  at::Tensor y = at::empty(out_sizes, x.options().dtype(yt));
  if (M == 0 || N == 0) return y;
  const QuantAct act = quantize_activations(xc, M, K);
  dispatch_act(yt, [&](auto act_tag) {
    using T = decltype(act_tag);
    dispatch_scale(scale_type, [&](auto scale_tag) { gemm(act, M, y.data_ptr<T>(), scale_tag); });
  });
  return y;
}

// An embedding lookup in a tiled weight [N, K]: rows ids, dequantized, as [n, K] float32 or bfloat16.
// write(id, dst) fills one row (dst: float* or c10::BFloat16*). The layouts' kernels supply write.
template <typename Write>
at::Tensor gather_rows(const at::Tensor& ids, int64_t N, int64_t K, at::ScalarType dtype, const char* op,
                       Write&& write) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, ": int64 ids");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 out");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.numel();
  const int64_t* idp = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < N, op, ": id ", idp[i], " out of range");
  at::Tensor out = at::empty({n, K}, ids.options().dtype(dtype));
  auto run = [&](auto* rows) {
    for (int64_t i = 0; i < n; ++i) write(idp[i], rows + i * K);
  };
  if (dtype == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_quant
