// Quantized linear layers with weight rows interleaved in tiles of sixteen: one 64-byte group holds four
// bytes of K for each of the tile's 16 rows, so with AVX-512 VNNI each vpdpbusd multiplies them by four
// activation bytes broadcast to every lane and adds into sixteen int32 lanes, one per row. A block's sums
// then need no reduction across lanes, and its conversion, scaling and min term are one vector op each for
// 16 rows. The AVX2 build reads the same layout as two 8-row halves (its tile function, below).
//
// Why a second layout: the 8-row tiles (quant_linear_x8.cpp) put four rows in a 512-bit vector with four
// partial sums each; the merges and the per-8-rows float work competed with vpdpbusd for the same two
// pipes and capped the kernel at ~28 multiply-adds a cycle a core, so from about three activation rows up
// (batched decode, speculative verification, prefill) it was compute-bound. This layout does 1.2-2x the
// work per second there (benchmarks/results/quantization_avx512.md), and the same at one row, where both
// stream the weights at the read bandwidth. On AVX2 the x8 kernel's horizontal adds go too (1.04-1.27x,
// benchmarks/results/tile_layouts_avx2.md), and 1.5-1.7x more came later from keeping the compiler from
// spilling the running sums (in_register, below).
//
// Layout of tile t (rows 16t .. 16t + 15), block b (values 32b .. 32b + 31), group g, row r (0..15):
//   q4: qs [N/16, nb, 4, 16, 4] uint8: bytes 4g .. 4g + 3 of row r's 16 block bytes (low nibbles: values
//       4g .. 4g + 3, high nibbles: values 16 + 4g ..); w = q * scale + min
//   q8: qs [N/16, nb, 8, 16, 4] uint8: values 4g .. 4g + 3 of row r, stored as w + 128; w = q * scale
//   scales, mins [N/16, nb, 16] in row order (kvserve/layers/quantization/blocks.py: interleave16).
// The tensors are viewed [N/16, nb, G, 64]. vpdpbusd takes unsigned bytes times signed ones: the weights
// are the unsigned side (nibbles, or q8's w + 128) and the activations the signed one. q8's offset comes
// back out in integers, 128 * sum(a) per block, before the one conversion to float: taken out as a float
// min term instead, 128 * scale * d * sum(a) had to cancel against the sum's own offset, which cost up to
// 6e-4 of relative error where AVX2's exact signed products had 2.5e-7. So q8's float work is AVX2's, op
// for op, and the two builds give the same bits.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"
#include "quant_act.h"

namespace {

using namespace kvserve_quant;

constexpr int64_t kRows = 16;                // weight rows per tile
#ifdef __AVX512VNNI__
// Activation rows per pass over a tile's block. With each row's sum in one chain of eight vpdpbusd, 4 was best
// (6 and 8 measured slower); with two chains (tile, below) 6 beat 4 by 1.03-1.07x from 12 rows up on the default
// model's 120 projections (Intel Xeon, 2 threads; 0.98x at 9 rows, 6 + 3 against 4 + 5).
constexpr int64_t kMaxActRows = 6;
// A call's last rows, up to eight, go in one pass: a pass costs the weights' unpacking and reads whatever its
// rows, so a verification step of 5-8 rows paid for a second pass. The default model's 120 projections on the
// Intel Xeon, before / after (benchmarks/verify_rows.py): 5 rows 3.20 / 2.80-3.07 ms, 6 rows 3.78 / 3.38-3.42,
// 7 rows 4.16 / 3.71-3.76, 8 rows 4.58 / 4.20-4.25 (4 rows 2.42-2.64 either way). Nine in one pass measured no
// better than 4 + 5 (their accumulators no longer fit the registers), and with two chains 0.95x against 6 + 3;
// passes balanced to at most eight (5 + 4) measured the same as these.
constexpr int64_t kLastPassRows = 8;
#else
constexpr int64_t kMaxActRows = 3;           // AVX2 (measured: 2 and 4 no better; 4 runs out of registers)
// Last passes of up to six rows measured no better (AVX2 forced on the Intel Xeon: 4-6 rows 1.01-1.05x slower).
constexpr int64_t kLastPassRows = kMaxActRows;
#endif

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef __AVX512VNNI__
inline __m512 load_scales16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Four activation bytes in every 32-bit lane (the compiler folds this into vpdpbusd's broadcast operand).
inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }
#else
inline __m256i broadcast4_256(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }
#endif

template <bool Q4>
constexpr int64_t block_bytes() { return Q4 ? 256 : 512; }

#ifdef __AVX512VNNI__
// R activation rows x one tile of sixteen weight rows -> out[r][row].
template <bool Q4, typename S, int R>
inline void tile(const QuantAct& a, int64_t m0, const uint8_t* wt, const S* st, const S* mt, float (*out)[kRows]) {
  constexpr int64_t kBlockBytes = block_bytes<Q4>();
  __m512 acc[R], min_acc[R];
  for (int r = 0; r < R; ++r) acc[r] = min_acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* w = wt + b * kBlockBytes;
    prefetch_ahead<kBlockBytes, kRows, Q4>(w, st, mt, b);
    const __m512 scale = load_scales16(st + b * kRows);
    __m512 mins = _mm512_setzero_ps();  // q8 has none
    __m512i wv[8];  // q4: groups' low nibbles, then high nibbles; q8: the eight groups
    if constexpr (Q4) {
      mins = load_scales16(mt + b * kRows);
      for (int g = 0; g < 4; ++g) {
        const __m512i x = _mm512_loadu_si512(w + g * 64);
        wv[g] = _mm512_and_si512(x, low4);
        wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
      }
    } else {
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_loadu_si512(w + g * 64);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t blk = (m0 + r) * a.nb + b;
      const int8_t* q = a.q + blk * QK;
      // Two chains of four vpdpbusd, added at the end. One chain of eight waited on vpdpbusd's latency (five
      // cycles) where the core issues two a cycle: splitting it ran the default model's 120 projections 1.09x
      // as fast at 5 and 9 rows and 1.17-1.21x at 16-256, its q8 lm_head 1.17x at 9 rows and 1.12-1.24x at
      // 16-256 (Intel Xeon, AVX-512 VNNI, 2 threads; no change at 1-3 rows, bound by reading the weights).
      // Integer sums, so the same bits.
      // q8: the first chain starts at the offset's -128 * sum(a) (exact: |s| < 2^21), off the critical path.
      __m512i s = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a.qsum[blk]);
      __m512i s2 = _mm512_setzero_si512();
      if constexpr (Q4) {
        for (int g = 0; g < 4; ++g) {
          s = _mm512_dpbusd_epi32(s, wv[g], broadcast4(q + 4 * g));
          s2 = _mm512_dpbusd_epi32(s2, wv[g + 4], broadcast4(q + 16 + 4 * g));
        }
      } else {
        for (int g = 0; g < 8; g += 2) {
          s = _mm512_dpbusd_epi32(s, wv[g], broadcast4(q + 4 * g));
          s2 = _mm512_dpbusd_epi32(s2, wv[g + 1], broadcast4(q + 4 * g + 4));
        }
      }
      s = _mm512_add_epi32(s, s2);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[blk])), acc[r]);
      if constexpr (Q4) min_acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.dsum[blk]), min_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], Q4 ? _mm512_add_ps(acc[r], min_acc[r]) : acc[r]);
}

#else
// Makes the compiler hold v in a register here. Integer adds reassociate freely, and GCC 12 turned each row's
// running sums into trees over a block's products: every row's 16 maddubs results live at once, 48 at three
// rows, most stored to the stack and loaded back (220 stack references in the q4 gemm, 86 with this). The sums
// and the float work are unchanged, so the same bits; on a 2-core Zen 3, the default model's gate_up 1.47x as
// fast at 9 rows and 1.54x at 128, its q8 LM head 1.59x and 1.67x.
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// AVX2 (no vpdpbusd): a group's 64 bytes are two 256-bit vectors, rows 0-7 and rows 8-15, which share each
// broadcast of four activation bytes. q4: maddubs multiplies the nibbles by them; a block's eight products
// per lane add up in int16 (at most 8 * 2 * 15 * 127 = 30480, no saturation) and one madd widens them. No
// lane needs another's sum, so unlike the 8-row layout (quant_linear_x8.cpp) there are no horizontal adds:
// about 20 instead of 30 instructions per activation row, block and eight weight rows (measured 1.04-1.27x, q4).
// The float work is x8's, in x8's order: both give the same bits.
// q8: w + 128 is too wide for maddubs' int16 pairs, so the bytes go back to signed and the sign trick
// (|w| times a with w's sign) multiplies them; its sums are widened per group.
template <bool Q4, typename S, int R>
inline void tile(const QuantAct& a, int64_t m0, const uint8_t* wt, const S* st, const S* mt, float (*out)[kRows]) {
  constexpr int64_t kBlockBytes = block_bytes<Q4>();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* w = wt + b * kBlockBytes;
    prefetch_ahead<kBlockBytes, kRows, Q4>(w, st, mt, b);
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    if constexpr (Q4) {
      for (int g = 0; g < 4; ++g) {
        __m256i lo[2], hi[2];  // rows 0-7, rows 8-15
        for (int h = 0; h < 2; ++h) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + h * 32));
          lo[h] = _mm256_and_si256(x, low4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a.q + ((m0 + r) * a.nb + b) * QK;
          const __m256i al = broadcast4_256(q + 4 * g), ah = broadcast4_256(q + 16 + 4 * g);
          for (int h = 0; h < 2; ++h) {
            s[r][h] = _mm256_add_epi16(s[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], al),
                                                                 _mm256_maddubs_epi16(hi[h], ah)));
            in_register(s[r][h]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = load_scales8(st + b * kRows + h * 8), mins = load_scales8(mt + b * kRows + h * 8);
        for (int r = 0; r < R; ++r) {
          const int64_t blk = (m0 + r) * a.nb + b;
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
          acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(a.d[blk])), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.dsum[blk]), acc[r][h]);
        }
      }
    } else {
      const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int g = 0; g < 8; ++g) {
        __m256i x[2], ax[2];
        for (int h = 0; h < 2; ++h) {
          x[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + h * 32)), offset);
          ax[h] = _mm256_abs_epi8(x[h]);  // |-128| reads as 128 unsigned: still exact
        }
        for (int r = 0; r < R; ++r) {
          const __m256i av = broadcast4_256(a.q + ((m0 + r) * a.nb + b) * QK + 4 * g);
          for (int h = 0; h < 2; ++h) {
            const __m256i p = _mm256_maddubs_epi16(ax[h], _mm256_sign_epi8(av, x[h]));
            s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(p, ones));
            in_register(s[r][h]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = load_scales8(st + b * kRows + h * 8);
        for (int r = 0; r < R; ++r) {
          const int64_t blk = (m0 + r) * a.nb + b;
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(scale, _mm256_set1_ps(a.d[blk])),
                                      acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out[r] + h * 8, acc[r][h]);
}

#endif

// tile<Q4, S, rows> for a row count known at run time, 1 .. kLastPassRows.
template <bool Q4, typename S, int R = 1>
inline void tile_rows(int64_t rows, const QuantAct& a, int64_t m0, const uint8_t* wt, const S* st, const S* mt,
                      float (*out)[kRows]) {
  if constexpr (R < kLastPassRows) {
    if (rows != R) return tile_rows<Q4, S, R + 1>(rows, a, m0, wt, st, mt, out);
  }
  tile<Q4, S, R>(a, m0, wt, st, mt, out);
}

template <bool Q4, typename S, typename T>
void gemm(const QuantAct& a, int64_t M, int64_t N, const uint8_t* wq, const S* ws, const S* wm, T* y) {
  const int64_t tiles = N / kRows, tile_bytes = a.nb * block_bytes<Q4>(), tile_scales = a.nb * kRows;
  // As in quant_linear_x8.cpp: threads split the tiles, each reads its share of the weights once.
  at::parallel_for(0, tiles, 2, [&](int64_t t0, int64_t t1) {
    float out[kLastPassRows][kRows];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = wq + t * tile_bytes;
      const S* st = ws + t * tile_scales;
      const S* mt = Q4 ? wm + t * tile_scales : nullptr;
      for (int64_t m = 0, rows = 0; m < M; m += rows) {
        rows = M - m <= kLastPassRows ? M - m : kMaxActRows;
        tile_rows<Q4, S>(rows, a, m, wt, st, mt, out);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t l = 0; l < kRows; ++l) y[(m + r) * N + t * kRows + l] = static_cast<T>(out[r][l]);
      }
    }
  });
}

void check_x16(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
               int64_t K, const char* op) {
  const bool q4 = mins.has_value() && mins->defined();
  const int64_t nb = K / QK;
  TORCH_CHECK(wq.is_contiguous() && scales.is_contiguous(), op, ": contiguous weights");
  TORCH_CHECK(K % QK == 0 && wq.scalar_type() == at::kByte && wq.dim() == 4 && wq.size(1) == nb &&
              wq.size(2) == (q4 ? 4 : 8) && wq.size(3) == 64,
              op, ": weight of shape ", wq.sizes(), " and dtype ", wq.scalar_type(), " does not match in_features ", K);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == wq.size(0) && scales.size(1) == nb && scales.size(2) == kRows,
              op, ": scales shape ", scales.sizes());
  if (q4) TORCH_CHECK(mins->is_contiguous() && mins->sizes() == scales.sizes() &&
                      mins->scalar_type() == scales.scalar_type(), op, ": mins must match scales");
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// x [.., K] float32/bfloat16 -> y [.., N] of x's dtype, weights in the layout above (group 32).
at::Tensor quant_linear_x16(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu(), "quant_linear_x16: CPU tensors");
  const int64_t K = x.size(-1), N = wq.size(0) * kRows;
  check_x16(wq, scales, mins, K, "quant_linear_x16");
  const bool q4 = mins.has_value() && mins->defined();
  const uint8_t* w = wq.data_ptr<uint8_t>();
  return quantized_linear(x, N, scales.scalar_type(), [&](const QuantAct& act, int64_t M, auto* y, auto scale_tag) {
    using S = decltype(scale_tag);
    using T = std::remove_pointer_t<decltype(y)>;
    if (q4) gemm<true, S, T>(act, M, N, w, scales.data_ptr<S>(), mins->data_ptr<S>(), y);
    else gemm<false, S, T>(act, M, N, w, scales.data_ptr<S>(), nullptr, y);
  }, out_dtype);
}

// Rows ids of the weight, dequantized (an embedding lookup; see quant_embedding_x8).
at::Tensor quant_embedding_x16(const at::Tensor& ids, const at::Tensor& wq, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, at::ScalarType dtype) {
  const int64_t nb = wq.size(1);
  check_x16(wq, scales, mins, nb * QK, "quant_embedding_x16");
  const bool q4 = mins.has_value() && mins->defined();
  const uint8_t* w = wq.data_ptr<uint8_t>();
  at::Tensor out;
  dispatch_scale(scales.scalar_type(), [&](auto scale_tag) {
    using S = decltype(scale_tag);
    const S* sp = scales.data_ptr<S>();
    const S* mp = q4 ? mins->data_ptr<S>() : nullptr;
    out = gather_rows(ids, wq.size(0) * kRows, nb * QK, dtype, "quant_embedding_x16", [&](int64_t id, auto* row) {
      using T = std::remove_pointer_t<decltype(row)>;
      const int64_t t = id / kRows, r = id % kRows;
      for (int64_t b = 0; b < nb; ++b) {
        const float d = to_float(sp, (t * nb + b) * kRows + r);
        const uint8_t* blk = w + (t * nb + b) * (q4 ? 256 : 512) + r * 4;  // group g at + g * 64
        T* dst = row + b * QK;
        if (q4) {
          const float mn = to_float(mp, (t * nb + b) * kRows + r);
          for (int g = 0; g < 4; ++g)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = blk[g * 64 + j];
              dst[4 * g + j] = static_cast<T>(static_cast<float>(byte & 0x0F) * d + mn);
              dst[16 + 4 * g + j] = static_cast<T>(static_cast<float>(byte >> 4) * d + mn);
            }
        } else {
          for (int g = 0; g < 8; ++g)
            for (int j = 0; j < 4; ++j)
              dst[4 * g + j] = static_cast<T>(static_cast<float>(static_cast<int>(blk[g * 64 + j]) - 128) * d);
        }
      }
    });
  });
  return out;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
