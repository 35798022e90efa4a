// Quantized linear layers with the weight rows interleaved in tiles of eight, so that one pass over a
// block of 32 activations yields the eight rows' dot products in the eight lanes of one vector.
//
// Why: in the row-by-row kernel (quant_linear.cpp) every row and block ends in its own convert, scale
// multiply and accumulate, and a q4 min term in scalar code: about 17 instructions per 16 weight bytes,
// which kept a batch-1 decode step compute-bound on two AVX2 cores. Here two rows share each 32-byte load
// and three horizontal adds reduce eight rows at once, so the scales, mins and accumulation are vector ops
// per eight rows.
//
// Layout of a tile (rows 8t .. 8t + 7), block b (values 32b .. 32b + 31), pair p (rows 8t + 2p, 8t + 2p + 1),
// h = 0 / 1 the pair's first / second row:
//   q4: qs [N/8, nb, 4, 2, 16]  uint8: the row's 16 block bytes as stored (value j low nibble of byte j,
//                                      value j + 16 high nibble)
//   q8: qs [N/8, nb, 4, 2, 2, 16] int8: [p][half][h][16]: values 0-15 of both rows, then values 16-31
//   scales, mins [N/8, nb, 8] in lane order 0, 2, 4, 6, 1, 3, 5, 7 (the order the horizontal adds leave
//   the rows in; kvserve/layers/quantization/blocks.py builds it).
//
// AVX2 code (maddubs, then madd to int32, three horizontal adds per block). Weights whose N is a multiple
// of 16 use the 16-row layout instead (quant_linear_x16.cpp), which needs no horizontal adds; this one
// keeps the rest (N a multiple of 8 only).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops.h"
#include "quant_act.h"

namespace {

using namespace kvserve_quant;

constexpr int kLaneRow[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // lane -> row within the tile
constexpr int64_t kMaxRows = 2;                        // activation rows per pass over a tile's weights

// Block b of one activation row, as its two 16-value halves each repeated in both 128-bit lanes.
struct ActHalves {
  __m256i lo, hi;
};
inline ActHalves act_halves(const int8_t* a) {
  return {_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16)))};
}

// Eight rows' int32 sums from four pair vectors (lanes 0-3: first row, 4-7: second row of each pair).
inline __m256i reduce_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
}

// R activation rows x one tile of eight weight rows -> out[r][lane].
template <bool Q4, typename S, int R>
inline void tile(const QuantAct& a, int64_t m0, const uint8_t* wt, const S* st, const S* mt, float (*out)[8]) {
  constexpr int64_t kTileBlockBytes = Q4 ? 128 : 256;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* w = wt + b * kTileBlockBytes;
    prefetch_ahead<kTileBlockBytes, 8, Q4>(w, st, mt, b);
    const __m256 scale = load_scales8(st + b * 8);
    if constexpr (Q4) {
      const __m256i mask = _mm256_set1_epi8(0x0F);
      __m256i lo[4], hi[4];  // values 0-15 / 16-31 of a pair's two rows
      for (int p = 0; p < 4; ++p) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
        lo[p] = _mm256_and_si256(x, mask);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
      }
      const __m256 mins = load_scales8(mt + b * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t blk = (m0 + r) * a.nb + b;
        const ActHalves av = act_halves(a.q + blk * QK);
        __m256i s[4];
        for (int p = 0; p < 4; ++p)  // int16 sums stay below 4 * 15 * 127: no saturation
          s[p] = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], av.lo), _mm256_maddubs_epi16(hi[p], av.hi)), ones);
        const __m256 dot = _mm256_cvtepi32_ps(reduce_pairs(s[0], s[1], s[2], s[3]));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(a.d[blk])), acc[r]);
        acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.dsum[blk]), acc[r]);
      }
    } else {
      __m256i lo[4], hi[4];
      for (int p = 0; p < 4; ++p) {
        lo[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
        hi[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t blk = (m0 + r) * a.nb + b;
        const ActHalves av = act_halves(a.q + blk * QK);
        __m256i s[4];
        for (int p = 0; p < 4; ++p) {  // signed x signed through maddubs: |w| times a with w's sign
          const __m256i l = _mm256_maddubs_epi16(_mm256_sign_epi8(lo[p], lo[p]), _mm256_sign_epi8(av.lo, lo[p]));
          const __m256i h = _mm256_maddubs_epi16(_mm256_sign_epi8(hi[p], hi[p]), _mm256_sign_epi8(av.hi, hi[p]));
          s[p] = _mm256_add_epi32(_mm256_madd_epi16(l, ones), _mm256_madd_epi16(h, ones));
        }
        const __m256 dot = _mm256_cvtepi32_ps(reduce_pairs(s[0], s[1], s[2], s[3]));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(a.d[blk])), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], acc[r]);
}

template <bool Q4, typename S, typename T>
void gemm(const QuantAct& a, int64_t M, int64_t N, const uint8_t* wq, const S* ws, const S* wm, T* y) {
  const int64_t tiles = N / 8, tile_bytes = a.nb * (Q4 ? 128 : 256), tile_scales = a.nb * 8;
  // Threads split the tiles, so each reads its share of the weights once; a tile's weights (at most a few
  // KB) stay in cache while every activation row passes over them.
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    float out[kMaxRows][8];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = wq + t * tile_bytes;
      const S* st = ws + t * tile_scales;
      const S* mt = Q4 ? wm + t * tile_scales : nullptr;
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, M - m);
        if (rows == 2) tile<Q4, S, 2>(a, m, wt, st, mt, out);
        else tile<Q4, S, 1>(a, m, wt, st, mt, out);
        for (int64_t r = 0; r < rows; ++r)
          for (int l = 0; l < 8; ++l) y[(m + r) * N + t * 8 + kLaneRow[l]] = static_cast<T>(out[r][l]);
      }
    }
  });
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// x [.., K] float32/bfloat16 -> y [.., N] of x's dtype, weights in the layout above (group 32).
at::Tensor quant_linear_x8(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && wq.is_contiguous() && scales.is_contiguous(), "quant_linear_x8: CPU, contiguous");
  const bool q4 = mins.has_value() && mins->defined();
  const int64_t K = x.size(-1), N = wq.size(0) * 8, nb = K / QK;
  TORCH_CHECK(K % QK == 0, "quant_linear_x8: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(q4 ? (wq.scalar_type() == at::kByte && wq.dim() == 5 && wq.size(1) == nb)
                 : (wq.scalar_type() == at::kChar && wq.dim() == 6 && wq.size(1) == nb),
              "quant_linear_x8: weight of shape ", wq.sizes(), " and dtype ", wq.scalar_type(),
              " does not match in_features ", K);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == N / 8 && scales.size(1) == nb && scales.size(2) == 8,
              "quant_linear_x8: scales shape ", scales.sizes());
  if (q4) TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() &&
                      mins->scalar_type() == scales.scalar_type(), "quant_linear_x8: mins must match scales");
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  return quantized_linear(x, N, scales.scalar_type(), [&](const QuantAct& act, int64_t M, auto* y, auto scale_tag) {
    using S = decltype(scale_tag);
    using T = std::remove_pointer_t<decltype(y)>;
    if (q4) gemm<true, S, T>(act, M, N, w, scales.data_ptr<S>(), mins->data_ptr<S>(), y);
    else gemm<false, S, T>(act, M, N, w, scales.data_ptr<S>(), nullptr, y);
  }, out_dtype);
}

// Rows ids of the weight in the layout above, dequantized: an embedding lookup (a tied LM head's table is
// kept in this layout for the matmul). out [n, K] of dtype float32 or bfloat16, w = q * scale (+ min).
at::Tensor quant_embedding_x8(const at::Tensor& ids, const at::Tensor& wq, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, at::ScalarType dtype) {
  const bool q4 = mins.has_value() && mins->defined();
  TORCH_CHECK(wq.is_contiguous() && scales.is_contiguous() && (!q4 || mins->is_contiguous()),
              "quant_embedding_x8: contiguous weights");
  TORCH_CHECK(q4 ? (wq.scalar_type() == at::kByte && wq.dim() == 5) : (wq.scalar_type() == at::kChar && wq.dim() == 6),
              "quant_embedding_x8: weight of shape ", wq.sizes(), " is not an interleaved q4 or q8 weight");
  const int64_t nb = wq.size(1);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  at::Tensor out;
  dispatch_scale(scales.scalar_type(), [&](auto scale_tag) {
    using S = decltype(scale_tag);
    const S* sp = scales.data_ptr<S>();
    const S* mp = q4 ? mins->data_ptr<S>() : nullptr;
    out = gather_rows(ids, wq.size(0) * 8, nb * QK, dtype, "quant_embedding_x8", [&](int64_t id, auto* row) {
      using T = std::remove_pointer_t<decltype(row)>;
      const int64_t t = id / 8, r = id % 8, p = r / 2, h = r % 2;
      int lane = 0;
      while (kLaneRow[lane] != r) ++lane;
      for (int64_t b = 0; b < nb; ++b) {
        const float d = to_float(sp, (t * nb + b) * 8 + lane);
        T* dst = row + b * QK;
        if (q4) {
          const float mn = to_float(mp, (t * nb + b) * 8 + lane);
          const uint8_t* q = w + ((t * nb + b) * 4 + p) * 32 + h * 16;  // [N/8, nb, 4, 2, 16]
          for (int j = 0; j < 16; ++j) {
            dst[j] = static_cast<T>(static_cast<float>(q[j] & 0x0F) * d + mn);
            dst[j + 16] = static_cast<T>(static_cast<float>(q[j] >> 4) * d + mn);
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(w) + ((t * nb + b) * 4 + p) * 64;  // [.., 4, 2, 2, 16]
          for (int half = 0; half < 2; ++half)
            for (int j = 0; j < 16; ++j)
              dst[half * 16 + j] = static_cast<T>(static_cast<float>(q[half * 32 + h * 16 + j]) * d);
        }
      }
    });
  });
  return out;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
