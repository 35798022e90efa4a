// Dense linear layers, float32 or bfloat16 weights as loaded ([N, K]), that compute every row of x alike,
// whatever else is in the call: y = x @ W^T.
//
// Why: torch's CPU matmuls choose their kernel and blocking by shape, so a token's row rounds one way in a
// 1-row decode step and another in a 5-row verification step or beside other sequences. Speculative decoding
// then drifts from decoding without it (float32 logprobs by ~1e-5, a greedy token at a near-tie), and a
// sequence's output depends on its batch. The quantized kernels never had this; this is the same property
// for float weights.
//
// How: output (m, n) is one fixed sequence of float32 multiply-adds over K. Sixteen lanes of partial sums,
// lane c taking k = c, c + 16, ... in order, then the lanes added by vec.h's reduce_add, whose tree is the
// same on AVX-512 and AVX2. Tiles of rows and of weight rows only decide which outputs share each load, and
// threads split the weight rows; so every row gets the bits it would get alone, on either instruction set.
// bfloat16 activations are widened to float32 once per call (exact), so the inner loop converts weights only.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvserve_cpu;

// Accumulators live in registers: R x NR of them plus NR weight vectors and one of x. AVX-512 has 32 vector
// registers; AVX2 has 16 of half the width, so there each tile runs as two passes over K, lanes 0-7 and then
// lanes 8-15 of every block of 16: the same sums, in half the registers.
#ifdef KVSERVE_VEC_AVX512
constexpr int kRows = 4, kCols = 4;  // a tile of activation rows x weight rows
constexpr int kOneRowCols = 8;       // one row (decode): enough independent sums to hide the FMA latency
#else
constexpr int kRows = 4, kCols = 3;
constexpr int kOneRowCols = 8;
#endif
// A panel of activation rows stays in L2 while a thread's weight rows pass by, a few at a time from L1: the
// larger the panel, the fewer times the weights are read. Its float32 rows take at most kPanelBytes, within
// the smallest L2 of the CPUs measured (Zen 3: 512 KB a core).
constexpr int64_t kPanelBytes = 256 * 1024;

// The next NR weight rows are prefetched as these are read: a tile's rows are NR streams a row apart, which
// the hardware prefetcher follows poorly (one decode row read bfloat16 weights at ~18 of ~28 GB/s without).
template <typename W, int NR>
inline void prefetch_next_rows(const W* w, int64_t ldw, int64_t k) {
  for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + j) * ldw + k), _MM_HINT_T0);
}

#ifdef KVSERVE_VEC_AVX512
// out[r][j] = x_r . w_j for R rows of x (float32, ldx apart) and NR weight rows (ldw apart), K values each.
template <typename W, int R, int NR, bool kPrefetch>
inline void dot_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float (*out)[kOneRowCols]) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  Vec16 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = zero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (kPrefetch && k % kLine == 0) prefetch_next_rows<W, NR>(w, ldw, k);
    Vec16 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * ldw + k);
    for (int r = 0; r < R; ++r) {
      const Vec16 xv = load16(x + r * ldx + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = fmadd(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {  // a tail of K: the missing lanes load as 0 and add 0 * 0
    Vec16 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load(w + j * ldw + k, K - k);
    for (int r = 0; r < R; ++r) {
      const Vec16 xv = load(x + r * ldx + k, K - k);
      for (int j = 0; j < NR; ++j) acc[r][j] = fmadd(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) out[r][j] = reduce_add(acc[r][j]);
}

#else
// As the AVX-512 dot_tile, lanes 0-7 of each block of 16 in a first pass and lanes 8-15 in a second.
template <typename W, int R, int NR, bool kPrefetch>
inline void dot_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float (*out)[kOneRowCols]) {
  constexpr int64_t kLine = 64 / sizeof(W);
  Vec16 sums[R][NR];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][NR];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      if (kPrefetch && h == 0 && k % kLine == 0) prefetch_next_rows<W, NR>(w, ldw, k);
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * ldw + k + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = load8(x + r * ldx + k + 8 * h);
        for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
    if (k < K) {  // this half of the tail's block: vec.h's load leaves the lanes past K at 0
      auto half = [h](Vec16 v) { return h == 0 ? v.lo : v.hi; };
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = half(load(w + j * ldw + k, K - k));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = half(load(x + r * ldx + k, K - k));
        for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) (h == 0 ? sums[r][j].lo : sums[r][j].hi) = acc[r][j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) out[r][j] = reduce_add(sums[r][j]);
}
#endif

// Rows [m0, m0 + R) x weight rows [n0, n0 + NR) of y.
template <typename W, typename T, int R, int NR, bool kPrefetch = true>
inline void tile(const float* x, const W* w, int64_t K, int64_t N, int64_t m0, int64_t n0, T* y) {
  static_assert(R <= kRows && NR <= kOneRowCols);
  float out[kRows][kOneRowCols];
  dot_tile<W, R, NR, kPrefetch>(x + m0 * K, K, w + n0 * K, K, K, out);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) y[(m0 + r) * N + n0 + j] = static_cast<T>(out[r][j]);
}

// Rows [m0, m0 + R) (R <= kRows) x weight rows [n_begin, n_end) of y, kCols weight rows at a time. Only the
// panel's first rows prefetch: the others find the weights in cache.
template <typename W, typename T, int R>
inline void row_tile(const float* x, const W* w, int64_t K, int64_t N, int64_t m0, int64_t n_begin, int64_t n_end,
                     T* y, bool first) {
  int64_t n = n_begin;
  for (; n + kCols <= n_end; n += kCols) {
    if (first) tile<W, T, R, kCols, true>(x, w, K, N, m0, n, y);
    else tile<W, T, R, kCols, false>(x, w, K, N, m0, n, y);
  }
  for (; n < n_end; ++n) tile<W, T, R, 1>(x, w, K, N, m0, n, y);
}

template <typename W, typename T>
void gemm(const float* x, const W* w, int64_t M, int64_t K, int64_t N, T* y) {
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    if (M == 1) {
      int64_t n = n_begin;
      for (; n + kOneRowCols <= n_end; n += kOneRowCols) tile<W, T, 1, kOneRowCols>(x, w, K, N, 0, n, y);
      for (; n < n_end; ++n) tile<W, T, 1, 1>(x, w, K, N, 0, n, y);
      return;
    }
    const int64_t panel = std::max<int64_t>(kRows, kPanelBytes / (K * static_cast<int64_t>(sizeof(float))));
    for (int64_t p0 = 0; p0 < M; p0 += panel) {
      const int64_t p1 = std::min(M, p0 + panel);
      // Within a panel, a few weight rows at a time meet every row of the panel (they stay in L1).
      for (int64_t c0 = n_begin; c0 < n_end; c0 += 4 * kCols) {
        const int64_t c1 = std::min(n_end, c0 + 4 * kCols);
        int64_t m = p0;
        for (; m + kRows <= p1; m += kRows) row_tile<W, T, kRows>(x, w, K, N, m, c0, c1, y, m == p0);
        switch (p1 - m) {  // the panel's last rows in one tile (a verification step's 5 rows: 4 + 1)
          case 0: break;
          case 1: row_tile<W, T, 1>(x, w, K, N, m, c0, c1, y, m == p0); break;
          case 2: row_tile<W, T, 2>(x, w, K, N, m, c0, c1, y, m == p0); break;
          default: row_tile<W, T, 3>(x, w, K, N, m, c0, c1, y, m == p0); break;
        }
      }
    }
  });
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// x [.., K] float32/bfloat16; weight [N, K] float32/bfloat16, contiguous -> y [.., N] of out_dtype (float32 or
// bfloat16; default x's). The sums are float32 either way: an LM head asks for float32 logits, which bfloat16
// would round to steps of 1/8 at magnitudes of 16, enough to tie two candidates for the top token.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "dense_linear: CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "dense_linear: weight [N, K], contiguous");
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "dense_linear: weight of shape ", weight.sizes(), " does not match in_features ",
              K);
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "dense_linear: float32 or bfloat16 activations and weights, got ", xt, " and ", wt);
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const auto yt = out_dtype.value_or(xt);
  TORCH_CHECK(yt == at::kFloat || yt == at::kBFloat16, "dense_linear: float32 or bfloat16 output, got ", yt);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options().dtype(yt));
  if (M == 0 || N == 0) return y;
  // float32 activations as one contiguous [M, K] block (bfloat16 ones widened: exact).
  const at::Tensor xf = x2.contiguous().to(at::kFloat);  // .to alone would keep a permuted view's strides
  const float* xp = xf.data_ptr<float>();
  auto run = [&](auto w_tag) {
    using W = decltype(w_tag);
    const W* wp = weight.data_ptr<W>();
    if (yt == at::kFloat) gemm<W, float>(xp, wp, M, K, N, y.data_ptr<float>());
    else gemm<W, c10::BFloat16>(xp, wp, M, K, N, y.data_ptr<c10::BFloat16>());
  };
  if (wt == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return y;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
