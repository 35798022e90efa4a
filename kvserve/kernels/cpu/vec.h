// 16 float32 lanes for the CPU kernels, one source for two instruction sets: one __m512 when compiled
// with AVX-512 (F, BW, DQ, VL), two __m256 when compiled with AVX2 + FMA + F16C. The kernels are written
// once on Vec16; kvserve/kernels/cpu/__init__.py builds them once per instruction set and picks at run
// time. The AVX-512 side is the arithmetic the kernels had before this header grew a second branch.
//
// Lanes load from / store to bfloat16 or float32; load/store with a count n touch only the first n
// elements (n >= 16: all of them), for row tails.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#ifndef KVSERVE_NS
#error "KVSERVE_NS (the torch.ops namespace of this build, e.g. kvserve_avx2) must be defined"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVSERVE_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_VEC_AVX2 1
#else
#error "vec.h needs -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma, or -mavx2 -mfma -mf16c"
#endif

namespace kvserve_cpu {
// Both builds can be loaded into one process: the inline namespace gives each build's helpers their own
// symbol names, so one library's calls can never bind to the other's (AVX-512) code.
inline namespace KVSERVE_NS {

// Eight float32 lanes, in both builds (AVX2 instructions): half a Vec16 on AVX2 (dense_linear.cpp runs a
// Vec16's halves in two passes), and the quantized kernels' activation loads (quant_act.h).
inline __m256 widen_bf16(__m128i raw) {  // 8 bfloat16 -> 8 float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

#ifdef KVSERVE_VEC_AVX512

struct Vec16 {
  __m512 v;
};

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

inline Vec16 zero() { return {_mm512_setzero_ps()}; }
inline Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
// Lanes below n: max(acc, x); the rest: acc (they hold no data).
inline Vec16 max_first(Vec16 acc, Vec16 x, int64_t n) { return {_mm512_mask_max_ps(acc.v, first_lanes(n), acc.v, x.v)}; }
// Lanes below n kept, the rest 0.
inline Vec16 keep_first(Vec16 x, int64_t n) { return {_mm512_maskz_mov_ps(first_lanes(n), x.v)}; }
inline float reduce_add(Vec16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec16 a) { return _mm512_reduce_max_ps(a.v); }

// bfloat16 is the top half of a float32: widen, shift into place.
inline Vec16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
// float8 e4m3 (KV cache) through float16: e4m3's 7 exponent/mantissa bits shifted into f16's places give an
// f16 2^8 times too small (e4m3 subnormals become f16 subnormals, which the hardware converts exactly and
// without the microcode assists that float32 denormals cost in a multiply), then one multiply by 2^8.
inline Vec16 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f))};
}
inline Vec16 load(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first_lanes(n), p)}; }
inline Vec16 load(const c10::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void store(float* p, Vec16 a, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), a.v); }
// a rounded to bfloat16 in the upper 16 bits of each lane (the lower ones not cleared): round to nearest even,
// as c10::BFloat16 does; NaN stays a (quiet) NaN.
inline __m512i bf16_bits(Vec16 a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
inline void store(c10::BFloat16* p, Vec16 a, int64_t n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(a), 16)));
}
// What storing a to bfloat16 and loading it back gives, without the trip through memory.
inline Vec16 round_bf16(Vec16 a) {
  return {_mm512_castsi512_ps(_mm512_and_si512(bf16_bits(a), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// 2^n for whole-number lanes n (scalef: p * 2^n in one instruction).
inline Vec16 round_nearest(Vec16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec16 scale_pow2(Vec16 p, Vec16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
// Lanes where a < b take x, the others y (a NaN lane compares false).
inline Vec16 select_less(Vec16 a, Vec16 b, Vec16 x, Vec16 y) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), y.v, x.v)};
}
// x = m * 2^e with m in [1, 2) and e a whole number, for normal x > 0.
inline void split_exponent(Vec16 x, Vec16& m, Vec16& e) {
  m = {_mm512_getmant_ps(x.v, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero)};
  e = {_mm512_getexp_ps(x.v)};
}

// Lane i of the result is the sum of v[i]'s 16 lanes: a transpose-and-add tree, 45 instructions where
// 16 separate horizontal sums take ~130.
inline Vec16 sum_each16(const Vec16* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of four inputs, in order
    const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // fold 128-bit lanes pairwise
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD))};
}

#else  // AVX2 + FMA + F16C: lanes 0-7 in lo, 8-15 in hi

struct Vec16 {
  __m256 lo, hi;
};

// All-ones in the 32-bit lanes [first, first + 8) that are below n.
inline __m256i lanes_below(int64_t n, int first) {
  const int m = static_cast<int>(n >= 16 ? 16 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(m - first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {  // a * b + c
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) {  // c - a * b
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Vec16 max_first(Vec16 acc, Vec16 x, int64_t n) {
  const Vec16 m = vmax(acc, x);
  return {_mm256_blendv_ps(acc.lo, m.lo, _mm256_castsi256_ps(lanes_below(n, 0))),
          _mm256_blendv_ps(acc.hi, m.hi, _mm256_castsi256_ps(lanes_below(n, 8)))};
}
inline Vec16 keep_first(Vec16 x, int64_t n) {
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(lanes_below(n, 0))),
          _mm256_and_ps(x.hi, _mm256_castsi256_ps(lanes_below(n, 8)))};
}
// Halves folded in the order _mm512_reduce_add_ps / _mm512_reduce_max_ps use (upper 256 onto lower, ...).
inline float reduce_add(Vec16 a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline Vec16 load16(const float* p) { return {load8(p), load8(p + 8)}; }
inline Vec16 load16(const c10::BFloat16* p) { return {load8(p), load8(p + 8)}; }
// float8 e4m3 (KV cache) through float16, as in the AVX-512 branch: bits into f16's places, then x 2^8.
inline Vec16 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  const __m256 k = _mm256_set1_ps(256.f);
  return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k),
          _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k)};
}
inline Vec16 load(const float* p, int64_t n) {
  if (n >= 16) return load16(p);
  // maskload reads nothing from masked-off lanes, so a tail at the end of a buffer cannot fault.
  return {_mm256_maskload_ps(p, lanes_below(n, 0)), _mm256_maskload_ps(p + 8, lanes_below(n, 8))};
}
inline Vec16 load(const c10::BFloat16* p, int64_t n) {
  if (n >= 16) return load16(p);
  // No 16-bit masked load in AVX2: copy the tail into a zeroed buffer (tails are rare).
  c10::BFloat16 buf[16];
  std::memset(buf, 0, sizeof(buf));
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(c10::BFloat16));
  return load16(buf);
}
inline void store(float* p, Vec16 a, int64_t n) {
  if (n >= 16) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  _mm256_maskstore_ps(p, lanes_below(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, lanes_below(n, 8), a.hi);
}
// 8 float32 -> 8 bfloat16 in the low 16 bits of each 32-bit lane: round to nearest even, as
// c10::BFloat16 does; NaN stays a (quiet) NaN.
inline __m256i narrow_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan)), 16);
}
// What storing a to bfloat16 and loading it back gives, without the trip through memory.
inline Vec16 round_bf16(Vec16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(narrow_bf16(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(narrow_bf16(a.hi), 16))};
}
inline void store(c10::BFloat16* p, Vec16 a, int64_t n) {
  // packus interleaves 128-bit lanes ([lo 0-3, hi 0-3, lo 4-7, hi 4-7]); the permute puts them in order.
  // The values are below 2^16, so its unsigned saturation never changes one.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(narrow_bf16(a.lo), narrow_bf16(a.hi)), 0xD8);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  c10::BFloat16 buf[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), packed);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(c10::BFloat16));
}

inline Vec16 round_nearest(Vec16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// p * 2^n for whole-number lanes n in [-126, 127] (what exp_ps passes): 2^n built from its exponent bits.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec16 scale_pow2(Vec16 p, Vec16 n) { return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))}; }
inline Vec16 select_less(Vec16 a, Vec16 b, Vec16 x, Vec16 y) {
  return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
}
inline void split_exponent8(__m256 x, __m256& m, __m256& e) {
  const __m256i bits = _mm256_castps_si256(x);
  m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                          _mm256_set1_epi32(0x3F800000)));
  e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
}
inline void split_exponent(Vec16 x, Vec16& m, Vec16& e) {
  split_exponent8(x.lo, m.lo, e.lo);
  split_exponent8(x.hi, m.hi, e.hi);
}

// Lane i of the result is the sum of v[i]'s 16 lanes. Each input's halves are added first (8 lanes),
// then the same transpose-and-add tree as the AVX-512 side, on 8 inputs per output half.
inline __m256 sum_each8(const __m256* w) {
  __m256 s1[4], s2[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(w[2 * i], w[2 * i + 1]), _mm256_unpackhi_ps(w[2 * i], w[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: partial sums of four inputs, in order
    const __m256d x = _mm256_castps_pd(s1[2 * i]), y = _mm256_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // Low 128-bit lanes of both plus high lanes of both: inputs 0-3 then 4-7.
  return _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20), _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
}
inline Vec16 sum_each16(const Vec16* v) {
  __m256 w[16];
  for (int i = 0; i < 16; ++i) w[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum_each8(w), sum_each8(w + 8)};
}

#endif

// e^x, x clamped to [-87, 88]: x = n ln2 + r, e^r by a degree-6 polynomial on |r| <= ln2/2 (relative
// error ~2e-7), times 2^n.
inline Vec16 exp_ps(Vec16 x) {
  x = vmin(vmax(x, broadcast(-87.f)), broadcast(88.f));
  const Vec16 n = round_nearest(x * broadcast(1.44269504088896341f));
  Vec16 r = fnmadd(n, broadcast(0.693145751953125f), x);
  r = fnmadd(n, broadcast(1.428606765330187e-06f), r);
  Vec16 p = broadcast(1.3981999507e-3f);
  p = fmadd(p, r, broadcast(8.3334519073e-3f));
  p = fmadd(p, r, broadcast(4.1665795894e-2f));
  p = fmadd(p, r, broadcast(1.6666665459e-1f));
  p = fmadd(p, r, broadcast(5.0000001201e-1f));
  p = fmadd(p, r, broadcast(1.0f));
  p = fmadd(p, r, broadcast(1.0f));
  return scale_pow2(p, n);
}

// ln x for normal x > 0 (what log_ps is given: uniforms in (0, 1)): x = m 2^e, m moved into [sqrt(1/2),
// sqrt(2)), then ln m by a degree-9 polynomial in m - 1 (Cephes' logf coefficients; ~1e-7 relative).
inline Vec16 log_ps(Vec16 x) {
  Vec16 m, e;
  split_exponent(x, m, e);
  const Vec16 big = select_less(broadcast(1.41421356f), m, broadcast(1.f), zero());
  m = select_less(broadcast(1.41421356f), m, m * broadcast(0.5f), m);
  e = e + big;
  const Vec16 r = m - broadcast(1.f), r2 = r * r;
  Vec16 p = broadcast(7.0376836292e-2f);
  p = fmadd(p, r, broadcast(-1.1514610310e-1f));
  p = fmadd(p, r, broadcast(1.1676998740e-1f));
  p = fmadd(p, r, broadcast(-1.2420140846e-1f));
  p = fmadd(p, r, broadcast(1.4249322787e-1f));
  p = fmadd(p, r, broadcast(-1.6668057665e-1f));
  p = fmadd(p, r, broadcast(2.0000714765e-1f));
  p = fmadd(p, r, broadcast(-2.4999993993e-1f));
  p = fmadd(p, r, broadcast(3.3333331174e-1f));
  Vec16 y = p * r * r2;
  y = fmadd(e, broadcast(-2.12194440e-4f), y);
  y = fnmadd(broadcast(0.5f), r2, y);
  return fmadd(e, broadcast(0.693359375f), r + y);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
