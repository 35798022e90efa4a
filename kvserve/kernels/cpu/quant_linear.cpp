// Weight-only quantized linear layers: y = x @ W^T with W kept in blocks of 32 along K, the way GGUF
// files store it. Two block layouts cover every weight format kvserve loads (kvserve/layers/quantization):
//
//   q8: int8 values, one scale per group of 32 (or 16) values      w = q * scale
//       (GGUF Q8_0, Q5_0, Q6_K; kvserve's int8)
//   q4: 4-bit values 0..15, one scale and one min per 32 values    w = q * scale + min
//       (GGUF Q4_0, Q4_1, Q4_K; kvserve's int4). A block's 16 bytes hold value j in the low nibble of
//       byte j and value j + 16 in the high nibble.
//
// Scales and mins are float16 (where the source format's are, so nothing is rounded) or float32.
//
// Why a kernel: decode reads every weight once per step, so its speed is the weight bytes read. Both
// layouts are read as stored. Activations are quantized to int8 per block of 32 (scale = max|x| / 127)
// once per call, and each block's dot product is integer arithmetic: AVX2's maddubs multiplies 32
// unsigned by 32 signed bytes in one instruction. torch's own int4/int8 CPU kernels ran 5-10x slower
// here with float32 activations (benchmarks/results/torch_packed_<isa>.md).
//
// Only AVX2 + FMA + F16C intrinsics: the same code runs on AVX-512 CPUs.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"
#include "quant_act.h"

namespace {

using namespace kvserve_quant;

constexpr int64_t kRowTile = 4;  // activation rows that share each loaded weight block

// Eight int32 partial sums of the 32 products w * a: lanes 0-3 cover values 0-15, lanes 4-7 values 16-31.
inline __m256i dot_s8(__m256i w, __m256i a) {  // w signed (q8)
  const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(prod, _mm256_set1_epi16(1));
}
inline __m256i dot_u4(__m256i w, __m256i a) {  // w unsigned 0..15 (q4)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

enum class Layout { kQ8G32, kQ8G16, kQ4 };

// out[r][j] = y[m0 + r, n0 + j] for R activation rows and NR weight rows: each loaded weight block serves
// R rows and each loaded activation block NR weight rows (R * NR accumulators stay in registers).
template <Layout L, typename S, int R, int NR>
inline void dot_tile(const QuantAct& a, int64_t m0, const uint8_t* wq, int64_t row_bytes, const S* ws,
                     int64_t scales_per_row, const S* wm, float (*out)[NR]) {
  __m256 acc[R][NR];
  float min_term[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) { acc[r][j] = _mm256_setzero_ps(); min_term[r][j] = 0.f; }
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i w[NR];
    __m256 wscale[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = wq + j * row_bytes;
      const S* sc = ws + j * scales_per_row;
      if constexpr (L == Layout::kQ4) {
        w[j] = unpack_q4(row + b * 16);
        wscale[j] = _mm256_set1_ps(to_float(sc, b));
      } else {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
        if constexpr (L == Layout::kQ8G16)
          wscale[j] = _mm256_set_m128(_mm_set1_ps(to_float(sc, 2 * b + 1)), _mm_set1_ps(to_float(sc, 2 * b)));
        else
          wscale[j] = _mm256_set1_ps(to_float(sc, b));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t blk = (m0 + r) * a.nb + b;
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + blk * QK));
      const __m256 ad = _mm256_set1_ps(a.d[blk]);
      for (int j = 0; j < NR; ++j) {
        const __m256i s = L == Layout::kQ4 ? dot_u4(w[j], av) : dot_s8(w[j], av);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(wscale[j], ad), acc[r][j]);
        // An explicit fma: left to the compiler, some tile shapes contracted this and others did not, so a
        // row's bits depended on the tile it fell in (the thread split, the rows sharing the call).
        if constexpr (L == Layout::kQ4)
          min_term[r][j] = std::fma(to_float(wm + j * a.nb, b), a.dsum[blk], min_term[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) out[r][j] = hsum(acc[r][j]) + min_term[r][j];
}

template <typename T>
inline void store_out(T* y, float v) { *y = static_cast<T>(v); }

// Rows [m0, m0 + R) x weight rows [n0, n0 + NR) of y.
template <Layout L, typename S, typename T, int R, int NR>
inline void tile(const QuantAct& a, int64_t m0, int64_t n0, int64_t N, const uint8_t* wq, int64_t row_bytes,
                 const S* ws, int64_t scales_per_row, const S* wm, T* y) {
  float out[R][NR];
  dot_tile<L, S, R, NR>(a, m0, wq + n0 * row_bytes, row_bytes, ws + n0 * scales_per_row, scales_per_row,
                        wm == nullptr ? nullptr : wm + n0 * a.nb, out);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) store_out(y + (m0 + r) * N + n0 + j, out[r][j]);
}

template <Layout L, typename S, typename T>
void gemm(const QuantAct& a, int64_t M, int64_t N, const uint8_t* wq, const S* ws, const S* wm, T* y) {
  const int64_t row_bytes = L == Layout::kQ4 ? a.K / 2 : a.K;
  const int64_t spr = L == Layout::kQ8G16 ? a.K / 16 : a.nb;  // scales per weight row
  // Threads split the output columns (weight rows), so each reads its share of the weights once;
  // activation rows are walked in panels that stay in cache while the panel's weight rows stream by.
  constexpr int64_t kPanel = 64;
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    if (M == 1) {  // decode at batch 1: four weight rows share each activation block
      int64_t n = n_begin;
      for (; n + 4 <= n_end; n += 4) tile<L, S, T, 1, 4>(a, 0, n, N, wq, row_bytes, ws, spr, wm, y);
      for (; n < n_end; ++n) tile<L, S, T, 1, 1>(a, 0, n, N, wq, row_bytes, ws, spr, wm, y);
      return;
    }
    for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
      const int64_t p1 = std::min(M, p0 + kPanel);
      for (int64_t n = n_begin; n < n_end; n += 2) {
        const bool pair = n + 2 <= n_end;
        int64_t m = p0;
        for (; m + kRowTile <= p1; m += kRowTile) {
          if (pair) tile<L, S, T, kRowTile, 2>(a, m, n, N, wq, row_bytes, ws, spr, wm, y);
          else tile<L, S, T, kRowTile, 1>(a, m, n, N, wq, row_bytes, ws, spr, wm, y);
        }
        for (; m < p1; ++m) {
          if (pair) tile<L, S, T, 1, 2>(a, m, n, N, wq, row_bytes, ws, spr, wm, y);
          else tile<L, S, T, 1, 1>(a, m, n, N, wq, row_bytes, ws, spr, wm, y);
        }
      }
    }
  });
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// x [.., K] float32/bfloat16 -> y [.., N] of x's dtype. wq: q8 int8 [N, K] / q4 uint8 [N, K / 2];
// scales [N, K / group]; mins [N, K / 32] (q4) or undefined (q8).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t group, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && wq.is_contiguous() && scales.is_contiguous(), "quant_linear: CPU, contiguous");
  const int64_t K = x.size(-1), N = wq.size(0);
  TORCH_CHECK(K % QK == 0, "quant_linear: in_features must be a multiple of 32, got ", K);
  const bool q4 = mins.has_value() && mins->defined();
  TORCH_CHECK(q4 ? (wq.scalar_type() == at::kByte && wq.size(1) * 2 == K && group == 32)
                 : (wq.scalar_type() == at::kChar && wq.size(1) == K && (group == 32 || group == 16)),
              "quant_linear: weight of shape ", wq.sizes(), " and dtype ", wq.scalar_type(),
              " does not match in_features ", K, " (group ", group, ")");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group, "quant_linear: scales shape");
  if (q4) TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() &&
                      mins->scalar_type() == scales.scalar_type(), "quant_linear: mins must match scales");
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  return quantized_linear(x, N, scales.scalar_type(), [&](const QuantAct& act, int64_t M, auto* y, auto scale_tag) {
    using S = decltype(scale_tag);
    using T = std::remove_pointer_t<decltype(y)>;
    const S* sp = scales.data_ptr<S>();
    if (q4) gemm<Layout::kQ4, S, T>(act, M, N, w, sp, mins->data_ptr<S>(), y);
    else if (group == 16) gemm<Layout::kQ8G16, S, T>(act, M, N, w, sp, nullptr, y);
    else gemm<Layout::kQ8G32, S, T>(act, M, N, w, sp, nullptr, y);
  }, out_dtype);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
