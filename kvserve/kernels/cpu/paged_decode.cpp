// Paged decode attention for CPUs with AVX-512: one query token per sequence, K/V read in place from the
// head-major paged cache ([Hkv, num_blocks, block_size, D]) through each sequence's block table.
//
// Why a kernel: the torch path gathers every decode row's K/V into a padded copy and runs two batched
// matmuls over it; at batch 64 the gather and the matmuls were ~45% of a decode step. Here each (sequence,
// KV head) reads its K once and its V once, with no copy and no padding, and the G query heads that share
// the KV head reuse each converted K/V row from registers.
//
// Registered as torch.ops.kvserve.paged_decode_ (in place on `out`). Scores and softmax are float32
// whatever the cache dtype (bfloat16 or float32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits, shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T, int64_t D>
inline void prefetch_row(const T* row) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T0);
}

// e^x for x <= 0 (softmax after subtracting the max): x = n ln2 + r, e^r by a degree-6 polynomial on
// |r| <= ln2/2 (relative error ~2e-7), times 2^n with scalef. Lanes below -87 flush towards 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One (sequence, KV head): scores for the G query heads over the visible tokens, softmax, then P @ V.
// kC = D / 16 vectors per K/V row, fixed at compile time so the row lives in registers.
template <typename T, int kC>
void attend_one(const T* q, T* out, const T* k_cache, const T* v_cache, const int64_t* table, int64_t first,
                int64_t len, int64_t head_base, int64_t bs, int64_t G, float scale, std::vector<float>& scores) {
  constexpr int64_t D = kC * 16;
  const int64_t n = len - first;
  scores.resize(static_cast<size_t>(G * n));
  __m512 qv[kMaxGroup][kC];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < kC; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * D + c * 16), _mm512_set1_ps(scale));

  // Pass 1: scores[g][t - first] = q_g . k_t, block by block so the table is read once per block.
  // Blocks sit anywhere in the pool, so the hardware prefetcher stops at each block's end: each row
  // prefetches the same row of the next block (the kernel ran ~4x slower from DRAM than from cache).
  const int64_t last_blk = (len - 1) / bs;
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / bs, end = std::min(len, (blk + 1) * bs);
    const T* row = k_cache + ((head_base + table[blk]) * bs + (t - blk * bs)) * D;
    const T* ahead = k_cache + ((head_base + table[std::min(blk + 1, last_blk)]) * bs + (t - blk * bs)) * D;
    for (; t < end; ++t, row += D, ahead += D) {
      prefetch_row<T, D>(ahead);
      __m512 kv[kC];
      for (int c = 0; c < kC; ++c) kv[c] = load16(row + c * 16);
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < kC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        scores[g * n + (t - first)] = _mm512_reduce_add_ps(acc);
      }
    }
  }

  // Softmax over each head's row, in place; inv_sum[g] is applied to the output at the end.
  float inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    __m512 mx = _mm512_set1_ps(-3.0e38f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    float m = _mm512_reduce_max_ps(mx);
    for (; i < n; ++i) m = std::max(m, s[i]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), mv));
      _mm512_mask_storeu_ps(s + i, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }

  // Pass 2: out_g = sum_t p[g][t] v_t, each V row converted once for all G heads.
  __m512 acc[kMaxGroup][kC];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = first; t < len;) {
    const int64_t blk = t / bs, end = std::min(len, (blk + 1) * bs);
    const T* row = v_cache + ((head_base + table[blk]) * bs + (t - blk * bs)) * D;
    const T* ahead = v_cache + ((head_base + table[std::min(blk + 1, last_blk)]) * bs + (t - blk * bs)) * D;
    for (; t < end; ++t, row += D, ahead += D) {
      prefetch_row<T, D>(ahead);
      __m512 vv[kC];
      for (int c = 0; c < kC; ++c) vv[c] = load16(row + c * 16);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * n + (t - first)]);
        for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
      }
    }
  }
  alignas(64) float tmp[D];
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < kC; ++c) _mm512_store_ps(tmp + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(tmp[d]);
  }
}

template <typename T, int kC>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& token_idx, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       double scale, int64_t window) {
  const int64_t B = token_idx.size(0), H = q.size(1), Hkv = k_cache.size(0), NB = k_cache.size(1);
  const int64_t bs = k_cache.size(2), G = H / Hkv, W = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tok = token_idx.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  constexpr int64_t D = kC * 16;
  // Work items are (sequence, KV head) pairs; grain 1 because their costs differ with context length.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv, len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t row = tok[b] * H + h * G;
      attend_one<T, kC>(qp + row * D, op + row * D, kp, vp, tables + b * W, first, len, h * NB, bs, G,
                        static_cast<float>(scale), scores);
    }
  });
}

// q, out: [T, H, D]; k_cache, v_cache: [Hkv, NB, bs, D] of q's dtype; token_idx [B], block_tables [B, W],
// seq_lens [B]: int64, for the B decode rows (token_idx[b] is the row of q/out). window <= 0: none.
void paged_decode_(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& token_idx, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              token_idx.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == q.scalar_type());
  TORCH_CHECK(token_idx.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= kMaxGroup, "unsupported head layout");
  TORCH_CHECK(token_idx.size(0) == block_tables.size(0) && seq_lens.size(0) == token_idx.size(0));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    switch (D) {
      case 16: return paged_decode_impl<T, 1>(q, out, k_cache, v_cache, token_idx, block_tables, seq_lens, scale, window);
      case 32: return paged_decode_impl<T, 2>(q, out, k_cache, v_cache, token_idx, block_tables, seq_lens, scale, window);
      case 64: return paged_decode_impl<T, 4>(q, out, k_cache, v_cache, token_idx, block_tables, seq_lens, scale, window);
      case 128: return paged_decode_impl<T, 8>(q, out, k_cache, v_cache, token_idx, block_tables, seq_lens, scale, window);
      default: TORCH_CHECK(false, "paged_decode_: head_dim must be 16, 32, 64 or 128, got ", D);
    }
  };
  if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else if (q.scalar_type() == at::kFloat) run(float{});
  else TORCH_CHECK(false, "paged_decode_: bfloat16 or float32 only");
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor token_idx, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_", &paged_decode_); }
